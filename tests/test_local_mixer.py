"""The local token mixer (`local_mixer: conv`, issue 54): shapes, reach, padding, a masked token's identity kept out,
save/reload (also through the copied code), old configs, meta device, exact parameter, FLOP and activation
accounting, the loop's arguments, the plan checker and `ablate`."""

import json

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from concept_encoder import ConceptEncoderForMaskedLM, config_from_preset
from concept_encoder.accounting.flops import classifier_forward_flops, mlm_training_flops
from concept_encoder.accounting.memory import activation_bytes, parameter_count
from concept_encoder.model.heads import ConceptEncoderForSequenceClassification

VOCAB, MASK = 300, 4


def config(**overrides):
    fields = dict(vocab_size=VOCAB, hidden_dropout_prob=0.0, local_mixer="conv", num_labels=5)
    return config_from_preset("micro", **{**fields, **overrides})


def logits_of(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids, **kwargs).logits


def test_the_mixer_keeps_the_shape_and_each_token_sees_exactly_its_window():
    torch.manual_seed(0)
    mixer = ConceptEncoderForMaskedLM(config(local_mixer_width=5)).encoder.local_mixer.eval()
    tokens = torch.randn(2, 20, 64)
    with torch.no_grad():
        mixed = mixer(tokens)  # [B,N,H]
        nudged = tokens.clone()
        nudged[0, 10] += 1.0
        changed = (mixer(nudged) - mixed).abs().amax(dim=-1)  # [B,N]
    assert mixed.shape == (2, 20, 64)
    assert changed[0].nonzero().flatten().tolist() == [8, 9, 10, 11, 12]  # width 5: two neighbours each side
    assert changed[1].abs().max() == 0


def test_off_by_default_and_an_old_config_without_the_keys_loads_as_none_bit_for_bit(tmp_path):
    assert config_from_preset("micro").local_mixer == "none"
    torch.manual_seed(0)
    old = ConceptEncoderForMaskedLM(config(local_mixer="none")).eval()
    assert old.encoder.local_mixer is None
    assert not any("local_mixer" in name for name, _ in old.named_parameters())
    old.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    for key in ("local_mixer", "local_mixer_width"):
        saved.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(saved))  # as written before the mixer existed
    again = ConceptEncoderForMaskedLM.from_pretrained(tmp_path).eval()
    assert again.config.local_mixer == "none" and again.encoder.local_mixer is None
    ids = torch.randint(5, VOCAB, (2, 24))
    assert torch.equal(logits_of(again, ids), logits_of(old, ids))
    torch.manual_seed(0)  # a config that never names the mixer builds the same weights: off draws nothing
    default = config_from_preset("micro", vocab_size=VOCAB, hidden_dropout_prob=0.0, num_labels=5)
    assert torch.equal(logits_of(ConceptEncoderForMaskedLM(default).eval(), ids), logits_of(old, ids))


def test_saved_and_reloaded_with_the_mixer_also_through_the_copied_code(tmp_path):
    from loop_runs import load_without_the_package

    torch.manual_seed(0)
    model = ConceptEncoderForMaskedLM(config(local_mixer_width=5)).eval()
    with torch.no_grad():
        model.encoder.local_mixer.conv.weight.normal_(0, 0.5)  # far from its near-identity start
    model.save_pretrained(tmp_path / "saved")
    again = ConceptEncoderForMaskedLM.from_pretrained(tmp_path / "saved").eval()
    assert (again.config.local_mixer, again.config.local_mixer_width) == ("conv", 5)
    ids = torch.arange(5, 21)[None]
    assert torch.equal(logits_of(again, ids), logits_of(model, ids))
    name, module, remote_sum = load_without_the_package(tmp_path / "saved", tmp_path, trust_remote_code=True)
    assert (name, module.split(".")[0]) == ("ConceptEncoderForMaskedLM", "transformers_modules")
    assert remote_sum == pytest.approx(float(logits_of(model, ids).double().sum()), rel=1e-6, abs=1e-6)


def test_a_masked_tokens_identity_cannot_reach_the_outputs_through_its_neighbours():
    """The input holds [MASK] at the masked positions and nothing upstream of the mixer sees the original: two
    different originals there give the same logits and concepts, while a change in the input does reach them."""
    torch.manual_seed(0)
    model = ConceptEncoderForMaskedLM(config()).eval()
    with torch.no_grad():
        model.encoder.local_mixer.conv.weight.normal_(0, 0.5)
    original = torch.randint(5, VOCAB, (2, 30))
    ids = original.clone()
    ids[:, 10] = MASK
    outputs = []
    for token in (17, 123):
        labels = torch.full_like(ids, -100)
        labels[:, 10] = token  # the original token at the masked position
        with torch.no_grad():
            out = model(ids, labels=labels)
        outputs.append((out.logits, out.concepts))
    assert torch.equal(outputs[0][0], outputs[1][0]) and torch.equal(outputs[0][1], outputs[1][1])
    with torch.no_grad():
        unmasked = model(original, labels=labels)
    assert not torch.allclose(unmasked.concepts, outputs[0][1])  # the input itself does reach the concepts


