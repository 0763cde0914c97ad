"""Init-order helpers for a run's outputs: its directory (step 10), the resolved config and W&B (step 11)."""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
from pathlib import Path

from accelerate import PartialState
from accelerate.utils import broadcast_object_list
from filelock import FileLock, Timeout

from ..checkpoints.checkpoint import checkpoint_dirs, disk_full
from ..checkpoints.model_folder import holds_only_saved_model_files, save_tokenizer_without_code
from ..common import json_io
from ..common.faults import RunFolderError, is_disk_full
from ..common.paths import OWNER_MARKER, NotOursError, check_replaceable, written_aside
from ..constants import RUN_TOKENIZER
from .plan import foreign_run_folder

logger = logging.getLogger("concept_encoder")


def setup_run_dirs(
    training_args, preset: str, num_params: int, state: PartialState, resume_dir: Path | None = None
) -> tuple[Path, FileLock | None]:
    """Step 10: `Cache/runs/<run_id>/` with `checkpoints/` and `final/`, locked for this run; the id is
    agreed across ranks. Returns the folder and the lock (held by the main process until released).

    The id is `--run_name` if given (also when resuming another run's checkpoint: that run is only
    read), else the resumed run's id, else `<preset>-<params>M-<timestamp>`. A second process on the
    same folder fails on the lock; a fresh start (no `--resume_from_checkpoint`) into a folder that
    already holds a run is refused, so no run's results are overwritten, and so is a `final/` this project did
    not write (the run would replace it at its end).
    """
    if training_args.run_name:
        run_dir = Path(training_args.output_dir) / training_args.run_name
    elif resume_dir is not None:
        run_dir = resume_dir
    else:
        stamp = [f"{preset or 'model'}-{num_params / 1e6:.1f}M-{dt.datetime.now():%Y%m%d-%H%M%S}"]
        if state.num_processes > 1:
            broadcast_object_list(stamp, from_process=0)
        run_dir = Path(training_args.output_dir) / stamp[0]
    lock, problem = None, [None]
    if state.is_main_process:
        try:
            if foreign := foreign_run_folder(run_dir):
                raise RunFolderError(foreign)
            (run_dir / "checkpoints").mkdir(parents=True, exist_ok=True)
            (run_dir / OWNER_MARKER).touch()  # this project's run folder from now on
            lock = lock_run_dir(run_dir)
            if training_args.resume_from_checkpoint is None and (run_dir / "config.json").exists():
                lock.release()
                raise RunFolderError(
                    f"{run_dir} already holds a run; choose another --run_name, or continue it with "
                    "--resume_from_checkpoint auto"
                )
            check_replaceable(run_dir / "final", holds_only_saved_model_files)  # what the run replaces at its end
        except (OSError, RunFolderError, NotOursError) as error:
            if lock is not None and lock.is_locked:
                lock.release()
            problem = [str(error)]
    if state.num_processes > 1:
        broadcast_object_list(problem, from_process=0)
    if problem[0]:
        raise RunFolderError(problem[0])
    state.wait_for_everyone()
    return run_dir, lock


def lock_run_dir(run_dir: Path) -> FileLock:
    """An OS-level lock on `<run>/.lock` (released by the OS if the process dies)."""
    lock = FileLock(run_dir / ".lock")
    try:
        lock.acquire(timeout=0)
    except Timeout as error:
        raise RunFolderError(
            f"{run_dir} is in use by another training process (lock {run_dir / '.lock'}); "
            "wait for it to finish or choose another --run_name"
        ) from error
    return lock


def finished_run(run_dir: Path, max_steps: int) -> str | None:
    """A line saying the run already finished `max_steps` (from its `summary.json`), else None."""
    path = Path(run_dir) / "summary.json"
    if not path.exists():
        return None
    summary = json.loads(path.read_text())
    if summary.get("preempted") or summary.get("steps", 0) < max_steps:
        return None
    return (
        f"{run_dir} already finished at step {summary['steps']} (summary.json): nothing to resume, nothing changed. "
        "Raise --max_steps to train it further (a run whose learning rate decays to its last step cannot be: "
        "that takes --lr_scheduler_type constant with --warmup_steps, or wsd resumed from a checkpoint of its "
        "stable phase)"
    )


