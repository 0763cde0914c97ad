"""The local token mixer (`local_mixer: conv`, issue 54), at each `local_mixer_placement` (`first`: once before the
first layer; `every`: a mixer of its own before each layer): shapes, reach, padding, a masked token's identity kept
out, save/reload (also through the copied code), old configs, meta device, refusals, exact parameter, FLOP and
activation accounting, the loop's arguments, the plan checker and `ablate`."""

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
PLACEMENTS = ("first", "every")
LAYERS = 2  # the micro preset's


def config(**overrides):
    fields = dict(vocab_size=VOCAB, hidden_dropout_prob=0.0, local_mixer="conv", num_labels=5)
    return config_from_preset("micro", **{**fields, **overrides})


def logits_of(model, ids, **kwargs):
    with torch.no_grad():
        return model(ids, **kwargs).logits


def mixers(model) -> list:
    """The model's `LocalMixer`s: the one before the first layer, or one per layer."""
    encoder = model.encoder
    return [encoder.local_mixer] if encoder.local_mixer is not None else list(encoder.local_mixers)


def scramble(model, std: float = 0.5) -> None:
    """Move every mixer's filters far from their near-identity start, so what they mix shows."""
    with torch.no_grad():
        for mixer in mixers(model):
            mixer.conv.weight.normal_(0, std)


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


@pytest.mark.parametrize(("placement", "reach"), [("first", [[9, 10, 11], [9, 10, 11]]),
                                                  ("every", [[9, 10, 11], [8, 9, 10, 11, 12]])])  # fmt: skip
def test_each_layer_reads_tokens_mixed_once_or_once_more_per_layer(placement, reach):
    """Without token refinement the tokens persist between layers: under `every` layer l reads the embeddings mixed
    l+1 times, so one token's change reaches w-1 more positions per layer; under `first` every layer reads the same
    once-mixed tokens."""
    torch.manual_seed(0)
    model = ConceptEncoderForMaskedLM(config(local_mixer_placement=placement)).eval()
    scramble(model)
    read = []
    hooks = [layer.register_forward_pre_hook(lambda _, args: read.append(args[1])) for layer in model.encoder.layers]
    ids = torch.randint(5, VOCAB, (2, 24))
    nudged = ids.clone()
    nudged[:, 10] = ids[:, 10] % 200 + 50  # another token at position 10 only
    with torch.no_grad():
        out = model(ids)
        model(nudged)
    for hook in hooks:
        hook.remove()
    assert out.logits.shape == (2, 24, VOCAB) and out.concepts.shape == (2, 16, 64)
    assert [tokens.shape for tokens in read] == [(2, 24, 64)] * 4  # [B,N,H] into each layer, twice
    for layer in range(LAYERS):
        changed = (read[LAYERS + layer] - read[layer]).abs().amax(dim=-1)  # [B,N]
        assert changed[0].nonzero().flatten().tolist() == reach[layer]


def test_every_layer_has_a_mixer_of_its_own_and_the_outputs_differ_from_first():
    torch.manual_seed(0)
    first = ConceptEncoderForMaskedLM(config()).eval()
    every = ConceptEncoderForMaskedLM(config(local_mixer_placement="every")).eval()
    one = sum(p.numel() for p in first.encoder.local_mixer.parameters())
    assert every.encoder.local_mixer is None and len(every.encoder.local_mixers) == LAYERS
    total = sum(p.numel() for p in every.parameters())
    assert total == sum(p.numel() for p in first.parameters()) + (LAYERS - 1) * one
    weights = [mixer.conv.weight for mixer in every.encoder.local_mixers]
    assert len({w.data_ptr() for w in weights}) == LAYERS  # separate tensors, not one module shared
    scramble(first)
    shared = {k: v for k, v in first.state_dict().items() if "local_mixer" not in k}
    assert not every.load_state_dict(shared, strict=False).unexpected_keys  # every other weight equal
    every.encoder.local_mixers[0].load_state_dict(first.encoder.local_mixer.state_dict())  # and the first mixer
    with torch.no_grad():
        every.encoder.local_mixers[1].conv.weight.normal_(0, 0.5)
    ids = torch.randint(5, VOCAB, (2, 24))
    assert not torch.allclose(logits_of(every, ids), logits_of(first, ids))


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (dict(local_mixer_placement="last"), r"placement='last' is unknown; choose one of \('first', 'every'\)"),
        (dict(local_mixer="none", local_mixer_placement="every"), "local_mixer_placement=every needs local_mixer=conv"),
        (dict(local_mixer_placement="every", token_kv_sharing="all"), "token_kv_sharing='all' .* cannot hold"),
        (dict(local_mixer_placement="every", token_kv_sharing="groups:2"), "token_kv_sharing='groups:2'"),
    ],
)
def test_a_placement_that_cannot_be_built_is_refused_in_one_line(overrides, message):
    with pytest.raises(ValueError, match=message) as raised:
        config(**overrides)
    assert "\n" not in str(raised.value)


