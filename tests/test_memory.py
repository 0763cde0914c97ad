"""The memory model: exact parameter counts, DeepSpeed's estimators restated, sane activation scaling."""

import json
from pathlib import Path

import pytest
import torch
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from concept_encoder import PRESETS, ConceptEncoderConfig, ConceptEncoderForMaskedLM
from concept_encoder.accounting.memory import (
    activation_bytes,
    estimate_training_memory,
    model_state_bytes,
    parameter_count,
    parse_size_gb,
    zero2_model_states,
    zero3_model_states,
    zero_settings,
)

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("preset", list(PRESETS))
@pytest.mark.parametrize("decoder_type, tie", [("perceiver", True), ("weighted", True), ("posonly", False)])
def test_parameter_count_equals_the_built_model(preset, decoder_type, tie):
    config = ConceptEncoderConfig(
        **PRESETS[preset], vocab_size=1234, decoder_type=decoder_type, tie_word_embeddings=tie
    )
    with torch.device("meta"):
        model = ConceptEncoderForMaskedLM(config)
    assert parameter_count(**config.to_dict())["total"] == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("gpus, nodes", [(1, 1), (4, 1), (8, 2)])
@pytest.mark.parametrize("offload", [True, False])
def test_zero_estimators_match_deepspeed(gpus, nodes, offload):
    params, largest = 123_456_789, 9_876_543
    assert zero2_model_states(params, gpus, nodes, offload) == estimate_zero2_model_states_mem_needs(
        params, gpus, nodes, offload
    )
    for offload_params in (True, False):
        for zero_init in (True, False):
            ours = zero3_model_states(params, largest, gpus, nodes, offload, offload_params, zero_init)
            theirs = estimate_zero3_model_states_mem_needs(
                params, largest, gpus, nodes, offload, offload_params, zero_init
            )
            assert ours == tuple(int(x) for x in theirs[:2])


def test_single_gpu_zero_without_offload_saves_nothing_and_offload_does():
    params, largest = 10**9, 10**7
    gpu = {stage: model_state_bytes(stage, params, largest)[1] for stage in (0, 1, 2)}
    assert gpu[0] == gpu[1] == gpu[2] == 20 * params
    assert model_state_bytes(2, params, largest, offload_optimizer=True)[1] == 2 * params
    assert model_state_bytes(3, params, largest, offload_optimizer=True, offload_params=True)[1] == 4 * largest
    assert model_state_bytes(1, params, largest, gpus_per_node=4)[1] < gpu[1]
    with pytest.raises(ValueError, match="ZeRO stage 4"):
        model_state_bytes(4, params, largest)


def test_activations_grow_linearly_in_sequence_length():
    shape = {**PRESETS["base"], "vocab_size": 30522}
    a1, a2, a3 = (activation_bytes(8, n, **shape) for n in (1024, 2048, 3072))
    assert a2 - a1 == pytest.approx(a3 - a2, rel=1e-2) and a2 > a1  # affine in N: no N² term (fused attention)
    checkpointed = activation_bytes(8, 2048, gradient_checkpointing=True, **shape)
    assert checkpointed < 0.75 * a2  # 5 of 6 layers no longer hold their token-side activations
    est = estimate_training_memory(shape, 8, 512, zero_stage=2, offload_optimizer=True)
    assert est.gpu_peak == est.gpu_model_states + est.activations + est.workspace


def test_size_parsing_and_zero_settings_of_the_shipped_configs():
    assert parse_size_gb("10GB") == 10 and parse_size_gb("512MB") == 0.5 and parse_size_gb(24) == 24
    assert parse_size_gb(".5GB") == 0.5
    for bad in ("ten", "0GB", "0", "0.0MB", "1.2.3GB", "-4GB", ""):  # no size, or none: every use divides by it
        with pytest.raises(ValueError, match=f"memory size {bad!r}: use a size above 0"):
            parse_size_gb(bad)
    configs = {p.stem: json.loads(p.read_text()) for p in (ROOT / "ds_configs").glob("*.json")}
    assert zero_settings(configs["zero0"]) == (0, False, False)
    assert zero_settings(configs["zero2_offload"]) == (2, True, False)
    assert zero_settings(configs["zero3_offload"]) == (3, True, True)
    assert zero_settings(None) == (0, False, False)
