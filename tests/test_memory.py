"""The memory model: exact parameter counts, DeepSpeed's estimators restated, sane activation scaling, the ZeRO
buffers the ds configs set (against DeepSpeed's own config defaults and allocations), the CUDA context under a cap,
the host memory."""

import json
from pathlib import Path

import pytest
import torch
from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

from concept_encoder import PRESETS, ConceptEncoderConfig, ConceptEncoderForMaskedLM
from concept_encoder.accounting.memory import (
    CUDA_CONTEXT_BYTES,
    GIB,
    PROCESS_BASELINE_BYTES,
    activation_bytes,
    allocator_budget_bytes,
    describe_host,
    estimate_training_memory,
    model_state_bytes,
    parameter_count,
    parse_size_gb,
    zero2_model_states,
    zero3_model_states,
    zero_settings,
)
from concept_encoder.accounting.zero_buffers import zero3_live_parameter_bytes, zero_bucket_bytes, zero_values

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
    assert est.gpu_peak == est.gpu_model_states + est.activations + est.workspace + est.zero_buffers


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


def configs() -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in (ROOT / "ds_configs").glob("*.json")}


def test_zero_values_are_deepspeeds_own_defaults_and_accelerates_autos():
    """Missing entries read as DeepSpeed's config class reads them; "auto" as accelerate fills it from H."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    for stage in (1, 2, 3):
        ours, theirs = zero_values({"zero_optimization": {"stage": stage}}, 768), DeepSpeedZeroConfig(stage=stage)
        assert (
            ours["overlap_comm"] == theirs.overlap_comm and ours["contiguous_gradients"] == theirs.contiguous_gradients
        )
        assert ours["reduce_bucket_size"] == theirs.reduce_bucket_size
        assert ours["allgather_bucket_size"] == theirs.allgather_bucket_size
        assert ours["stage3_prefetch_bucket_size"] == theirs.prefetch_bucket_size
        assert ours["stage3_max_live_parameters"] == theirs.max_live_parameters
        assert ours["stage3_max_reuse_distance"] == theirs.max_reuse_distance
    zero3 = zero_values(configs()["zero3"], 768)
    assert zero3["reduce_bucket_size"] == 768**2 and zero3["stage3_prefetch_bucket_size"] == int(0.9 * 768**2)
    assert zero3["stage3_param_persistence_threshold"] == 7680 and zero3["overlap_comm"] is False  # as set


def test_zero3_live_parameter_term_is_what_the_config_sets():
    """Up to max(stage3_max_live_parameters, stage3_max_reuse_distance) gathered 16-bit elements beyond the largest
    layer DeepSpeed's estimator counts, never more than the model; the GPU peak moves by exactly that term."""
    shape = {**PRESETS["3b"], "vocab_size": 30522}
    ds = configs()["zero3_offload"]
    counts = parameter_count(**shape)
    params, largest = counts["total"], counts["largest_layer"]
    zero = zero_values(ds, shape["hidden_size"])
    assert zero3_live_parameter_bytes(zero, params, largest, 2) == 2 * 10**9  # the configs' 1e9: ~1.9 GiB
    fewer = {**zero, "stage3_max_live_parameters": 2e8, "stage3_max_reuse_distance": 3e8}
    assert zero3_live_parameter_bytes(fewer, params, largest, 2) == 2 * 3 * 10**8
    assert zero3_live_parameter_bytes(zero, 5 * 10**8, largest, 4) == 4 * (5 * 10**8 - largest)  # the whole model

    def peak(config):
        return estimate_training_memory(shape, 4, 512, 3, True, True, ds_config=config).gpu_peak

    none_kept = {**ds, "zero_optimization": {**ds["zero_optimization"], "stage3_max_live_parameters": 0,
                                             "stage3_max_reuse_distance": 0}}  # fmt: skip
    assert peak(ds) - peak(none_kept) == 2 * 10**9


def test_zero2_buckets_count_what_the_configs_set():
    """zero2.json (multi-GPU): two 5e8-element bf16 buffers (overlap_comm) and the flattened bucket being reduced;
    zero2_offload.json: the same at accelerate's H² bucket; a CPU run holds only the pages its gradients fill."""
    shape = {**PRESETS["xl"], "vocab_size": 30522}
    params = parameter_count(**shape)["total"]
    multi, offload = (zero_values(configs()[name], shape["hidden_size"]) for name in ("zero2", "zero2_offload"))
    assert multi["overlap_comm"] and offload["overlap_comm"]
    assert zero_bucket_bytes(multi, params, 2) == (2 * 5 * 10**8 + 5 * 10**8) * 2  # 2.8 GiB on each GPU
    assert zero_bucket_bytes(offload, params, 2) == 3 * 1536**2 * 2  # 13.5 MiB on the 10 GB card
    assert zero_bucket_bytes(multi, 10**6, 4, cpu_run=True) == 3 * 10**6 * 4
    est = estimate_training_memory(shape, 8, 512, 2, gpus_per_node=4, ds_config=configs()["zero2"])
    assert est.zero_buffers == zero_bucket_bytes(multi, params, 2)
    assert est.gpu_peak == est.gpu_model_states + est.activations + est.workspace + est.zero_buffers


