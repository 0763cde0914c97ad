"""Token refinement (`token_refinement`): tokens read the concepts in every layer; shapes, padding, save/reload,
`[CLS]` pooling, exact parameter, FLOP and activation accounting."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from concept_encoder import ConceptEncoderForMaskedLM, config_from_preset
from concept_encoder.accounting.flops import classifier_forward_flops, mlm_training_flops
from concept_encoder.accounting.memory import activation_bytes, parameter_count
from concept_encoder.model.heads import ConceptEncoderForSequenceClassification


def config(**overrides):
    fields = dict(vocab_size=300, hidden_dropout_prob=0.0, token_refinement=True, num_labels=10)
    return config_from_preset("micro", **{**fields, **overrides})


def test_refined_tokens_come_back_with_their_shape_and_differ_from_the_embeddings():
    torch.manual_seed(0)
    model = ConceptEncoderForSequenceClassification(config(classifier_pooling="cls")).eval()
    ids = torch.randint(5, 300, (3, 40))
    with torch.no_grad():
        out = model.encoder(ids)
        embedded = model.encoder.embeddings(ids, torch.arange(40).unsqueeze(0))
    assert out.last_hidden_state.shape == (3, 16, 64) and out.token_states.shape == (3, 40, 64)
    assert not torch.allclose(out.token_states, model.encoder.token_norm(embedded), atol=1e-3)
    plain = ConceptEncoderForMaskedLM(config(token_refinement=False)).eval()
    assert plain.encoder(ids).token_states is None and plain.encoder.layers[0].token_update is None


@pytest.mark.parametrize("layers", [2, 3])
def test_the_mlm_model_refines_in_all_but_its_last_layer_and_every_parameter_gets_a_gradient(layers):
    model = ConceptEncoderForMaskedLM(config(num_hidden_layers=layers))
    assert [layer.token_update is not None for layer in model.encoder.layers] == [True] * (layers - 1) + [False]
    ids = torch.randint(5, 300, (2, 30))
    labels = torch.full_like(ids, -100)
    labels[:, 3:9] = ids[:, 3:9]
    model(ids, labels=labels).loss.backward()
    assert [name for name, p in model.named_parameters() if p.grad is None] == []  # DDP/ZeRO need each one


def test_padding_changes_no_real_tokens_state_or_the_cls_logits():
    torch.manual_seed(0)
    model = ConceptEncoderForSequenceClassification(config(classifier_pooling="cls")).eval()
    ids = torch.randint(5, 300, (1, 30))
    padded = torch.cat([ids, torch.zeros(1, 10, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 30), torch.zeros(1, 10)], dim=1).long()
    with torch.no_grad():
        alone, with_pad = model.encoder(ids), model.encoder(padded, mask)
        torch.testing.assert_close(with_pad.token_states[:, :30], alone.token_states, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(model(padded, mask).logits, model(ids).logits, rtol=1e-5, atol=1e-5)


def test_cls_pooling_reads_the_first_tokens_refined_state():
    torch.manual_seed(0)
    model = ConceptEncoderForSequenceClassification(config(classifier_pooling="cls")).eval()
    ids = torch.randint(5, 300, (2, 20))
    with torch.no_grad():
        states = model.encoder(ids).token_states
        expected = model.classifier(torch.tanh(model.dense(states[:, 0])))
        torch.testing.assert_close(model(ids).logits, expected)


def test_saved_and_reloaded_with_the_setting(tmp_path):
    torch.manual_seed(0)
    model = ConceptEncoderForSequenceClassification(config(classifier_pooling="cls")).eval()
    model.save_pretrained(tmp_path)
    again = ConceptEncoderForSequenceClassification.from_pretrained(tmp_path).eval()
    assert again.config.token_refinement is True and again.config.classifier_pooling == "cls"
    ids = torch.randint(5, 300, (2, 25))
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, model(ids).logits)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(token_kv_sharing="all"), "token_kv_sharing none with token_refinement"),
        (dict(token_refinement=False, classifier_pooling="cls"), "set token_refinement=True"),
        (dict(token_refinement="yes"), "must be true or false"),
    ],
)
def test_impossible_settings_are_refused_naming_the_fix(overrides, message):
    with pytest.raises(ValueError, match=message):
        config(**overrides)


@pytest.mark.parametrize("decoder", ["perceiver", "weighted"])
def test_parameter_count_and_training_flops_equal_the_built_model(decoder):
    cfg = config(decoder_type=decoder)
    model = ConceptEncoderForMaskedLM(cfg)
    assert parameter_count(**cfg.to_dict())["total"] == sum(p.numel() for p in model.parameters())
    ids = torch.randint(5, 300, (2, 60))
    labels = torch.full_like(ids, -100)
    labels[:, :6] = ids[:, :6]
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(ids, labels=labels, return_logits=False).loss.backward()
    assert counter.get_total_flops() == mlm_training_flops(cfg.to_dict(), 2, 60, 6 / 60)


@pytest.mark.parametrize(("refine", "pooling"), [(True, "cls"), (True, "weighted"), (False, "mean")])
def test_classifier_forward_flops_equal_the_flop_counter(refine, pooling):
    cfg = config(token_refinement=refine, classifier_pooling=pooling)
    model = ConceptEncoderForSequenceClassification(cfg).eval()
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(torch.randint(5, 300, (3, 50)))
    assert counter.get_total_flops() == 3 * classifier_forward_flops(cfg.to_dict(), 50)


def test_refinement_adds_activation_memory_linear_in_the_tokens():
    fields = config().to_dict()
    plain = {**fields, "token_refinement": False}
    extra = [activation_bytes(2, n, **fields) - activation_bytes(2, n, **plain) for n in (500, 1000, 1500)]
    assert extra[0] > 0 and extra[2] - extra[1] == pytest.approx(extra[1] - extra[0], rel=1e-6)
