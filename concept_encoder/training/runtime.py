"""Init-order helpers for the process and its runtime: distributed setup (step 1), CPU threads and
allocator, CUDA memory cap (step 4), TF32 (step 8, beside the attention-kernel probe of `attention_probe`),
optional compile (step 9)."""

from __future__ import annotations

import contextlib
import ctypes
import datetime as dt
import logging
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import torch
from accelerate import PartialState

from ..accounting.memory import CUDA_CONTEXT_BYTES, GIB, allocator_budget_bytes
from ..common.accelerator_state import plain_model
from ..machine.cpu_info import reuse_cpu_info

logger = logging.getLogger("concept_encoder")
DEFAULT_DDP_TIMEOUT_S = 1800


def setup_distributed() -> PartialState:
    """Step 1: the process group with the right backend (NCCL on CUDA, gloo on CPU) and timeout.

    Passing `backend="gloo"` on CPU is what makes multi-process CPU runs (DeepSpeed included)
    see the true world size. The timeout comes from `DDP_TIMEOUT` (seconds, default 1800)
    because arguments are parsed after this step. DeepSpeed's question about the CPU is answered once per
    machine from here on (`cpu_info.reuse_cpu_info`: seconds of every DeepSpeed rank's start).
    """
    configure_cpu_runtime()
    reuse_cpu_info()
    follow_launcher()
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1 or "LOCAL_RANK" in os.environ
    if not launched:
        return PartialState()  # a single process: no process group to create
    timeout = dt.timedelta(seconds=int(os.environ.get("DDP_TIMEOUT", DEFAULT_DDP_TIMEOUT_S)))
    if torch.cuda.is_available():
        state = PartialState(backend="nccl", timeout=timeout)
    elif os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        state = PartialState(backend="gloo", timeout=timeout)  # DeepSpeed creates the gloo group
    else:
        state = PartialState(cpu=True, backend="gloo", timeout=timeout)  # MULTI_CPU creates the gloo group
    if state.device.type == "cuda":
        torch.cuda.set_device(state.device)
    return state


def finish_distributed(state, model=None) -> None:
    """The last step of every loop, on every rank: ZeRO-3's parameter gathers still in flight drained
    (`empty_partition_cache`, DeepSpeed's own call; other engines and plain modules have nothing in flight), all
    ranks waited for, the trackers finished (`Accelerator.end_training`) and the process group destroyed.

    Why all of it: a process group, or a gather's work handle, that outlives the loop is destroyed while the
    interpreter shuts down, where freeing its tensors needs an interpreter that is gone; the rank then aborts
    (SIGABRT, "terminate called without an active exception") after its work is done, its launcher reports a
    failure, and on several machines the other machines' launchers wait out their exit barrier (5 minutes).
    `state`: the run's `Accelerator`, or the `PartialState` of a loop that made one per run."""
    drain = getattr(model, "empty_partition_cache", None)
    if callable(drain):
        drain()
    state.wait_for_everyone()
    if hasattr(state, "end_training"):
        state.end_training()  # trackers, then the process group
    elif torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


LAUNCHERS = ("accelerate", "torch.distributed.run", "torchrun", "deepspeed")


def follow_launcher() -> bool:
    """When a launcher started this process, have the kernel send it SIGTERM when the launcher dies.

    `accelerate launch` with one process runs the script as a child and, on SIGTERM or SIGINT, dies
    at once (exit 143) without passing the signal on: the orphaned child would train on without a
    checkpoint. With `PR_SET_PDEATHSIG` (Linux) the child gets SIGTERM the moment its launcher ends,
    and the loop's preemption handling checkpoints and exits 143. Multi-process launchers (torch's
    elastic agent) forward SIGTERM themselves; this covers the agent dying too. Returns whether set.
    """
    parent = Path(f"/proc/{os.getppid()}/cmdline")
    try:
        command = parent.read_bytes().replace(b"\0", b" ").decode(errors="ignore")
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    if not any(name in command for name in LAUNCHERS):
        return False
    pr_set_pdeathsig = 1  # <sys/prctl.h>
    if prctl(pr_set_pdeathsig, signal.SIGTERM, 0, 0, 0) != 0:
        return False
    if os.getppid() == 1:  # the launcher died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)
    return True


def configure_cpu_runtime() -> None:
    """The CPU set-up of every training process (and of the benchmarks' timing processes): its
    share of the cores (GPU machines too), and freed tensor memory kept for reuse (CPU machines only)."""
    use_cpu_cores()
    retain_freed_cpu_memory()


