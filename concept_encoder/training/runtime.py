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

from .cpu_info import reuse_cpu_info

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


def attention_calls(config, seq_len: int, decoder: bool = True) -> list[tuple[str, int, int, bool]]:
    """The SDPA calls one forward of a model with `config` makes on `seq_len` tokens, as (what, queries,
    keys, masked by padding): BERT's self-attention; the concepts reading the tokens and each other, and
    with `decoder` the MLM decoder's masked positions (15%) reading the concepts."""
    if config.model_type == "bert":
        return [("tokens ← tokens", seq_len, seq_len, True)]
    concepts = config.concept_num
    calls = [("concepts ← tokens", concepts, seq_len, True), ("concepts ← concepts", concepts, concepts, False)]
    if decoder and config.decoder_type != "weighted":
        calls.append(("positions ← concepts", max(1, round(0.15 * seq_len)), concepts, False))
    return calls


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


def probe_attention_kernels(config, batch: dict, state: PartialState, decoder: bool = True) -> dict[str, bool]:
    """Step 8: which SDPA backends can serve the model's attention calls on this device.

    Runs every call of `attention_calls` (the model's head count, head size and lengths, two rows of
    `batch`, its padding mask where one is needed, bf16 on CUDA) on random queries, keys and values under
    `sdpa_kernel([backend])`, one backend at a time; a backend that cannot serve a call (mask, dtype, head
    size, device) raises and is reported as unavailable. PyTorch picks the first available in the order
    listed. Probing attention calls, not the model, keeps the model where it is: a ZeRO-3 model stays
    partitioned, and a model larger than the GPU is never moved onto it whole.
    """
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if not state.is_main_process:
        return {}
    candidates = [("flash", SDPBackend.FLASH_ATTENTION), ("memory_efficient", SDPBackend.EFFICIENT_ATTENTION)]
    candidates.append(("math", SDPBackend.MATH))
    ids = batch["input_ids"][:2]
    rows, seq_len = ids.shape
    mask = batch.get("attention_mask")
    padded = mask is not None and not bool(mask[:2].all())
    key_mask = mask[:2].bool().to(state.device)[:, None, None, :] if padded else None  # [B,1,1,N]
    dtype = torch.bfloat16 if state.device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32
    heads = config.num_attention_heads
    head_dim = config.hidden_size // heads
    calls = attention_calls(config, seq_len, decoder)
    result = {}
    for name, backend in candidates:
        try:
            with torch.no_grad(), sdpa_kernel([backend]):
                for _, queries, keys, masked in calls:
                    q = torch.randn(rows, heads, queries, head_dim, device=state.device, dtype=dtype)
                    kv = torch.randn(2, rows, heads, keys, head_dim, device=state.device, dtype=dtype)
                    F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=key_mask if masked else None)
            result[name] = True
        except RuntimeError:
            result[name] = False
    chosen = next((name for name, ok in result.items() if ok), "none")
    logger.info(
        "attention kernels on %s (%s batch, %s; %s): %s → PyTorch will use %s",
        state.device,
        "padded" if padded else "unpadded",
        "bf16" if dtype == torch.bfloat16 else "fp32",
        ", ".join(f"{what} {q}×{k}" for what, q, k, _ in calls),
        ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in result.items()),
        chosen,
    )
    return result


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


def plain_model(accelerator, model):
    """The model `prepare` wrapped (DDP, DeepSpeed) and `maybe_compile` compiled, as its own class:
    what `save_pretrained`, `from_pretrained` of its type and parameter walks need."""
    return accelerator.unwrap_model(model, keep_torch_compile=False)


def model_state_dict(accelerator, model) -> dict | None:
    """`accelerator.get_state_dict(model)` (a collective under ZeRO-3: the shards are gathered, and only the
    main process gets them; None elsewhere) under the plain model's parameter names: a compiled model's
    names carry torch.compile's `_orig_mod.` prefix, which a saved model must not (it would load as missing
    weights)."""
    state = accelerator.get_state_dict(model)
    return None if state is None else {name.removeprefix("_orig_mod."): value for name, value in state.items()}
