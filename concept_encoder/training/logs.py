"""Init-order helpers for logging and what gets logged: log set-up (step 2), system info and data
config (step 4), dataset sizes (step 6), model size (step 7)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import importlib.metadata
import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch
from accelerate import PartialState

from ..common.paths import PROJECT_ROOT, cache_path
from ..model.summary import parameter_counts

logger = logging.getLogger("concept_encoder")


def setup_logging(state: PartialState, log_dir: str | Path = "Cache/logs", name: str = "mlm") -> Path | None:
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
        log_dir = cache_path(log_dir)  # the project's Cache/logs, wherever the command starts
        path = log_dir / f"{name}-{dt.datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}.log"
        try:  # a folder that cannot be written is reported by the preflight, in one line, right after
            Path(log_dir).mkdir(parents=True, exist_ok=True)
            file_handler = LogFileHandler(path)
        except OSError as error:
            logger.warning("no log file: %s (%s)", path, error.strerror or error)
            path = None
        else:
            file_handler.setFormatter(fmt)
            root.addHandler(file_handler)
            logger.info("log file: %s", path)
    else:
        root.setLevel(logging.ERROR)
        transformers.utils.logging.set_verbosity_error()
        datasets.utils.logging.set_verbosity_error()
        datasets.disable_progress_bars()
    return path


class LogFileHandler(logging.FileHandler):
    """The run's log file. When it cannot be written (a full disk), it says so once, in one line on stderr,
    and stops writing, instead of logging's traceback at every record; the console log goes on."""

    failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        if not self.failed:
            self.failed = True
            error = sys.exc_info()[1]
            sys.stderr.write(f"warning: the log file {self.baseFilename} cannot be written ({error}); "
                             "logging to the console only\n")  # fmt: skip


def git_state() -> str:
    root = PROJECT_ROOT
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
    try:  # the installed version, read from its metadata: importing DeepSpeed costs a run without it ~0.6 s
        info["deepspeed"] = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        pass
    return info


def log_system_info(state: PartialState) -> dict:
    """Step 4: versions, devices, memory, git commit and whether the tree is dirty."""
    info = system_info(state)
    logger.info("system: %s", json.dumps(info))
    return info


def log_data_config(data_args, per_device_batch: int | None = None, objective: str = "mlm") -> float | None:
    """The data settings; for MLM also the share of micro-batches expected to hold no masked token at all
    ((1 - p) ** tokens per micro-batch), warned about above 1%: such steps teach nothing and their loss is
    undefined (logged as NaN, counted in summary.json). Returns that share (None for other objectives)."""
    logger.info("data config: %s", json.dumps(dataclasses.asdict(data_args)))
    if objective != "mlm" or per_device_batch is None:
        return None
    tokens = per_device_batch * max(data_args.max_seq_length - 2, 1)  # [CLS] and [SEP] are never masked
    empty = (1 - data_args.mlm_probability) ** tokens
    if empty > 0.01:
        logger.warning(
            "mlm_probability=%g with ~%d maskable tokens per micro-batch: about %.1f%% of micro-batches will have "
            "no masked token (nothing to learn, loss undefined); raise --mlm_probability or the batch",
            data_args.mlm_probability, tokens, 100 * empty,
        )  # fmt: skip
    return empty


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
