"""A DeepSpeed checkpoint resumed on another number of processes, through DeepSpeed's universal checkpoint.

ZeRO-1/2 (and bf16 ZeRO-0) partition the fp32 master weights and Adam moments over the data-parallel ranks that
saved them, and DeepSpeed refuses to load those shards on another count. Its universal checkpoint
(`deepspeed.checkpoint.ds_to_universal`) holds each parameter's fp32 weights and moments whole, which the engine
re-partitions for any count when its config says `"checkpoint": {"load_universal": true}`. DeepSpeed ships the
converter as a script and the loading as a config key; what is written here is the glue (why hand-written): the
config key set before `accelerator.prepare` builds the engine, the conversion run once on the main process into a
staging folder of the new run (the checkpoint itself is never touched) that links every other file of the
checkpoint, and that folder removed when every rank has loaded. The stage is made fresh and removed without
following links (`paths.fresh_folder`, `paths.remove_below`): a `resharding` folder, or a stage, that is a link
(e.g. to the checkpoint itself) is unlinked, never emptied through. ZeRO-3 checkpoints (the weights themselves
partitioned) are refused with one line naming `export` (`checkpoint.reshard_problem`, which reads the stage from
the checkpoint with `weights_only`).
"""

from __future__ import annotations

import contextlib
import io
import logging
from argparse import Namespace
from pathlib import Path

from ..common.paths import fresh_folder, remove_below

logger = logging.getLogger("concept_encoder")
DEEPSPEED_MODEL_FOLDER = "pytorch_model"  # the engine's checkpoint tag (folder) in accelerate's `save_state`
RESHARDING_FOLDER = "resharding"  # <run>/resharding/<checkpoint name>: the staged universal copy, while loading


def optimizer_shards(checkpoint: Path) -> list[Path]:
    """The per-rank ZeRO optimizer files of a DeepSpeed checkpoint (none for fp32 ZeRO-0: its optimizer state is
    whole, in the model-states file, and loads on any process count as it is)."""
    return sorted(Path(checkpoint).rglob("*optim_states.pt"))


def needs_universal_load(checkpoint: Path | None, saved_world: int | None, world: int) -> bool:
    """Whether resuming `checkpoint` (saved by `saved_world` processes, None: unknown) on `world` processes goes
    through a universal checkpoint: a DeepSpeed checkpoint with optimizer shards, saved by another number of ranks."""
    if checkpoint is None or saved_world in (None, world):
        return False
    return bool(optimizer_shards(checkpoint))


def plan_universal_load(ds_config: dict | None, checkpoint: Path | None, saved_world: int | None, world: int) -> None:
    """Before `accelerator.prepare`: sets `"checkpoint": {"load_universal": true}` in the launch's ds config when
    the resume reshards (`needs_universal_load`), so the engine built from it loads whole parameters."""
    if ds_config is not None and needs_universal_load(checkpoint, saved_world, world):
        ds_config.setdefault("checkpoint", {})["load_universal"] = True


def convert_to_universal(source: Path, target: Path) -> None:
    """DeepSpeed's `ds_to_universal` of the engine folder `source` into `target` (its progress lines logged at
    debug level). The checkpoint's files were already read `weights_only` (`verify_deepspeed_states`): the
    converter unpickles them in full."""
    from deepspeed.checkpoint import ds_to_universal

    options = Namespace(input_folder=str(source), output_folder=str(target), num_extract_workers=1,
                        num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)  # fmt: skip
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        ds_to_universal.main(options)
    logger.debug("ds_to_universal %s -> %s:\n%s", source, target, printed.getvalue())


@contextlib.contextmanager
def staged_checkpoint(accelerator, checkpoint: Path, run_dir: Path, universal: bool):
    """The folder `accelerator.load_state` reads: `checkpoint` itself, or (`universal`) `<run>/resharding/<name>`,
    where the main process writes the universal conversion of the engine folder and links every other file of the
    checkpoint; every rank waits for it, and it is removed when every rank has loaded."""
    if not universal:
        yield checkpoint
        return
    staged = Path(run_dir) / RESHARDING_FOLDER / checkpoint.name
    if accelerator.is_main_process:
        fresh_folder(staged, run_dir)  # a stage left by an interrupted resume is removed; a link is only unlinked
        for entry in checkpoint.iterdir():
            if entry.name != DEEPSPEED_MODEL_FOLDER:
                (staged / entry.name).symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
        logger.info("resharding %s for %d processes: DeepSpeed universal checkpoint in %s", checkpoint,
                    accelerator.num_processes, staged)  # fmt: skip
        convert_to_universal(checkpoint / DEEPSPEED_MODEL_FOLDER, staged / DEEPSPEED_MODEL_FOLDER)
    accelerator.wait_for_everyone()
    try:
        yield staged
    finally:
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            remove_below(staged, run_dir)
            with contextlib.suppress(OSError):
                staged.parent.rmdir()