def test_padding_is_never_mixed_into_real_tokens():
    torch.manual_seed(0)
    model = ConceptEncoderForSequenceClassification(config(local_mixer_width=7)).eval()
    with torch.no_grad():
        model.encoder.local_mixer.conv.weight.normal_(0, 0.5)
    ids = torch.randint(5, VOCAB, (1, 30))
    padded = torch.cat([ids, torch.zeros(1, 10, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 30), torch.zeros(1, 10)], dim=1).long()
    with torch.no_grad():
        torch.testing.assert_close(model.encoder(padded, mask).last_hidden_state, model.encoder(ids).last_hidden_state)
        torch.testing.assert_close(model(padded, mask).logits, model(ids).logits)
        embedded = model.encoder.embeddings(padded, torch.arange(40).unsqueeze(0))  # [1,40,H]
        unmasked = model.encoder.local_mixer(embedded)  # the control: without the mask the pads leak in
        alone = model.encoder.local_mixer(embedded[:, :30])
    assert not torch.allclose(unmasked[:, 27:30], alone[:, 27:30])


def test_a_forward_on_the_meta_device_gives_the_shapes():
    with torch.device("meta"):
        model = ConceptEncoderForMaskedLM(config())
        ids = torch.randint(5, VOCAB, (2, 40))
        out = model(ids, attention_mask=torch.ones_like(ids), padded=True)
    assert out.logits.shape == (2, 40, VOCAB) and out.logits.device.type == "meta"
    assert out.concepts.shape == (2, 16, 64)


@pytest.mark.parametrize(("width", "refine"), [(3, False), (5, True)])
def test_parameter_count_and_training_flops_equal_the_built_model(width, refine):
    cfg = config(local_mixer_width=width, token_refinement=refine)
    model = ConceptEncoderForMaskedLM(cfg)
    counts = parameter_count(**cfg.to_dict())
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["local_mixer"] == sum(p.numel() for p in model.encoder.local_mixer.parameters())
    ids = torch.randint(5, VOCAB, (2, 60))
    labels = torch.full_like(ids, -100)
    labels[:, :6] = ids[:, :6]
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(ids, labels=labels, return_logits=False).loss.backward()
    # FlopCounterMode counts the depthwise weight gradient as a dense conv's, H times too much (see below)
    overcount = 2 * 2 * 60 * 64 * width * (64 - 1)
    assert counter.get_total_flops() == mlm_training_flops(cfg.to_dict(), 2, 60, 6 / 60) + overcount
    plain = {**cfg.to_dict(), "local_mixer": "none"}
    assert mlm_training_flops(cfg.to_dict(), 2, 60) - mlm_training_flops(plain, 2, 60) == 3 * 2 * 2 * 60 * 64 * width


def test_the_flop_counter_ignores_groups_in_a_convolutions_weight_gradient():
    """Why the training count above differs from `FlopCounterMode` by exactly (H-1)·2·B·N·H·w: torch's
    `conv_backward_flop` drops `groups`, so a depthwise filter's gradient is counted as a dense conv's. Forward
    and input gradient are counted right (2·B·N·H·w each); the true weight gradient is 2·B·N·H·w too. Should torch
    fix it, this test fails and the correction above goes."""
    conv = torch.nn.Conv1d(64, 64, 3, padding=1, groups=64)
    x = torch.randn(2, 64, 60, requires_grad=True)
    with FlopCounterMode(display=False) as forward:
        y = conv(x)
    with FlopCounterMode(display=False) as backward:
        y.sum().backward()
    one = 2 * 2 * 60 * 64 * 3
    assert forward.get_total_flops() == one and backward.get_total_flops() == one + 64 * one


def test_classifier_forward_flops_equal_the_flop_counter():
    cfg = config(classifier_pooling="mean")
    model = ConceptEncoderForSequenceClassification(cfg).eval()
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(torch.randint(5, VOCAB, (3, 50)))
    assert counter.get_total_flops() == 3 * classifier_forward_flops(cfg.to_dict(), 50)


def test_the_mixer_adds_activation_memory_linear_in_the_tokens():
    fields = config().to_dict()
    plain = {**fields, "local_mixer": "none"}
    extra = [activation_bytes(2, n, **fields) - activation_bytes(2, n, **plain) for n in (500, 1000)]
    assert extra == [3 * 2 * 500 * 64 * 2, 3 * 2 * 1000 * 64 * 2]  # 3·B·N·H 16-bit elements


def test_the_loop_builds_it_and_the_plan_checker_and_ablate_vary_it(capsys):
    import launch.check_plan as check_plan
    from concept_encoder.decide.ablate import plan_runs
    from concept_encoder.training.args import parse_args
    from concept_encoder.training.plan import fresh_model_fields

    model_args = parse_args(["--preset", "micro", "--local_mixer", "conv", "--local_mixer_width", "5"])[0]
    fields = fresh_model_fields(model_args, 128, VOCAB)
    assert (fields["local_mixer"], fields["local_mixer_width"]) == ("conv", 5)
    built = ConceptEncoderForMaskedLM(config_from_preset("micro", **{**fields, "vocab_size": VOCAB}))
    assert parameter_count(**fields)["total"] == sum(p.numel() for p in built.parameters())
    with pytest.raises(ValueError, match="local_mixer_width=4"):
        parse_args(["--preset", "micro", "--local_mixer", "conv", "--local_mixer_width", "4"])
    with pytest.raises(ValueError, match="--local_mixer applies to --architecture concept only"):
        parse_args(["--preset", "micro", "--architecture", "bert", "--local_mixer", "conv"])

    code = check_plan.main(["--preset", "micro", "--local_mixer", "conv", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and "--local_mixer conv" in data["command"]

    plans = plan_runs("local_mixer", ["none", "conv"], ["--preset", "micro"], "ablate")
    assert [p[0] for p in plans] == ["ablate-local_mixernone", "ablate-local_mixerconv"]
    assert [p[2]["model_args.local_mixer"] for p in plans] == ["none", "conv"]
