"""Atomic, rotated checkpoints through `accelerator.save_state`, and finding one to resume.

A checkpoint is `<run>/checkpoints/step_<N>/`: accelerate's state (model, optimizer, RNG,
registered objects such as the scheduler and the masking collator) plus `train_state.json`
(step, epoch, batches consumed in the epoch). It is written to `step_<N>.tmp` and renamed
when complete, so a crash while saving never leaves a half checkpoint under a valid name
and never touches the previous one.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

logger = logging.getLogger("concept_encoder")
TRAIN_STATE = "train_state.json"


@dataclass
class TrainState:
    step: int = 0  # optimizer steps done
    epoch: int = 0
    batches_in_epoch: int = 0  # micro-batches of this epoch already consumed (per process)
    tokens_seen: int = 0  # global input tokens
    bad_steps: int = 0  # consecutive non-finite losses


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    done = [p for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(".tmp") and (p / TRAIN_STATE).exists()]
    return sorted(done, key=lambda p: int(p.name.split("_")[1]))


def save_checkpoint(
    accelerator, run_dir: Path, state: TrainState, save_total_limit: int, per_rank: dict | None = None
) -> Path:
    """Collective: every rank calls it. Returns the final checkpoint path.

    `per_rank` objects (with `state_dict`) differ between ranks, e.g. each rank's masking
    generator, so each rank writes its own `<name>_rank<r>.pt` (accelerate's registered objects
    are saved once, from the main process).
    """
    final = Path(run_dir) / "checkpoints" / f"step_{state.step:07d}"
    tmp = final.with_name(final.name + ".tmp")
    if accelerator.is_main_process and tmp.exists():
        shutil.rmtree(tmp)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    for name, obj in (per_rank or {}).items():
        torch.save(obj.state_dict(), tmp / f"{name}_rank{accelerator.process_index}.pt")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (tmp / TRAIN_STATE).write_text(json.dumps(asdict(state), indent=2))
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        for old in checkpoint_dirs(run_dir)[:-save_total_limit] if save_total_limit > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        logger.info("checkpoint saved: %s", final)
    accelerator.wait_for_everyone()
    return final


def resolve_resume(spec: str | None, output_dir: str, run_name: str | None) -> Path | None:
    """`auto` → newest checkpoint of `run_name` (or of any run under `output_dir`); a path → that checkpoint."""
    if spec is None:
        return None
    if spec != "auto":
        path = Path(spec)
        if not (path / TRAIN_STATE).exists():
            raise ValueError(
                f"--resume_from_checkpoint {spec}: not a checkpoint folder (no {TRAIN_STATE}); "
                f"pass a <run>/checkpoints/step_N folder or `auto`"
            )
        return path
    runs = [Path(output_dir) / run_name] if run_name else [p for p in Path(output_dir).glob("*") if p.is_dir()]
    found = [c for run in runs for c in checkpoint_dirs(run)]
    if not found:
        logger.info("resume=auto: no checkpoint under %s, starting fresh", runs[0] if run_name else output_dir)
        return None
    return max(found, key=lambda p: p.stat().st_mtime)


def load_checkpoint(accelerator, checkpoint: Path, per_rank: dict | None = None) -> TrainState:
    """Restore accelerate's state, this rank's `per_rank` objects, and the loop position."""
    accelerator.load_state(str(checkpoint))
    for name, obj in (per_rank or {}).items():
        path = checkpoint / f"{name}_rank{accelerator.process_index}.pt"
        if not path.exists():
            raise ValueError(
                f"{path} is missing: the checkpoint was written by fewer processes than this run has; "
                f"resume with the same number of processes"
            )
        obj.load_state_dict(torch.load(path, weights_only=False))
    return TrainState(**json.loads((checkpoint / TRAIN_STATE).read_text()))
