"""Init-order helpers for the process and its runtime: distributed setup (step 1), CPU threads and
allocator, CUDA memory cap (step 4), attention-kernel probe (step 8), optional compile (step 9)."""

from __future__ import annotations

import ctypes
import datetime as dt
import logging
import os
import signal
from pathlib import Path

import torch
from accelerate import PartialState

logger = logging.getLogger("concept_encoder")
DEFAULT_DDP_TIMEOUT_S = 1800


def setup_distributed() -> PartialState:
    """Step 1: the process group with the right backend (NCCL on CUDA, gloo on CPU) and timeout.

    Passing `backend="gloo"` on CPU is what makes multi-process CPU runs (DeepSpeed included)
    see the true world size. The timeout comes from `DDP_TIMEOUT` (seconds, default 1800)
    because arguments are parsed after this step.
    """
    configure_cpu_runtime()
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


LAUNCHERS = ("accelerate", "torch.distributed.run", "torchrun", "deepspeed")


def follow_launcher() -> bool:
    """When a launcher started this process, have the kernel send it SIGTERM when the launcher dies.

    `accelerate launch` with one process runs the script as a child and, on SIGTERM or SIGINT, dies
    at once (exit 143) without passing the signal on: the orphaned child would train on without a
    checkpoint. With `PR_SET_PDEATHSIG` (Linux) the child gets SIGTERM the moment its launcher ends,
    and the loop's preemption handling checkpoints and exits 0. Multi-process launchers (torch's
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
    share of the cores, and freed tensor memory kept for reuse. Both are no-ops on GPU machines."""
    use_cpu_cores()
    retain_freed_cpu_memory()


def use_cpu_cores() -> None:
    """On CPU, give each process its share of the cores.

    `accelerate launch` exports OMP_NUM_THREADS=1 to every process on a machine without GPUs, which
    halves a single-process run on 2 cores. `CPU_THREADS` overrides the share (cores / local processes).
    """
    if torch.cuda.is_available():
        return
    local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    threads = int(os.environ.get("CPU_THREADS", 0)) or max(1, (os.cpu_count() or 1) // max(local, 1))
    torch.set_num_threads(threads)


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
    """Cap the CUDA caching allocator at `budget_gb` (emulates a smaller card on a larger one)."""
    if budget_gb is None:
        return
    if state.device.type != "cuda":
        logger.info("cuda_memory_budget_gb=%s ignored: no CUDA device", budget_gb)
        return
    total = torch.cuda.get_device_properties(state.device).total_memory
    fraction = min(1.0, budget_gb * 2**30 / total)
    torch.cuda.set_per_process_memory_fraction(fraction, state.device)
    logger.info("CUDA memory capped at %.1f GiB (%.1f%% of %.1f GiB)", budget_gb, 100 * fraction, total / 2**30)


def probe_attention_kernels(model, batch: dict, state: PartialState) -> dict[str, bool]:
    """Step 8: which SDPA backends the model's real attention calls can run on, on this device.

    Runs the model's own forward on a real batch under `sdpa_kernel([backend])`, one backend at
    a time; a backend that cannot serve these calls (mask, dtype, head size, device) raises and
    is reported as unavailable. PyTorch picks the first available in the order listed.
    """
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not state.is_main_process:
        return {}
    candidates = [("flash", SDPBackend.FLASH_ATTENTION), ("memory_efficient", SDPBackend.EFFICIENT_ATTENTION)]
    candidates.append(("math", SDPBackend.MATH))
    inputs = {k: v[:2].to(state.device) for k, v in batch.items() if k in ("input_ids", "attention_mask", "labels")}
    was_training = model.training
    model.eval()
    result = {}
    dtype = torch.bfloat16 if state.device.type == "cuda" and torch.cuda.is_bf16_supported() else None
    for name, backend in candidates:
        try:
            with (
                torch.no_grad(),
                sdpa_kernel([backend]),
                torch.autocast(state.device.type, dtype=dtype, enabled=dtype is not None),
            ):
                model(**inputs)
            result[name] = True
        except RuntimeError:
            result[name] = False
    model.train(was_training)
    chosen = next((name for name, ok in result.items() if ok), "none")
    padded = "attention_mask" in inputs and not bool(inputs["attention_mask"].all())
    logger.info(
        "attention kernels on %s (%s batch, %s): %s → PyTorch will use %s",
        state.device,
        "padded" if padded else "unpadded",
        "bf16" if dtype else "fp32",
        ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in result.items()),
        chosen,
    )
    return result


def maybe_compile(model, enabled: bool):
    """Step 9: `torch.compile(model, dynamic=True)`: masked counts change the decoder shapes every batch."""
    if not enabled:
        return model
    logger.info("compiling the model with torch.compile(dynamic=True)")
    return torch.compile(model, dynamic=True)