def test_off_by_default_and_an_old_config_without_the_keys_loads_as_none_bit_for_bit(tmp_path):
    assert config_from_preset("micro").local_mixer == "none"
    torch.manual_seed(0)
    old = ConceptEncoderForMaskedLM(config(local_mixer="none")).eval()
    assert old.encoder.local_mixer is None
    assert not any("local_mixer" in name for name, _ in old.named_parameters())
    old.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    for key in ("local_mixer", "local_mixer_width", "local_mixer_placement"):
        saved.pop(key)
    (tmp_path / "config.json").write_text(json.dumps(saved))  # as written before the mixer existed
    again = ConceptEncoderForMaskedLM.from_pretrained(tmp_path).eval()
    assert again.config.local_mixer == "none" and again.encoder.local_mixer is None
    assert again.config.local_mixer_placement == "first" and again.encoder.local_mixers is None
    ids = torch.randint(5, VOCAB, (2, 24))
    assert torch.equal(logits_of(again, ids), logits_of(old, ids))
    torch.manual_seed(0)  # a config that never names the mixer builds the same weights: off draws nothing
    default = config_from_preset("micro", vocab_size=VOCAB, hidden_dropout_prob=0.0, num_labels=5)
    assert torch.equal(logits_of(ConceptEncoderForMaskedLM(default).eval(), ids), logits_of(old, ids))


def test_a_mixer_config_saved_without_the_placement_loads_as_first_bit_for_bit(tmp_path):
    torch.manual_seed(0)
    model = ConceptEncoderForMaskedLM(config()).eval()
    scramble(model)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved.pop("local_mixer_placement")
    (tmp_path / "config.json").write_text(json.dumps(saved))  # as written before the placement existed
    again = ConceptEncoderForMaskedLM.from_pretrained(tmp_path).eval()
    assert again.config.local_mixer_placement == "first" and again.encoder.local_mixers is None
    ids = torch.randint(5, VOCAB, (2, 24))
    assert torch.equal(logits_of(again, ids), logits_of(model, ids))


@pytest.mark.parametrize(("placement", "decoder"), [("first", "perceiver"), ("every", "perceiver"), ("every", "mixed")])
def test_saved_and_reloaded_with_the_mixer_also_through_the_copied_code(tmp_path, placement, decoder):
    from loop_runs import load_without_the_package

    torch.manual_seed(0)
    built = config(local_mixer_width=5, local_mixer_placement=placement, decoder_type=decoder)
    model = ConceptEncoderForMaskedLM(built).eval()
    scramble(model)  # far from its near-identity start
    model.save_pretrained(tmp_path / "saved")
    again = ConceptEncoderForMaskedLM.from_pretrained(tmp_path / "saved").eval()
    assert (again.config.local_mixer, again.config.local_mixer_width) == ("conv", 5)
    assert again.config.local_mixer_placement == placement and len(mixers(again)) == len(mixers(model))
    assert again.config.decoder_type == decoder
    ids = torch.arange(5, 21)[None]
    assert torch.equal(logits_of(again, ids), logits_of(model, ids))
    name, module, remote_sum = load_without_the_package(tmp_path / "saved", tmp_path, trust_remote_code=True)
    assert (name, module.split(".")[0]) == ("ConceptEncoderForMaskedLM", "transformers_modules")
    assert remote_sum == pytest.approx(float(logits_of(model, ids).double().sum()), rel=1e-6, abs=1e-6)


PLACED = [("first", False), ("every", False), ("every", True)]  # (placement, token_refinement)