def cpu_threads() -> int | None:
    """The policy for the number of torch's CPU threads in each process, on CPU and GPU machines alike; None
    leaves torch's own (which follows OMP_NUM_THREADS).

    1. `CPU_THREADS=<n>` wins: the project's own setting, never written by a launcher.
    2. Else an OMP_NUM_THREADS other than 1 is kept: someone chose it (an export, accelerate's
       `--num_cpu_threads_per_process`, or accelerate's own physical-core share on a `--cpu` launch).
    3. Else (OMP_NUM_THREADS unset or 1) the cores this process may run on (`os.sched_getaffinity`, which a
       scheduler's or `taskset`'s limit narrows; `os.cpu_count()` where it is missing) divided by the processes on
       this machine (`LOCAL_WORLD_SIZE`, else `WORLD_SIZE`), at least 1. A 1 cannot be told apart from the
       launcher's default: `accelerate launch` writes OMP_NUM_THREADS=1 into every process whenever it was given
       no value (and torchrun does for several processes), GPU machines included. Left there, masking, the export
       check's CPU forward pass, a distillation teacher on the CPU and CPU Adam under offload would each run on one
       core. To pin one thread, set `CPU_THREADS=1`.
    """
    if not explicit_threads() and os.environ.get("OMP_NUM_THREADS", "1").strip() not in ("", "1"):
        return None  # torch follows OMP_NUM_THREADS itself
    return launch_threads(int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1"))))


def explicit_threads() -> int:
    """`CPU_THREADS`, 0 when unset."""
    return int(os.environ.get("CPU_THREADS", 0) or 0)


def omp_threads() -> int:
    """The threads an OMP_NUM_THREADS someone chose gives torch (its first level's count; other than 1: see
    `cpu_threads`), else 0."""
    first = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(first) if first.isdigit() and first != "1" else 0


def launch_threads(processes: int) -> int:
    """The CPU threads each rank of a `processes`-process launch started now will use (`cpu_threads` as the launched
    loop applies it: `CPU_THREADS`, else an OMP_NUM_THREADS other than 1 the launcher passes on, else the usable
    cores split between the ranks)."""
    return explicit_threads() or omp_threads() or cores_each(processes)


def cores_each(processes: int) -> int:
    """The usable cores split between `processes` processes, at least 1 each."""
    return max(1, usable_cores() // max(processes, 1))


def usable_cores() -> int:
    """The cores this process may run on: `os.sched_getaffinity`, which a scheduler's or `taskset`'s limit
    narrows; `os.cpu_count()` where it is missing."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


@contextlib.contextmanager
def cores_shared(processes: int) -> Iterator[int]:
    """Threads for each of `processes` training processes running at once (a driver's `--jobs`): the usable cores
    split between them, at least one each, set as `CPU_THREADS` (`cpu_threads`) for the launches started inside
    the block, which inherit it, and removed after it; a `CPU_THREADS` already set is the user's and kept. Yields
    the threads each. Measured: two one-thread fine-tuning runs at once train 1.57 times the steps of one
    two-thread run on a 2-core machine at the `micro` shape (docs/recall.md)."""
    if given := os.environ.get("CPU_THREADS"):
        yield int(given)
        return
    os.environ["CPU_THREADS"] = str(cores_each(processes))
    try:
        yield int(os.environ["CPU_THREADS"])
    finally:
        os.environ.pop("CPU_THREADS", None)


def use_cpu_cores() -> int:
    """Apply `cpu_threads()` to torch's intra-op threads (OpenMP's too: CPU Adam's loops run in torch's OpenMP
    runtime); returns the number of threads this process now uses."""
    if (threads := cpu_threads()) is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def retain_freed_cpu_memory() -> bool:
    """On a CPU-only Linux machine, keep freed tensor memory in the process for reuse. Returns whether set.

    glibc serves every allocation above its mmap threshold (32 MiB at most) with a fresh `mmap` and
    unmaps it on `free`, so a CPU training step page-faults its large activations, logits and
    gradients anew every time: a third of a `small` step at N=8192 on the development machine
    (benchmarks/README.md). With mmap allocation and heap trimming off (`mallopt`), freed blocks
    are reused from the heap instead. The resident size then stays near the step's peak, which
    every step reaches anyway. `CPU_RETAIN_FREED_MEMORY=0` opts out; GPU machines are left alone.
    """
    if torch.cuda.is_available() or os.environ.get("CPU_RETAIN_FREED_MEMORY", "1") == "0":
        return False
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt  # glibc only
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # <malloc.h>
    return bool(mallopt(m_mmap_max, 0)) and bool(mallopt(m_trim_threshold, 2**31 - 1))


def apply_memory_budget(budget_gb: float | None, state: PartialState) -> None:
    """Emulate a card of `budget_gb` on a larger one: cap the CUDA caching allocator at what such a card leaves it,
    the budget less the CUDA context (`memory.allocator_budget_bytes`; `set_per_process_memory_fraction` limits
    the allocator only, while on the smaller card the context would take its share of the same memory)."""
    if budget_gb is None:
        return
    if state.device.type != "cuda":
        logger.info("cuda_memory_budget_gb=%s ignored: no CUDA device", budget_gb)
        return
    allocator = allocator_budget_bytes(budget_gb * GIB)
    if allocator <= 0:
        raise ValueError(
            f"cuda_memory_budget_gb={budget_gb:g} leaves nothing beside the CUDA context "
            f"(~{CUDA_CONTEXT_BYTES / GIB:g} GiB); give a budget above it"
        )
    total = torch.cuda.get_device_properties(state.device).total_memory
    fraction = min(1.0, allocator / total)
    torch.cuda.set_per_process_memory_fraction(fraction, state.device)
    logger.info(
        "CUDA memory capped at %.1f GiB: the caching allocator at %.2f GiB (%.1f%% of %.1f GiB), %.1f GiB left to "
        "the CUDA context", budget_gb, allocator / GIB, 100 * fraction, total / GIB, CUDA_CONTEXT_BYTES / GIB,
    )  # fmt: skip


def set_tf32(enabled: bool, state: PartialState) -> str:
    """Step 8, with the kernel probe: fp32 matmuls and cuDNN convolutions in TF32 where the GPU has it (compute
    capability 8.0 and later: RTX 30xx, A100, H100), as nanoGPT, litgpt and Cramming do (a 10-bit mantissa in the
    products, fp32 accumulation; bf16/fp16 autocast regions are unaffected). Returns the verdict it logs:
    `on`, `off (--no_tf32)` or `not available (<device>)`."""
    capable = state.device.type == "cuda" and torch.cuda.get_device_capability(state.device) >= (8, 0)
    use = enabled and capable
    torch.set_float32_matmul_precision("high" if use else "highest")
    torch.backends.cudnn.allow_tf32 = use
    if capable:
        verdict = "on" if use else "off (--no_tf32)"
    else:
        where = torch.cuda.get_device_name(state.device) if state.device.type == "cuda" else state.device.type
        verdict = f"not available ({where})"
    logger.info("TF32 matmuls: %s", verdict)
    return verdict


def maybe_compile(model, enabled: bool, backend="inductor"):
    """Step 9: `torch.compile(model, dynamic=True)`, traced as one graph that never recompiles for a new
    masked count: the labelled-position count M and row count L are data-dependent sizes, so dynamo is told
    to capture `.item()` and boolean-mask indexing as symbolic sizes instead of breaking the graph there,
    and the vocabulary loss is one custom operator (`vocab_projection`). Process-wide settings, set here once.
    `backend`: torch.compile's (tests count graphs with dynamo's `CompileCounterWithBackend`)."""
    if not enabled:
        return model
    torch._dynamo.config.capture_scalar_outputs = True
    torch._dynamo.config.capture_dynamic_output_shape_ops = True
    logger.info("compiling the model with torch.compile(dynamic=True)")
    return torch.compile(model, dynamic=True, backend=backend)


def model_state_dict(accelerator, model) -> dict | None:
    """The model's weights to save: `accelerator.get_state_dict(model)` (a collective under ZeRO-3: the shards are
    gathered, and only the main process gets them; None elsewhere) under the plain model's parameter names (a
    compiled model's names carry torch.compile's `_orig_mod.` prefix, which a saved model must not: it would load as
    missing weights), with DeepSpeed's fp32 master weights in place of its 16-bit copies (`fp32_master_weights`: a
    collective too, so every rank calls this function). Cast to the saved dtype by `save_model_weights`, once,
    keeping tied weights one tensor."""
    masters = fp32_master_weights(accelerator, model)
    state = accelerator.get_state_dict(model)
    if state is None:
        return None
    return {name.removeprefix("_orig_mod."): masters.get(name.removeprefix("_orig_mod."), value)
            for name, value in state.items()}  # fmt: skip


def fp32_master_weights(accelerator, model) -> dict[str, torch.Tensor]:
    """Parameter name → the fp32 master weight DeepSpeed's optimizer holds for a 16-bit (bf16/fp16) module, on the
    main process (empty elsewhere, and when the module trains in fp32 or without DeepSpeed: its parameters are
    the weights). DeepSpeed casts the module to 16 bits and keeps the fp32 weights it updates in its optimizer
    (ZeRO 1/2/3, and bf16 without ZeRO); `deepspeed.utils.safe_get_full_fp32_param` assembles one from its
    partitions (an all-reduce or all-gather: every rank asks for every parameter in the same order). This is what
    `export` reads from a checkpoint's optimizer states, so `final/` and an export of the same step agree. Where
    DeepSpeed keeps no master for a parameter (a frozen one; fp16 without ZeRO) the 16-bit tensor is saved,
    upcast, with one log line."""
    from accelerate.utils import DistributedType

    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return {}
    plain = plain_model(accelerator, model)
    if all(p.dtype == torch.float32 for p in plain.parameters()):
        return {}
    from deepspeed.utils import safe_get_full_fp32_param

    masters, by_parameter, lacking = {}, {}, []
    for name, param in plain.named_parameters(remove_duplicate=False):  # tied names share their parameter's master
        if id(param) not in by_parameter:
            full = safe_get_full_fp32_param(param)
            by_parameter[id(param)] = None if full is None or not accelerator.is_main_process else full.detach().cpu()
        if by_parameter[id(param)] is not None:
            masters[name] = by_parameter[id(param)]
        elif accelerator.is_main_process:
            lacking.append(name)
    if lacking:
        logger.info("DeepSpeed keeps no fp32 master of %d parameter(s) (e.g. %s): saved from their 16-bit copies",
                    len(lacking), lacking[0])  # fmt: skip
    return masters
