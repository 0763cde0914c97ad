"""Shared token keys/values (`token_kv_sharing`): same function as per-layer projections with equal weights,
exact parameter and FLOP counts, saved with the config."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from concept_encoder import ConceptEncoderForMaskedLM, config_from_preset
from concept_encoder.accounting.flops import mlm_training_flops
from concept_encoder.accounting.memory import parameter_count

SHARINGS = ["none", "all", "groups:2"]


def model(sharing: str, layers: int = 4) -> ConceptEncoderForMaskedLM:
    torch.manual_seed(0)
    config = config_from_preset("micro", vocab_size=300, num_hidden_layers=layers, hidden_dropout_prob=0.0,
                                token_kv_sharing=sharing)  # fmt: skip
    return ConceptEncoderForMaskedLM(config).eval()


@pytest.mark.parametrize("sharing", ["all", "groups:2"])
def test_shared_keys_values_equal_per_layer_projections_with_the_same_weights(sharing):
    """The reference computes every layer's keys/values itself (`none`), with each layer's context norm and
    key/value projection set to its group's shared ones: the outputs must match."""
    shared, per_layer = model(sharing), model("none")
    per_layer.load_state_dict(shared.state_dict(), strict=False)  # everything but the key/value modules
    groups = shared.encoder.token_kv
    for index, layer in enumerate(per_layer.encoder.layers):
        source = groups[index * len(groups) // len(per_layer.encoder.layers)]
        layer.cross_attn.context_norm.load_state_dict(source.norm.state_dict())
        layer.cross_attn.attn.kv_proj.load_state_dict(source.kv_proj.state_dict())
    ids = torch.randint(5, 300, (3, 40))
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0
    with torch.no_grad():
        torch.testing.assert_close(shared(ids, mask).logits, per_layer(ids, mask).logits, rtol=1e-5, atol=1e-5)
    assert len(groups) == (1 if sharing == "all" else 2)


def test_none_keeps_every_layers_own_projection_and_its_checkpoint_names():
    none = model("none")
    assert none.encoder.token_kv is None
    keys = set(none.state_dict())
    assert {f"encoder.layers.{i}.cross_attn.attn.kv_proj.weight" for i in range(4)} <= keys
    assert {f"encoder.layers.{i}.cross_attn.context_norm.weight" for i in range(4)} <= keys
    assert not any("token_kv" in key for key in keys)
    shared = set(model("all").state_dict())
    assert "encoder.token_kv.0.kv_proj.weight" in shared
    assert not any(k.startswith("encoder.layers") and ".cross_attn.attn.kv_proj" in k for k in shared)  # decoder: own


@pytest.mark.parametrize("sharing", SHARINGS)
def test_counts_equal_the_built_model_and_the_flop_counter(sharing, tmp_path):
    built = model(sharing)
    config = built.config.to_dict()
    assert parameter_count(**config)["total"] == sum(p.numel() for p in built.parameters())
    ids = torch.randint(5, 300, (2, 100))
    labels = torch.full_like(ids, -100)
    labels[:, :10] = ids[:, :10]
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        built.train()(ids, labels=labels, return_logits=False).loss.backward()
    assert counter.get_total_flops() == mlm_training_flops(config, 2, 100, 0.1)

    built.save_pretrained(tmp_path)
    reloaded = ConceptEncoderForMaskedLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.token_kv_sharing == sharing
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, built.eval()(ids).logits)


def test_sharing_saves_the_token_projection_flops_and_bad_values_are_named():
    config = config_from_preset("small", vocab_size=30522).to_dict()
    n, h, layers = 8192, config["hidden_size"], config["num_hidden_layers"]
    saved = mlm_training_flops(config, 1, n) - mlm_training_flops({**config, "token_kv_sharing": "all"}, 1, n)
    assert saved == 3 * (layers - 1) * 4 * n * h * h
    with pytest.raises(ValueError, match="use none, all, or groups:K with 1 <= K <= num_hidden_layers=4"):
        config_from_preset("small", vocab_size=100, token_kv_sharing="groups:5")
