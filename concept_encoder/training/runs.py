"""Init-order helpers for a run's outputs: its directory (step 10), the resolved config and W&B (step 11)."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
from pathlib import Path

from accelerate import PartialState
from accelerate.utils import broadcast_object_list

logger = logging.getLogger("concept_encoder")


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