DEEPSPEED_BUCKETS = """
import json, os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
import torch, deepspeed
config = json.load(open("ds_configs/zero2.json"))
config.update(train_batch_size=2, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1, gradient_clipping=1.0,
              bf16={"enabled": True}, fp16={"enabled": False})
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config)
zero, buffers, flattened = engine.optimizer, [], []
setup_buckets, flatten = zero.setup_buckets, zero.flatten


def setup():  # the contiguous-gradient buffers as allocated for the step
    setup_buckets()
    buffers[:] = [b.numel() * b.element_size() for bucket in zero.ipg_buckets.values() for b in bucket.buffer]


def flatten_bucket(tensors):  # the bucket flattened for its reduction
    flattened.append(sum(t.numel() * t.element_size() for t in tensors))
    return flatten(tensors)


zero.setup_buckets, zero.flatten = setup, flatten_bucket
engine.backward(engine(torch.randn(2, 64, dtype=torch.bfloat16)).float().pow(2).sum())
print(json.dumps({"buffers": buffers, "flattened": max(flattened), "params": sum(p.numel() for p in model.parameters())}))
del engine, zero  # then the group, before the interpreter shuts down (else SIGABRT at exit: runtime.finish_distributed)
torch.distributed.destroy_process_group()
"""


def test_zero2_bucket_term_equals_the_buffers_deepspeed_allocates():
    """zero2.json run by DeepSpeed itself (one CPU process, bf16): its contiguous-gradient buffers and the largest
    bucket it flattens for the reduction are the bytes the model counts (here the buffers' untouched 5e8 elements
    are virtual memory)."""
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:  # a free port for DeepSpeed's process group of one
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    done = subprocess.run([sys.executable, "-c", DEEPSPEED_BUCKETS, port], cwd=ROOT, capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    zero = zero_values(configs()["zero2"], 64)
    assert seen["buffers"] == [5 * 10**8 * 2] * 2  # overlap_comm: two buffers of reduce_bucket_size, bf16
    assert sum(seen["buffers"]) + seen["flattened"] == zero_bucket_bytes(zero, seen["params"], 2)


def test_cuda_context_is_left_out_of_an_emulated_cap(monkeypatch):
    """A 10 GB card leaves its caching allocator 10 GiB less the CUDA context: the cap emulating it on an 80 GB
    card is set there, and the estimate's allocator share (what `max_memory_reserved` measures) excludes it."""
    from types import SimpleNamespace

    from concept_encoder.training import runtime

    fractions = []
    monkeypatch.setattr(
        runtime.torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * GIB)
    )
    monkeypatch.setattr(runtime.torch.cuda, "set_per_process_memory_fraction", lambda f, device: fractions.append(f))
    state = SimpleNamespace(device=torch.device("cuda", 0))
    runtime.apply_memory_budget(10, state)
    assert fractions == [(10 * GIB - CUDA_CONTEXT_BYTES) / (80 * GIB)] and allocator_budget_bytes(10 * GIB) < 10 * GIB
    with pytest.raises(ValueError, match="cuda_memory_budget_gb=0.4 leaves nothing beside the CUDA context"):
        runtime.apply_memory_budget(0.4, state)
    est = estimate_training_memory({**PRESETS["xl"], "vocab_size": 30522}, 8, 512, 2, True)
    assert est.allocator_peak == est.gpu_peak - CUDA_CONTEXT_BYTES and CUDA_CONTEXT_BYTES < est.workspace


def test_host_memory_counts_baseline_fp32_model_and_offloaded_states():
    """Per machine: each process's baseline and fp32 model (none on a GPU under ZeRO-3's zero.Init), the
    offloaded states (DeepSpeed's estimator), and on a CPU run the device side too."""
    shape = {**PRESETS["xl"], "vocab_size": 30522}
    params = parameter_count(**shape)["total"]
    offload = estimate_training_memory(shape, 8, 512, 2, True, gpus_per_node=2, ds_config=configs()["zero2_offload"])
    assert offload.host_offloaded == offload.cpu_model_states
    assert offload.host_peak == 2 * (PROCESS_BASELINE_BYTES + 4 * params) + offload.cpu_model_states
    zero3 = estimate_training_memory(shape, 8, 512, 3, gpus_per_node=2, ds_config=configs()["zero3"])
    assert zero3.host_fp32_model == 0 and zero3.host_offloaded == 0 and zero3.host_peak == 2 * PROCESS_BASELINE_BYTES
    cpu = estimate_training_memory(shape, 8, 512, 3, gpus_per_node=2, ds_config=configs()["zero3"], cpu_run=True)
    assert cpu.host_per_process == PROCESS_BASELINE_BYTES + 4 * params + cpu.gpu_model_states + cpu.zero_buffers + (
        cpu.activations
    )
    assert "2 processes × (0.6 baseline + 3.7 fp32 model)" in describe_host(offload)