def ended_without_checkpoint(run_dir: Path, max_steps: int) -> str | None:
    """A line refusing `--resume_from_checkpoint auto` over a run that ended (`summary.json`) before `max_steps`
    and kept no intact checkpoint to go on from (`--save_steps 0`, or a run shorter than `--save_steps`): a fresh
    start would replace its final model
    and mix two histories in one metrics file. None when that is not the case."""
    path = Path(run_dir) / "summary.json"
    if not path.is_file() or checkpoint_dirs(Path(run_dir)):
        return None
    steps = json.loads(path.read_text()).get("steps", 0)
    if steps >= max_steps:
        return None
    return (
        f"{run_dir} ended at step {steps} and kept no checkpoint to continue from (none was due: --save_steps 0, or a "
        "run shorter than --save_steps), so it "
        f"cannot be trained on to step {max_steps}; start a new --run_name (with --save_steps > 0 to extend it later)"
    )


def starting_tokenizer(resume: Path | None, model_name_or_path: str | None, tokenizer_spec: str) -> Path | None:
    """The tokenizer folder a pretraining run reads its data with, or None to build `--tokenizer` as given: a
    resume's own copy (`<run>/tokenizer`; trained tokenizers are not reproducible), else, starting from a model
    folder, the folder's own (`data.tokenizer.model_tokenizer_folder`: a `--tokenizer` other than the default
    must be that folder or, for a folder saved without one, the tokenizer it was trained with)."""
    from ..data.arguments import DataArguments
    from ..data.tokenizer import model_tokenizer_folder  # deferred: transformers' tokenizers load only for a run

    if resume is not None:
        return resume.parent.parent / RUN_TOKENIZER
    if not model_name_or_path:
        return None
    given = None if tokenizer_spec == DataArguments.__dataclass_fields__["tokenizer"].default else tokenizer_spec
    return Path(model_tokenizer_folder(model_name_or_path, given))


def keep_run_tokenizer(run_dir: Path, tokenizer) -> None:
    """Save the run's tokenizer to `<run>/tokenizer` once (a temporary folder renamed into place); resumes of
    the run load it from there, never from the shared cache, which may have been retrained since."""
    folder = Path(run_dir) / RUN_TOKENIZER
    if folder.is_dir():
        return
    with written_aside(folder) as partial:
        save_tokenizer_without_code(tokenizer, partial)


def ended_on_its_own(run_dir: Path) -> bool:
    """A pretraining run that ended by itself (all steps, or stopped by a gate), final model saved: not
    preempted, not crashed. Tools that rerun a plan (ablate, curve) skip such runs."""
    summary = run_dir / "summary.json"
    if not summary.is_file() or not (run_dir / "final").is_dir():
        return False
    return not json.loads(summary.read_text()).get("preempted", False)


def stopped_by_gate(run_dir: Path) -> bool:
    """The run's summary.json says a failed decision gate stopped it (`accelerate launch` reports the
    loop's exit code 3 as 1, so the file is what tells)."""
    summary = run_dir / "summary.json"
    return summary.is_file() and json.loads(summary.read_text()).get("stopped_by_gate") is True


def unfinished_launch(run_dir: Path, code: int, started: float) -> str | None:
    """Why the pretraining launch that started at `started` (`time.time()`) and exited with `code` left `run_dir`
    unfinished, as the rest of a sentence that starts with the run's name; None when the run ended on its own (all
    its steps, or a gate). `accelerate launch` reports every non-zero exit of the loop as 1 (a gate's 3, a signal's
    128 + its number), so the run's summary.json tells a signal's stop (checkpointed, resumable) from a failure:
    one this launch wrote (an earlier launch's, stopped by a signal, stays until the run writes its next)."""
    summary = run_dir / "summary.json"
    fresh = summary.is_file() and summary.stat().st_mtime >= started - 2  # 2 s: a file system's coarse clock
    stopped = json.loads(summary.read_text()) if fresh else {}
    if stopped.get("preempted"):
        return f"was stopped by a signal at step {stopped.get('steps')} (checkpointed)"
    if (code == 0 or stopped_by_gate(run_dir)) and ended_on_its_own(run_dir):
        return None
    return f"failed (exit code {code})" if code else "ended with exit code 0 but without its final model"


def save_run_config(run_dir: Path, config: dict) -> None:
    """Step 11a: the resolved configuration, written to the run dir and logged."""
    logger.info("resolved config: %s", json.dumps(config, default=str))
    try:
        with written_aside(run_dir / "config.json") as partial:  # a full disk leaves no half-written config
            partial.write_text(json_io.dumps(config, indent=2, default=str))
    except OSError as error:
        if is_disk_full(error):
            raise disk_full(run_dir, "the run config") from error
        raise


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