@pytest.mark.parametrize("decoder", ["perceiver", "mixed"])
@pytest.mark.parametrize(("placement", "refine"), PLACED)
def test_a_masked_tokens_identity_cannot_reach_the_outputs_through_its_neighbours(placement, refine, decoder):
    """The input holds [MASK] at the masked positions and nothing upstream of the mixers sees the original: two
    different originals there give the same logits and concepts, while a change in the input does reach them; with
    the decoder's queries unmixed (`perceiver`) or mixed."""
    torch.manual_seed(0)
    built = config(local_mixer_placement=placement, token_refinement=refine, decoder_type=decoder)
    model = ConceptEncoderForMaskedLM(built).eval()
    scramble(model)
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


def decoder_queries(model, ids, labels) -> torch.Tensor:
    """The queries `[B,M,H]` the MLM decoder's first layer receives for `ids [B,N]` with `labels [B,N]`."""
    seen = []
    hook = model.mlm_decoder.layers[0].register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    with torch.no_grad():
        model(ids, labels=labels)
    hook.remove()
    return seen[0]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_the_mixed_decoders_queries_see_their_neighbours_and_the_perceivers_do_not(placement):
    """`decoder_type` mixed: a masked position's query is its token as the first layer reads it, after the mixer, so
    it changes with a neighbour inside the window and not with a token outside it; `perceiver`'s ([MASK] + position)
    changes with neither. The sparse (labelled) path decodes what the dense one does at the labelled positions."""
    ids = torch.randint(5, VOCAB, (2, 30))
    ids[:, 10] = MASK
    labels = torch.full_like(ids, -100)
    labels[0, 10], labels[1, [4, 10]] = 7, 8
    near, far = ids.clone(), ids.clone()
    near[:, 11] = (ids[:, 11] + 1 - 5) % (VOCAB - 5) + 5  # the masked position's neighbour: another token
    far[:, 14] = (ids[:, 14] + 1 - 5) % (VOCAB - 5) + 5  # outside the width-3 window
    for decoder in ("perceiver", "mixed"):
        torch.manual_seed(0)
        model = ConceptEncoderForMaskedLM(config(local_mixer_placement=placement, decoder_type=decoder)).eval()
        scramble(model)
        queries = decoder_queries(model, ids, labels)  # [B,M,H]: sample 0's one label, sample 1's two
        assert queries.shape == (2, 2, 64)
        moved = (decoder_queries(model, near, labels) - queries).abs().amax(dim=-1)  # [B,M]
        slots = torch.stack([moved[0, 0], moved[1, 1]])  # position 10's slot in each sample
        assert (slots > 0).tolist() == [decoder == "mixed"] * 2 and moved[1, 0] == 0  # position 4: far from 11
        assert torch.equal(decoder_queries(model, far, labels), queries)
        with torch.no_grad():
            sparse, dense = model(ids, labels=labels).logits, model(ids).logits  # [L,V], [B,N,V]
        torch.testing.assert_close(sparse, dense[labels != -100])


def test_a_mixed_decoder_without_a_mixer_or_under_tsdae_is_refused_in_one_line():
    from concept_encoder.training.args import parse_args

    refused = [
        (lambda: config(local_mixer="none", decoder_type="mixed"), "decoder_type=mixed .* set local_mixer conv"),
        (lambda: parse_args(["--preset", "micro", "--decoder_type", "mixed"]), "local_mixer='none' has none"),
        (lambda: parse_args(["--preset", "micro", "--local_mixer", "conv", "--decoder_type", "mixed", "--objective",
                             "tsdae"]), "tsdae with --decoder_type mixed would hand the decoder the deleted tokens"),
    ]  # fmt: skip
    for build, message in refused:
        with pytest.raises(ValueError, match=message) as raised:
            build()
        assert "\n" not in str(raised.value)


@pytest.mark.parametrize(("placement", "refine"), PLACED)
def test_padding_is_never_mixed_into_real_tokens(placement, refine):
    torch.manual_seed(0)
    cfg = config(local_mixer_width=7, local_mixer_placement=placement, token_refinement=refine)
    model = ConceptEncoderForSequenceClassification(cfg).eval()
    scramble(model)
    ids = torch.randint(5, VOCAB, (1, 30))
    padded = torch.cat([ids, torch.zeros(1, 10, dtype=torch.long)], dim=1)
    mask = torch.cat([torch.ones(1, 30), torch.zeros(1, 10)], dim=1).long()
    with torch.no_grad():
        torch.testing.assert_close(model.encoder(padded, mask).last_hidden_state, model.encoder(ids).last_hidden_state)
        torch.testing.assert_close(model(padded, mask).logits, model(ids).logits)
        embedded = model.encoder.embeddings(padded, torch.arange(40).unsqueeze(0))  # [1,40,H]
        unmasked = mixers(model)[0](embedded)  # the control: without the mask the pads leak in
        alone = mixers(model)[0](embedded[:, :30])
    assert not torch.allclose(unmasked[:, 27:30], alone[:, 27:30])


