"""Init-order helpers for the training loops, one per step of `main()`.

Steps: distributed setup → logging → args → seed/system info → data → model →
attention-kernel probe → optional compile → run dirs → config log + W&B → train → save.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime as dt
import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import broadcast_object_list

from ..summary import parameter_counts

logger = logging.getLogger("concept_encoder")
DEFAULT_DDP_TIMEOUT_S = 1800


def setup_distributed() -> PartialState:
    """Step 1: the process group with the right backend (NCCL on CUDA, gloo on CPU) and timeout.

    Passing `backend="gloo"` on CPU is what makes multi-process CPU runs (DeepSpeed included)
    see the true world size. The timeout comes from `DDP_TIMEOUT` (seconds, default 1800)
    because arguments are parsed after this step.
    """
    configure_cpu_runtime()
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


def setup_logging(state: PartialState, log_dir: str | Path = "Cache/logs") -> Path | None:
    """Step 2: INFO with a timestamped file log on the main process; ERROR elsewhere."""
    import datasets
    import transformers

    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    fmt = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%Y-%m-%d %H:%M:%S")
    console = logging.StreamHandler(sys.stdout)
    console.setFormatter(fmt)
    root.addHandler(console)
    path = None
    if state.is_main_process:
        root.setLevel(logging.INFO)
        logging.getLogger("accelerate").setLevel(logging.WARNING)  # its per-file checkpoint lines drown the log
        logging.getLogger("matplotlib").setLevel(logging.WARNING)
        transformers.utils.logging.set_verbosity_warning()
        datasets.utils.logging.set_verbosity_warning()
        Path(log_dir).mkdir(parents=True, exist_ok=True)
        path = Path(log_dir) / f"mlm-{dt.datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}.log"
        file_handler = logging.FileHandler(path)
        file_handler.setFormatter(fmt)
        root.addHandler(file_handler)
        logger.info("log file: %s", path)
    else:
        root.setLevel(logging.ERROR)
        transformers.utils.logging.set_verbosity_error()
        datasets.utils.logging.set_verbosity_error()
        datasets.disable_progress_bars()
    return path


def git_state() -> str:
    root = Path(__file__).resolve().parents[2]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, timeout=5
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{commit}{' (dirty)' if dirty else ''}" if commit else "unknown"


def system_info(state: PartialState) -> dict:
    import accelerate
    import datasets
    import psutil
    import transformers

    info = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "datasets": datasets.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "device": str(state.device),
        "world_size": state.num_processes,
        "backend": state.backend,
        "distributed_type": str(state.distributed_type),
        "git": git_state(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(state.device)
        info.update(
            gpu=props.name,
            gpu_memory_gb=round(props.total_memory / 2**30, 1),
            capability=f"{props.major}.{props.minor}",
        )
    try:
        import deepspeed

        info["deepspeed"] = deepspeed.__version__
    except ImportError:
        pass
    return info


def log_system_info(state: PartialState) -> dict:
    """Step 4: versions, devices, memory, git commit and whether the tree is dirty."""
    info = system_info(state)
    logger.info("system: %s", json.dumps(info))
    return info


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


def log_data_config(data_args) -> None:
    logger.info("data config: %s", json.dumps(dataclasses.asdict(data_args)))


def log_dataset_sizes(data) -> None:
    """Step 6: sizes after load/filter/packing."""
    if data.streaming:
        logger.info("train and validation datasets are streamed: sizes unknown, examples tokenised as they are read")
        return
    logger.info("train dataset: %s examples", f"{len(data.train):,}")
    logger.info("validation dataset: %s examples", f"{len(data.validation):,}")
    for split in ("train", "validation"):
        if split in data.stats:
            logger.info("%s stats: %s", split, json.dumps(data.stats[split]))


def log_model_info(model, extra: dict | None = None) -> dict:
    """Step 7: parameter counts, total/trainable and by component."""
    counts = parameter_counts(model)
    logger.info("model: %s", json.dumps({**(extra or {}), **counts}))
    return counts


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


def setup_run_dirs(
    training_args, preset: str, num_params: int, state: PartialState, resume_dir: Path | None = None
) -> Path:
    """Step 10: `Cache/runs/<run_id>/` with `checkpoints/` and `final/`; the id is agreed across ranks.

    The id is `--run_name` if given, the resumed run's id when resuming, else
    `<preset>-<params>M-<timestamp>`.
    """
    if resume_dir is not None:
        run_dir = resume_dir
    elif training_args.run_name:
        run_dir = Path(training_args.output_dir) / training_args.run_name
    else:
        stamp = [f"{preset}-{num_params / 1e6:.1f}M-{dt.datetime.now():%Y%m%d-%H%M%S}"]
        if state.num_processes > 1:
            broadcast_object_list(stamp, from_process=0)
        run_dir = Path(training_args.output_dir) / stamp[0]
    if state.is_main_process:
        (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
    state.wait_for_everyone()
    return run_dir


def save_run_config(run_dir: Path, config: dict) -> None:
    """Step 11a: the resolved configuration, written to the run dir and logged."""
    logger.info("resolved config: %s", json.dumps(config, default=str))
    (run_dir / "config.json").write_text(json.dumps(config, indent=2, default=str))


def wandb_credentials_present() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    return netrc.is_file() and "api.wandb.ai" in netrc.read_text(errors="ignore")


def init_wandb(training_args, run_dir: Path, config: dict, state: PartialState):
    """Step 11b: W&B on the main process: online with credentials, offline without, never a prompt.

    `--report_to none` disables it. The config logged is the resolved arguments (no secrets:
    credentials are never part of it).
    """
    if training_args.report_to == "none" or not state.is_main_process:
        return None
    import wandb

    mode = os.environ.get("WANDB_MODE") or ("online" if wandb_credentials_present() else "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    run = wandb.init(
        project=training_args.wandb_project,
        name=run_dir.name,
        id=run_dir.name,
        resume="allow",
        dir=str(run_dir),
        config=config,
        mode=mode,
        settings=wandb.Settings(console="off", silent=True),
    )
    logger.info("W&B run %s (%s)", run_dir.name, mode)
    return run
