"""The device memory a ds config's ZeRO settings take beyond DeepSpeed's model-state estimators: gradient
buckets, ZeRO-3's gathered parameters and its gradient partition, read from the config as DeepSpeed runs it.

Pure arithmetic on config fields (no torch, no DeepSpeed import), like `memory.py`, which adds these to its
estimate; each term names the DeepSpeed source it follows and is tested against DeepSpeed's config class or
allocations (tests/test_memory.py).
"""

from __future__ import annotations

# zero_optimization defaults of DeepSpeed 0.19.8 (deepspeed/runtime/zero/config.py, DeepSpeedZeroConfig)
ZERO_DEFAULTS = {
    "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8, "contiguous_gradients": True,
    "stage3_prefetch_bucket_size": 5e7, "stage3_param_persistence_threshold": 1e5,
    "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
}  # fmt: skip


def zero_settings(ds_config: dict | None) -> tuple[int, bool, bool]:
    """A DeepSpeed config dict → (ZeRO stage, optimizer offloaded?, parameters offloaded?)."""
    zero = (ds_config or {}).get("zero_optimization", {}) or {}

    def offloaded(key: str) -> bool:
        return (zero.get(key) or {}).get("device", "none") in ("cpu", "nvme")

    return int(zero.get("stage", 0)), offloaded("offload_optimizer"), offloaded("offload_param")


def zero_values(ds_config: dict | None, hidden_size: int) -> dict:
    """The ds config's `zero_optimization` as DeepSpeed runs it: `"auto"` entries resolved as accelerate resolves
    them from the model's hidden size H (`Accelerator._prepare_deepspeed`: reduce_bucket_size H²,
    stage3_prefetch_bucket_size 0.9·H², stage3_param_persistence_threshold 10·H), missing entries at DeepSpeed's
    defaults (`ZERO_DEFAULTS`; overlap_comm defaults to true for stage 3 only, `DeepSpeedZeroConfig.
    overlap_comm_valid`)."""
    zero = {**ZERO_DEFAULTS, **((ds_config or {}).get("zero_optimization") or {})}
    zero.setdefault("overlap_comm", int(zero.get("stage", 0)) == 3)
    auto = {"reduce_bucket_size": hidden_size * hidden_size, "stage3_prefetch_bucket_size": int(0.9 * hidden_size**2),
            "stage3_param_persistence_threshold": 10 * hidden_size}  # fmt: skip
    return {key: auto.get(key, value) if value == "auto" else value for key, value in zero.items()}


def zero_bucket_bytes(zero: dict, params: int, gradient_bytes: int, cpu_run: bool = False) -> int:
    """Device bytes of ZeRO's gradient reduction buckets, beyond DeepSpeed's estimators (0 without ZeRO).

    Stages 1-2 (`stage_1_and_2.py`, `setup_buckets`): with contiguous_gradients one buffer of reduce_bucket_size
    gradient elements, two with overlap_comm (one fills while the other is reduced); `allreduce_bucket` reduces a
    flattened copy of the bucket. Stage 3 (`stage3.py`): one contiguous buffer, and the flattened copy. The
    allgather_bucket_size costs nothing: the updated 16-bit partitions are all-gathered in place
    (`all_gather_into_tensor` in `runtime/utils.py:all_gather_dp_groups`). The buffers are allocated whole on a GPU
    (the caching allocator reserves them); on a CPU run (`cpu_run`) only the pages written, at most the model's
    gradients, are resident."""
    stage = int(zero.get("stage", 0))
    if stage == 0:
        return 0
    bucket = int(float(zero["reduce_bucket_size"]))
    buffers = (2 if zero["overlap_comm"] and stage < 3 else 1) if zero["contiguous_gradients"] else 0
    resident = min(bucket, params) if cpu_run else bucket
    return (buffers * resident + min(bucket, params)) * gradient_bytes


def zero3_live_parameter_bytes(zero: dict, params: int, largest_layer: int, param_bytes: int) -> int:
    """Gathered ZeRO-3 parameters kept on the device beyond the largest layer DeepSpeed's estimator counts.

    `partitioned_param_coordinator.py`: a parameter is not released while it will be used again within
    stage3_max_reuse_distance parameter elements (`__params_to_release`), and prefetching stops at
    stage3_max_live_parameters gathered elements (`_fetch_sub_module_impl`: at most min(max_live - available,
    stage3_prefetch_bucket_size)). So up to max(max_live, max_reuse) elements stay gathered, plus the layer in
    use, and never more than the model: at DeepSpeed's defaults (1e9, our configs') 2 GB of 16-bit parameters
    for a model of 1B parameters or more, all of a smaller one (each forward parameter is reused in backward)."""
    window = int(max(float(zero["stage3_max_live_parameters"]), float(zero["stage3_max_reuse_distance"])))
    live = min(params, window + largest_layer)
    return param_bytes * max(0, live - largest_layer)


def zero_buffer_bytes(
    ds_config: dict | None, hidden_size: int, params: int, largest_layer: int, world: int, sixteen_bit: bool,
    cpu_run: bool = False,
) -> int:  # fmt: skip
    """The ZeRO buffers `ds_config` sets, per device: gradient buckets (`zero_bucket_bytes`) and, under ZeRO-3,
    the gathered parameters (`zero3_live_parameter_bytes`) and, unless the optimizer is offloaded, the gradient
    partition `grad_partitions_flat_buffer` in the gradient-accumulation dtype (`stage3.py`; DeepSpeed's estimator
    counts the fp32 gradients the optimizer step flattens from it, not the buffer itself)."""
    zero = zero_values(ds_config, hidden_size)
    stage, offload_optimizer, _ = zero_settings(ds_config)
    param_bytes = 2 if sixteen_bit else 4
    accumulate = ((ds_config or {}).get("data_types") or {}).get("grad_accum_dtype")
    accum_bytes = 4 if accumulate == "fp32" else param_bytes
    # the bucket holds 16-bit gradients, except ZeRO-1's, which accumulates in grad_accum_dtype there
    # (`_gradient_reduction_buffer_dtype`)
    total = zero_bucket_bytes(zero, params, accum_bytes if stage == 1 else param_bytes, cpu_run)
    if stage == 3:
        total += zero3_live_parameter_bytes(zero, params, largest_layer, param_bytes)
        total += 0 if offload_optimizer else accum_bytes * -(-params // world)
    return total