@pytest.mark.parametrize(("placement", "decoder"), [("first", "perceiver"), ("every", "perceiver"), ("first", "mixed")])
def test_a_forward_on_the_meta_device_gives_the_shapes(placement, decoder):
    with torch.device("meta"):
        model = ConceptEncoderForMaskedLM(config(local_mixer_placement=placement, decoder_type=decoder))
        ids = torch.randint(5, VOCAB, (2, 40))
        out = model(ids, attention_mask=torch.ones_like(ids), padded=True)
    assert out.logits.shape == (2, 40, VOCAB) and out.logits.device.type == "meta"
    assert out.concepts.shape == (2, 16, 64)


@pytest.mark.parametrize(
    ("width", "refine", "placement", "decoder"),
    [(3, False, "first", "perceiver"), (5, True, "first", "mixed"), (3, False, "every", "mixed"),
     (5, True, "every", "perceiver")],
)  # fmt: skip
def test_parameter_count_and_training_flops_equal_the_built_model(width, refine, placement, decoder):
    cfg = config(
        local_mixer_width=width, token_refinement=refine, local_mixer_placement=placement, decoder_type=decoder
    )
    model = ConceptEncoderForMaskedLM(cfg)
    count = LAYERS if placement == "every" else 1
    counts = parameter_count(**cfg.to_dict())
    assert counts["total"] == sum(p.numel() for p in model.parameters())
    assert counts["local_mixer"] == sum(p.numel() for m in mixers(model) for p in m.parameters())
    assert counts["local_mixer"] == count * (64 * width + 3 * 64)
    ids = torch.randint(5, VOCAB, (2, 60))
    labels = torch.full_like(ids, -100)
    labels[:, :6] = ids[:, :6]
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(ids, labels=labels, return_logits=False).loss.backward()
    # FlopCounterMode counts the depthwise weight gradient as a dense conv's, H times too much (see below)
    overcount = count * 2 * 2 * 60 * 64 * width * (64 - 1)
    assert counter.get_total_flops() == mlm_training_flops(cfg.to_dict(), 2, 60, 6 / 60) + overcount
    plain = {**cfg.to_dict(), "local_mixer": "none", "local_mixer_placement": "first"}
    extra = mlm_training_flops(cfg.to_dict(), 2, 60) - mlm_training_flops(plain, 2, 60)
    assert extra == count * 3 * 2 * 2 * 60 * 64 * width
    assert all(p.grad is not None for m in mixers(model) for p in m.parameters())  # every mixer is trained


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


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_classifier_forward_flops_equal_the_flop_counter(placement):
    cfg = config(classifier_pooling="mean", local_mixer_placement=placement)
    model = ConceptEncoderForSequenceClassification(cfg).eval()
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(torch.randint(5, VOCAB, (3, 50)))
    assert counter.get_total_flops() == 3 * classifier_forward_flops(cfg.to_dict(), 50)


