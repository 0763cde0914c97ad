"""Run bookkeeping: the loss-curve plot, memory readings, divergence, preemption signals (the metrics log itself:
`metrics_log.py`)."""

from __future__ import annotations

import logging
import math
import resource
import signal
import time
from pathlib import Path

import psutil
import torch

from ..common.metrics_log import read_metrics

logger = logging.getLogger("concept_encoder")


def plot_loss_curve(metrics_path: Path, out_path: Path) -> Path | None:
    """Train loss (and eval loss where present) against optimizer step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path) if Path(metrics_path).exists() else []
    train = [(r["step"], r["loss"]) for r in records if r.get("kind") == "train" and r["loss"] is not None]
    evals = [(r["step"], r["eval_loss"]) for r in records if r.get("kind") == "eval"]
    if not train and not evals:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    if train:
        ax.plot(*zip(*train, strict=True), label="train loss")
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="eval loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("masked-token cross-entropy")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path


def memory_stats(device: torch.device) -> dict:
    """Peak CUDA allocated/reserved (GB) where present, process RSS and its peak so far (GB; `ru_maxrss` is KiB
    on Linux) always. The kernel's `ru_maxrss` can trail the RSS read a moment later by a few pages, so the peak
    is at least the RSS read now."""
    rss = psutil.Process().memory_info().rss / 2**30
    peak = max(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20)
    stats = {"rss_gb": round(rss, 3), "peak_rss_gb": round(peak, 3)}
    if device.type == "cuda":
        stats["cuda_peak_allocated_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
        stats["cuda_peak_reserved_gb"] = round(torch.cuda.max_memory_reserved(device) / 2**30, 3)
    return stats


def peak_memory_over_ranks(accelerator) -> dict:
    """Memory readings (`memory_stats`) as the max over ranks, plus each rank's RSS; a collective: every rank
    calls it at the same step (the loops' train-log steps)."""
    local = memory_stats(accelerator.device)
    if accelerator.num_processes == 1:
        return local
    keys = sorted(local)
    values = accelerator.gather(torch.tensor([[local[k] for k in keys]], device=accelerator.device))  # [world, K]
    merged = {k: round(float(values[:, i].max()), 3) for i, k in enumerate(keys)}
    merged["rss_gb_ranks"] = [round(float(v), 3) for v in values[:, keys.index("rss_gb")]]
    return merged


class DivergenceMonitor:
    """Flags a finite loss blow-up: the logged loss far above its running minimum for several records.

    "Far above" is more than `ratio` times the minimum and more than `margin` nats over it; `patience`
    such records in a row make a divergence (a single noisy batch does not). Non-finite losses are the
    loop's `--max_bad_steps` business, not this monitor's.
    """

    def __init__(self, ratio: float = 1.5, margin: float = 1.0, patience: int = 3):
        self.ratio, self.margin, self.patience = ratio, margin, patience
        self.running_min = math.inf
        self.above = 0
        self.detected: dict | None = None

    def update(self, step: int, loss: float) -> dict | None:
        """Feed one logged loss; returns the divergence record the first time it is detected."""
        if not math.isfinite(loss):
            return None
        far = loss > self.ratio * self.running_min and loss - self.running_min > self.margin
        self.above = self.above + 1 if far else 0
        self.running_min = min(self.running_min, loss)
        if self.above >= self.patience and self.detected is None:
            self.detected = {"step": step, "loss": loss, "running_min": self.running_min}
            return self.detected
        return None


class TimeBudget:
    """`--max_time`: the training time this invocation may take (None: no budget), counted from the first step.
    `spent()` is asked once per step, after it: true when the next step, as long as the last one (its evaluation
    and checkpoint included), would end past the budget, so the run stops inside it with time to save."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.started = time.monotonic()
        self.last_check = self.started

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def spent(self) -> bool:
        if self.seconds is None:
            return False
        now = time.monotonic()
        last_step, self.last_check = now - self.last_check, now
        return now - self.started + last_step >= self.seconds

    def stop_message(self, step: int, max_steps: int) -> str:
        return (
            f"--max_time {self.seconds:g}s spent after {self.elapsed():.0f}s at step {step} of {max_steps}: stopping "
            "with a checkpoint and the final model (summary.json: max_time); the schedule still ends at step "
            f"{max_steps}, resume with --resume_from_checkpoint auto to go on"
        )


def any_rank(accelerator, *flags: bool) -> list[bool]:
    """Each of `flags` OR-ed over the ranks, so every rank takes the same branch (stop, save): in one process the
    flags themselves (no device tensor, no host sync); with several, one all-reduce (max) read on the host."""
    if accelerator.num_processes == 1:
        return [bool(flag) for flag in flags]
    values = torch.stack([torch.full((), float(flag), device=accelerator.device) for flag in flags])  # no host copy
    return [bool(value) for value in accelerator.reduce(values, reduction="max").tolist()]


class PreemptionFlag:
    """SIGTERM/SIGINT set a flag; the loop finishes its step, saves a checkpoint and exits with `exit_code`."""

    def __init__(self):
        self.signal_name: str | None = None
        self.previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.previous[sig] = signal.signal(sig, self.handle)

    def handle(self, signum, frame) -> None:
        if self.signal_name is not None:
            logger.warning("%s received again: already stopping", signal.Signals(signum).name)
            return
        self.signal_name = signal.Signals(signum).name
        logger.warning("%s received: finishing this step, then saving a checkpoint", self.signal_name)

    @property
    def raised(self) -> bool:
        return self.signal_name is not None

    @property
    def exit_code(self) -> int:
        """The exit code of a loop stopped by a signal: 128 + its number (130 for SIGINT, 143 for SIGTERM), what a
        shell reports for a process the signal ended, so `loop && next` stops at a run that did not finish. A rank
        that stopped because another rank got the signal (`any_rank`) takes SIGTERM's, a scheduler's stop."""
        return 128 + (signal.Signals[self.signal_name] if self.raised else signal.SIGTERM)

    def restore(self) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


class StoppedBySignal(Exception):
    """A run a signal stopped after its checkpoint (`PreemptionFlag`), raised past the code that would report on
    it; the loop exits with `exit_code`."""

    def __init__(self, exit_code: int):
        super().__init__(f"stopped by a signal (exit code {exit_code})")
        self.exit_code = exit_code
