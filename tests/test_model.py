"""Model package: shapes, padding invariance, sparse loss, gradients, HF round trips, config errors."""

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification

from concept_encoder import (
    PRESETS,
    ConceptEncoder,
    ConceptEncoderConfig,
    ConceptEncoderForMaskedLM,
    ConceptEncoderForSequenceClassification,
    config_from_preset,
    parameter_counts,
    preset_parameter_counts,
)

DECODERS = ["perceiver", "posonly", "weighted"]
B, N, V, H, C = 3, 24, 97, 32, 8


def tiny_config(**overrides) -> ConceptEncoderConfig:
    fields = dict(
        vocab_size=V,
        hidden_size=H,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        concept_num=C,
        max_position_embeddings=64,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return ConceptEncoderConfig(**{**fields, **overrides})


def random_batch(seed: int = 0, batch: int = B, seq_len: int = N, mask_prob: float = 0.3):
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(5, V, (batch, seq_len), generator=g)
    labelled = torch.rand(batch, seq_len, generator=g) < mask_prob
    labelled[:, 0] = True  # every sample has at least one target
    labels = torch.where(labelled, input_ids, torch.full_like(input_ids, -100))
    input_ids = torch.where(labelled, torch.full_like(input_ids, 4), input_ids)
    return input_ids, labels


def eval_model(cls, **overrides):
    torch.manual_seed(0)
    return cls(tiny_config(**overrides)).eval()


@pytest.mark.parametrize("decoder", DECODERS)
def test_mlm_shapes_sparse_and_dense(decoder):
    model = eval_model(ConceptEncoderForMaskedLM, decoder_type=decoder)
    input_ids, labels = random_batch()
    out = model(input_ids, labels=labels)
    num_labelled = int(labels.ne(-100).sum())
    assert out.logits.shape == (num_labelled, V)
    assert out.concepts.shape == (B, C, H)
    assert out.loss.shape == () and torch.isfinite(out.loss)
    assert int(out.num_labelled) == num_labelled

    dense = model(input_ids)
    assert dense.logits.shape == (B, N, V)
    assert dense.loss is None


def test_encoder_and_classifier_shapes():
    input_ids, _ = random_batch()
    encoder = eval_model(ConceptEncoder)
    assert encoder(input_ids).last_hidden_state.shape == (B, C, H)
    for num_labels, labels in [
        (1, torch.randn(B)),
        (3, torch.tensor([0, 2, 1])),
        (4, torch.randint(0, 2, (B, 4)).float()),
    ]:
        model = eval_model(ConceptEncoderForSequenceClassification, num_labels=num_labels)
        out = model(input_ids, labels=labels)
        assert out.logits.shape == (B, num_labels)
        assert out.loss.shape == () and torch.isfinite(out.loss)
    assert model.config.problem_type == "multi_label_classification"


@pytest.mark.parametrize("decoder", DECODERS)
def test_sparse_loss_equals_dense_cross_entropy(decoder):
    model = eval_model(ConceptEncoderForMaskedLM, decoder_type=decoder)
    input_ids, labels = random_batch(seed=1)
    sparse = model(input_ids, labels=labels)
    dense_logits = model(input_ids).logits  # [B,N,V]
    dense_loss = F.cross_entropy(dense_logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(sparse.loss, dense_loss, rtol=1e-5, atol=1e-5)
    # Sparse logits are the dense logits at the labelled positions, in row-major order.
    torch.testing.assert_close(sparse.logits, dense_logits[labels.ne(-100)], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("decoder", DECODERS)
def test_loss_without_logits_equals_loss_with_logits(decoder):
    """`return_logits=False` (the training loop's path) changes nothing but the missing logits."""
    model = ConceptEncoderForMaskedLM(tiny_config(decoder_type=decoder)).train()
    input_ids, labels = random_batch(seed=2)
    outputs, grads = [], []
    for return_logits in (True, False):
        model.zero_grad()
        out = model(input_ids, labels=labels, return_logits=return_logits)
        out.loss.backward()
        outputs.append(out)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert outputs[1].logits is None and outputs[0].logits.shape == (int(labels.ne(-100).sum()), V)
    torch.testing.assert_close(outputs[1].loss, outputs[0].loss)
    assert int(outputs[1].num_labelled) == int(outputs[0].num_labelled)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, msg=lambda m, name=name: f"{name}: {m}")


def test_no_labelled_position_gives_zero_loss_not_nan():
    model = eval_model(ConceptEncoderForMaskedLM)
    input_ids, _ = random_batch()
    out = model(input_ids, labels=torch.full_like(input_ids, -100))
    assert out.loss.item() == 0.0 and out.logits.shape == (0, V)


@pytest.mark.parametrize("decoder", DECODERS)
def test_padding_invariance(decoder):
    model = eval_model(ConceptEncoderForMaskedLM, decoder_type=decoder)
    input_ids, labels = random_batch(seed=2)
    pad = 9
    padded_ids = torch.cat([input_ids, torch.zeros(B, pad, dtype=torch.long)], dim=1)
    padded_labels = torch.cat([labels, torch.full((B, pad), -100)], dim=1)
    mask = torch.cat([torch.ones(B, N, dtype=torch.long), torch.zeros(B, pad, dtype=torch.long)], dim=1)

    ref = model(input_ids, labels=labels)
    out = model(padded_ids, attention_mask=mask, labels=padded_labels)
    torch.testing.assert_close(out.concepts, ref.concepts, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.loss, ref.loss, rtol=1e-5, atol=1e-5)
    dense = model(padded_ids, attention_mask=mask).logits[:, :N]
    torch.testing.assert_close(dense, model(input_ids).logits, rtol=1e-5, atol=1e-5)


def test_padding_of_different_lengths_per_sample():
    """Each sample, padded to the batch length, encodes as it does alone."""
    model = eval_model(ConceptEncoder)
    lengths = [24, 10, 17]
    input_ids, _ = random_batch(seed=3)
    mask = torch.zeros(B, N, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    batched = model(input_ids, attention_mask=mask).last_hidden_state
    for i, n in enumerate(lengths):
        alone = model(input_ids[i : i + 1, :n]).last_hidden_state[0]
        torch.testing.assert_close(batched[i], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("decoder", DECODERS)
def test_every_parameter_gets_a_gradient_mlm(decoder):
    model = ConceptEncoderForMaskedLM(tiny_config(decoder_type=decoder)).train()
    input_ids, labels = random_batch()
    model(input_ids, labels=labels).loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without gradient: {missing}"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("pooling", ["weighted", "mean"])
def test_every_parameter_gets_a_gradient_classifier(pooling):
    model = ConceptEncoderForSequenceClassification(tiny_config(num_labels=3, classifier_pooling=pooling))
    input_ids, _ = random_batch()
    model(input_ids, labels=torch.tensor([0, 1, 2])).loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without gradient: {missing}"


def test_word_embeddings_are_tied_and_can_be_untied():
    tied = ConceptEncoderForMaskedLM(tiny_config())
    assert tied.lm_head.decoder.weight is tied.encoder.embeddings.word_embeddings.weight
    untied = ConceptEncoderForMaskedLM(tiny_config(tie_word_embeddings=False))
    assert untied.lm_head.decoder.weight is not untied.encoder.embeddings.word_embeddings.weight
    assert parameter_counts(untied)["total"] - parameter_counts(tied)["total"] == V * H


@pytest.mark.parametrize("decoder", DECODERS)
def test_save_load_round_trip_and_auto_classes(tmp_path, decoder):
    model = eval_model(ConceptEncoderForMaskedLM, decoder_type=decoder)
    input_ids, labels = random_batch(seed=4)
    ref = model(input_ids, labels=labels)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()

    for loader in (ConceptEncoderForMaskedLM, AutoModelForMaskedLM):
        loaded = loader.from_pretrained(tmp_path).eval()
        assert isinstance(loaded, ConceptEncoderForMaskedLM)
        assert loaded.lm_head.decoder.weight is loaded.encoder.embeddings.word_embeddings.weight
        out = loaded(input_ids, labels=labels)
        torch.testing.assert_close(out.logits, ref.logits, rtol=0, atol=0)
        torch.testing.assert_close(out.loss, ref.loss, rtol=0, atol=0)

    assert AutoConfig.from_pretrained(tmp_path).decoder_type == decoder
    backbone = AutoModel.from_pretrained(tmp_path).eval()
    assert isinstance(backbone, ConceptEncoder)
    torch.testing.assert_close(backbone(input_ids).last_hidden_state, ref.concepts, rtol=0, atol=0)
    classifier = AutoModelForSequenceClassification.from_pretrained(tmp_path, num_labels=2)
    assert isinstance(classifier, ConceptEncoderForSequenceClassification)
    torch.testing.assert_close(classifier.encoder.concepts, model.encoder.concepts, rtol=0, atol=0)


def test_classifier_round_trip(tmp_path):
    model = eval_model(ConceptEncoderForSequenceClassification, num_labels=3)
    input_ids, _ = random_batch()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForSequenceClassification.from_pretrained(tmp_path).eval()
    torch.testing.assert_close(loaded(input_ids).logits, model(input_ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(hidden_size=30, num_attention_heads=4), "hidden_size=30 is not divisible by num_attention_heads=4"),
        (dict(concept_num=0), "concept_num"),
        (dict(vocab_size=-1), "vocab_size"),
        (dict(num_hidden_layers=0), "num_hidden_layers"),
        (dict(intermediate_size=0), "intermediate_size"),
        (dict(max_position_embeddings=0), "max_position_embeddings"),
        (dict(hidden_dropout_prob=1.5), "hidden_dropout_prob"),
        (dict(decoder_type="mlp"), "decoder_type"),
        (dict(classifier_pooling="max"), "classifier_pooling"),
        (dict(mask_token_id=500), "mask_token_id"),
        (dict(initializer_range=0.0), "initializer_range"),
        (dict(local_mixer="lstm"), "local_mixer='lstm' is unknown"),
        (dict(local_mixer_width=4), "local_mixer_width=4 must be an odd positive integer"),
        (dict(local_mixer_width=0), "local_mixer_width=0 must be an odd positive integer"),
    ],
)
def test_bad_config_raises_value_error_naming_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        tiny_config(**overrides)


def test_sequence_longer_than_position_table_is_a_clear_error():
    model = eval_model(ConceptEncoderForMaskedLM)
    with pytest.raises(ValueError, match="max_position_embeddings=64"):
        model(torch.ones(1, 65, dtype=torch.long))


def test_presets_build_and_counts_are_exact():
    counts = preset_parameter_counts(vocab_size=V)
    assert set(counts) == set(PRESETS)
    model = ConceptEncoderForMaskedLM(config_from_preset("micro", vocab_size=V))
    assert counts["micro"]["total"] == sum(p.numel() for p in model.parameters())
    assert counts["micro"]["total"] == sum(v for k, v in counts["micro"].items() if k not in ("total", "trainable"))
    totals = [counts[name]["total"] for name in ("micro", "tiny", "small", "base", "large", "xl")]
    assert totals == sorted(totals)
    with pytest.raises(ValueError, match="unknown preset 'huge'"):
        config_from_preset("huge")


def test_gradient_checkpointing_gives_the_same_gradients():
    input_ids, labels = random_batch()
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = ConceptEncoderForMaskedLM(tiny_config()).train()
        if checkpointing:
            model.activation_checkpointing_enable()
        model(input_ids, labels=labels).loss.backward()
        grads.append(model.encoder.concepts.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])


def test_construct_draws_weights_from_the_seed_alone_and_leaves_the_global_rng_alone():
    from concept_encoder.model.bert_baseline import BertForSparseMaskedLM, bert_config
    from concept_encoder.model.construct import construct
    from concept_encoder.training.model import held_parameters

    config = config_from_preset("micro", vocab_size=300)
    torch.manual_seed(123)
    first = construct(ConceptEncoderForMaskedLM, config, seed=7)
    after = torch.rand(3)
    torch.manual_seed(456)
    second = construct(ConceptEncoderForMaskedLM, config, seed=7)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(3), after)  # construction drew nothing from the global generator
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    other = construct(ConceptEncoderForMaskedLM, config, seed=8)
    assert not torch.equal(other.encoder.concepts, first.encoder.concepts)
    assert float(first.encoder.concepts.detach().std()) == pytest.approx(
        config.initializer_range, rel=0.2
    )  # initialised, not empty
    assert first.lm_head.decoder.weight is first.encoder.embeddings.word_embeddings.weight  # still tied
    held = held_parameters(first)
    assert held["local"] == held["total"] == sum(p.numel() for p in {id(p): p for p in first.parameters()}.values())
    bert = construct(BertForSparseMaskedLM, bert_config(PRESETS["micro"], 300, pad_token_id=0), seed=7)
    assert float(bert.bert.embeddings.word_embeddings.weight.detach().std()) == pytest.approx(0.02, rel=0.2)


def test_a_long_model_is_built_at_its_length_saves_reloads_and_stops_beyond_it(tmp_path):
    """The position table is sized from `--max_seq_length` (`fresh_model_fields`): a model built for 8,192 tokens
    reads 8,192 after a save and reload, and one token more is refused (the learned table has no row for it)."""
    from concept_encoder.training.args import parse_args
    from concept_encoder.training.plan import fresh_model_fields

    model_args, data_args, _ = parse_args(["--preset", "micro", "--max_seq_length", "8192"])
    fields = fresh_model_fields(model_args, data_args.max_seq_length, vocab_size=V)
    assert fields["max_position_embeddings"] == 8192
    torch.manual_seed(0)
    model = ConceptEncoderForMaskedLM(ConceptEncoderConfig(**fields)).eval()
    model.save_pretrained(tmp_path / "long")
    reloaded = AutoModelForMaskedLM.from_pretrained(tmp_path / "long").eval()
    ids = torch.randint(5, V, (1, 8192))
    labels = torch.full_like(ids, -100)
    labels[0, ::512] = ids[0, ::512]  # a few predicted positions across the whole length, the last ones included
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=ids, labels=labels).loss, reloaded(input_ids=ids, labels=labels).loss
        )
    assert reloaded.config.max_position_embeddings == 8192
    with pytest.raises(ValueError, match="sequence length 8193 exceeds max_position_embeddings=8192"):
        reloaded(input_ids=torch.randint(5, V, (1, 8193)))