@pytest.mark.parametrize(("placement", "checkpointing"), [("first", False), ("every", False), ("every", True)])
def test_the_mixer_adds_activation_memory_linear_in_the_tokens(placement, checkpointing):
    fields = config(local_mixer_placement=placement).to_dict()
    plain = {**fields, "local_mixer": "none", "local_mixer_placement": "first"}
    extra = [
        activation_bytes(2, n, gradient_checkpointing=checkpointing, **fields)
        - activation_bytes(2, n, gradient_checkpointing=checkpointing, **plain)
        for n in (500, 1000)
    ]
    count = LAYERS if placement == "every" else 1  # the mixers sit outside the checkpointed layers
    assert extra == [count * 3 * 2 * 500 * 64 * 2, count * 3 * 2 * 1000 * 64 * 2]  # 3·B·N·H 16-bit elements each


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
    assert fields["local_mixer_placement"] == model_args.local_mixer_placement == "first"
    model_args = parse_args(["--preset", "micro", "--local_mixer", "conv", "--local_mixer_placement", "every"])[0]
    fields = fresh_model_fields(model_args, 128, VOCAB)
    built = ConceptEncoderForMaskedLM(config_from_preset("micro", **{**fields, "vocab_size": VOCAB}))
    assert fields["local_mixer_placement"] == "every" and len(built.encoder.local_mixers) == LAYERS
    assert parameter_count(**fields)["total"] == sum(p.numel() for p in built.parameters())
    with pytest.raises(ValueError, match="local_mixer_width=4"):
        parse_args(["--preset", "micro", "--local_mixer", "conv", "--local_mixer_width", "4"])
    with pytest.raises(ValueError, match="--local_mixer and --local_mixer_placement apply to --architecture concept"):
        parse_args(["--preset", "micro", "--architecture", "bert", "--local_mixer", "conv"])
    for argv, message in ((["--local_mixer_placement", "every"], "needs local_mixer=conv"),
                          (["--local_mixer", "conv", "--local_mixer_placement", "each"], "is unknown"),
                          (["--local_mixer", "conv", "--local_mixer_placement", "every", "--token_kv_sharing", "all"],
                           "token_kv_sharing='all'")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            parse_args(["--preset", "micro", *argv])

    code = check_plan.main(["--preset", "micro", "--local_mixer", "conv", "--json"])
    data = json.loads(capsys.readouterr().out)
    assert code == 0 and "--local_mixer conv" in data["command"]

    plans = plan_runs("local_mixer", ["none", "conv"], ["--preset", "micro"], "ablate")
    assert [p[0] for p in plans] == ["ablate-local_mixernone", "ablate-local_mixerconv"]
    assert [p[2]["model_args.local_mixer"] for p in plans] == ["none", "conv"]


@pytest.mark.parametrize(("placement", "decoder"), [("first", "perceiver"), ("every", "perceiver"), ("every", "mixed")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_under_autocast_the_mixer_computes_what_float32_does_and_its_gradients_stay_float32(placement, decoder, dtype):
    """The bf16 and fp16 paths of a GPU run, on the CPU: fp32 weights under `torch.autocast`, the loss scaled by a
    real `GradScaler` for fp16. The mixer's convolution runs in the low precision, its LayerNorm in float32; the
    logits stay close to float32's and every mixer's gradients are float32, finite and point where float32's do;
    also when the decoder's queries are the mixed tokens (`mixed`)."""
    torch.manual_seed(0)
    model = ConceptEncoderForMaskedLM(config(local_mixer_placement=placement, decoder_type=decoder)).train()
    scramble(model, std=0.3)
    ids = torch.randint(5, VOCAB, (2, 24))
    ids[:, 3] = MASK
    labels = torch.full_like(ids, -100)
    labels[:, 3] = 7

    def loss_and_grads(autocast: bool):
        model.zero_grad()
        torch.manual_seed(1)  # the same dropout masks both times
        with torch.autocast("cpu", dtype=dtype, enabled=autocast):
            out = model(ids, labels=labels)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=autocast and dtype == torch.float16)
        scaler.scale(out.loss).backward()
        scale = scaler.get_scale() if scaler.is_enabled() else 1.0
        grads = [p.grad / scale for mixer in mixers(model) for p in mixer.parameters()]
        return out, grads

    reference, reference_grads = loss_and_grads(autocast=False)
    seen = {}
    for mixer in mixers(model):
        for name in ("conv", "norm"):
            getattr(mixer, name).register_forward_hook(
                lambda m, i, o, name=name: seen.setdefault(name, set()).add(o.dtype)
            )
    low, low_grads = loss_and_grads(autocast=True)
    assert seen == {"conv": {dtype}, "norm": {torch.float32}}
    assert low.logits.shape == reference.logits.shape and torch.isfinite(low.logits).all()
    torch.testing.assert_close(low.logits.float(), reference.logits, atol=0.1, rtol=0.05)
    for grad, ref in zip(low_grads, reference_grads, strict=True):
        assert grad.dtype == torch.float32 and torch.isfinite(grad).all()
        assert torch.nn.functional.cosine_similarity(grad.flatten(), ref.flatten(), dim=0) > 0.98
