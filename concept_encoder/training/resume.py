"""What a resume must keep: the settings a checkpoint records (`resume_settings`), the rules that compare them
with this run's (a changed schedule or process count may continue, every other difference is refused, named), and
`differences`, the one way every "reuse only what matches" refusal names what differs (resumes, curve requests,
ablation runs).

The checkpoint files themselves (written, checked, found, loaded) are `checkpoints/checkpoint.py`; these rules
read the loop's arguments, so they stay with the loop.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from ..checkpoints.checkpoint import (
    RESUME_SETTINGS,
    CheckpointError,
    json_or_none,
    reshard_problem,
    saved_train_state,
    sharded_by_deepspeed,
)
from ..common.differences import differences
from .args import SCHEDULE_ARGUMENTS

logger = logging.getLogger("concept_encoder")


MODEL_SHAPE_KEYS = (
    "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "concept_num",
    "max_position_embeddings", "decoder_type", "num_decoder_layers",
)  # fmt: skip


def resume_settings(model_config, model_args, data_args, training_args, world_size: int, tokenizer=None) -> dict:
    """What a resume must keep: the model's shape, the processes, the per-device batch and
    accumulation (they fix the data position), the data (source, tokenizer spec and its vocabulary's
    content, blocks, masking), the objective (its corruption's generator state is in the checkpoint),
    `--torch_compile`, and every other argument that decides what is trained (`argument_settings`)."""
    from ..data.tokenizer import vocab_digest  # deferred: keeps the preflight (which finds checkpoints) torch-free

    config = model_config.to_dict()
    vocabulary = {} if tokenizer is None else {"data.vocab_sha256": vocab_digest(tokenizer)}
    return {
        **vocabulary,
        **argument_settings(model_args, data_args, training_args),
        **{f"model.{key}": config.get(key) for key in MODEL_SHAPE_KEYS},
        "world_size": world_size,
        "per_device_train_batch_size": training_args.per_device_train_batch_size,
        "gradient_accumulation_steps": training_args.gradient_accumulation_steps,
        "objective": training_args.objective,
        "torch_compile": training_args.torch_compile,  # a compiled model's checkpoint names its weights `_orig_mod.*`
        "schedule": training_args.schedule,  # a larger --max_steps continues only a schedule that does not depend on it
        **{
            f"data.{key}": getattr(data_args, key)
            for key in ("dataset", "text_field", "tokenizer", "max_seq_length", "packing", "streaming", "masking")
        },
    }


# Arguments that may change when a run resumes (or a finished fine-tuning run is reused): where and how often it
# writes, logs, evaluates and checks gates, how long it goes on (`max_steps`: training further, e.g. a curve's
# budget added later), how data are loaded, and the hardware budget. Every other argument decides what is trained
# and is recorded in the checkpoint as `args.<name>` (`argument_settings`), so a resume under another value is
# refused naming it: a new learning rate would be written in the run's config.json while the restored scheduler
# kept the old one.
RESUME_FREE = frozenset({
    "output_dir", "run_name", "max_steps", "epochs", "resume_from_checkpoint", "per_device_eval_batch_size",
    "logging_steps", "eval_steps", "max_eval_batches", "save_steps", "save_total_limit", "snapshot_steps",
    "max_bad_steps", "dataloader_num_workers", "preprocessing_num_workers", "report_to", "wandb_project",
    "progress_bar", "peak_tflops", "cuda_memory_budget_gb", "gate", "gate_action", "gradient_checkpointing",
    "streaming_validation_documents", "seeds", "compare_to", "learning_rates", "probe", "finetune", "report_dir",
    "max_time", "tf32", "profile_steps", "checkpoint_steps",  # how long this invocation may run, matmul precision, tracing
    "save_dtype",  # how the model folders are stored, not what is trained
    "allow_cpu",  # whether a machine whose GPU torch cannot use may train on its CPU
    "task",  # a task file's path: its content is keyed by task_sha256 (a moved file is the same task)
})  # fmt: skip


def argument_settings(*arguments) -> dict:
    """`args.<name>` → value for every field of the argument dataclasses `arguments` that decides what is trained
    (all but `RESUME_FREE`), as JSON holds it."""
    import dataclasses

    values = {f"args.{f.name}": getattr(instance, f.name) for instance in arguments
              for f in dataclasses.fields(instance) if f.name not in RESUME_FREE}  # fmt: skip
    return json.loads(json.dumps(values, default=str))


# Settings added after the first release, with the value every earlier checkpoint was written with.
RESUME_DEFAULTS = {"objective": "mlm", "model.model_type": "concept_encoder", "torch_compile": False,
                   "extend_positions": "no", "chunk_length": None, "bucket_by_length": False}  # fmt: skip

# Settings earlier checkpoints did not record and that have no such value: compared only when recorded.
RECORDED_SINCE = ("data.vocab_sha256", "task_sha256", "max_steps", "schedule", "model_sha256")


def settings_differences(saved: dict, current: dict, what: str) -> list[str]:
    """`key: <what> <saved>, this run <current>` for every setting that differs (keys recorded only since
    `RECORDED_SINCE` are not held against what was saved before them; `RESUME_DEFAULTS` fill older records)."""
    normalise = json.loads(json.dumps(current, default=str))  # the saved file's types
    saved = {**{key: value for key, value in RESUME_DEFAULTS.items() if key in normalise}, **saved}
    normalise = {key: value for key, value in normalise.items()
                 if key in saved or key not in RECORDED_SINCE and not key.startswith("args.")}  # fmt: skip
    return differences(saved, normalise, what, "this run")


def run_config_arguments(run_dir: Path, current: dict) -> dict:
    """For a checkpoint written before its arguments were recorded (`args.*`): the arguments of the run's
    `config.json` (what its last invocation ran with) under the keys `current` has, so a resume under another
    learning rate or seed is refused for those runs too; a warning when the run has no readable config."""
    config = json_or_none(Path(run_dir) / "config.json")
    names = ("model_args", "data_args", "training_args", "finetune_args", "task_args")  # the loops' config groups
    groups = [config[n] for n in names if isinstance(config.get(n), dict)] if isinstance(config, dict) else []
    found = {f"args.{name}": value for group in groups for name, value in group.items() if f"args.{name}" in current}
    if not found:
        logger.warning("%s records no arguments (written before they were recorded): a resume under another "
                       "learning rate, seed or masking cannot be detected; resume with the run's own", run_dir)  # fmt: skip
    return json.loads(json.dumps(found, default=str))


def check_resume_settings(checkpoint: Path, current: dict) -> None:
    """Refuse a resume whose settings cannot continue `checkpoint`, naming every difference."""
    path = checkpoint / RESUME_SETTINGS
    if not path.exists():
        logger.warning("%s has no %s: resuming without checking the settings", checkpoint, RESUME_SETTINGS)
        return
    saved = json.loads(path.read_text())
    if not any(key.startswith("args.") for key in saved):  # written before every argument was recorded
        saved.update(run_config_arguments(checkpoint.parent.parent, current))
    saved, current, schedule = split_schedule(saved, current, saved_train_state(checkpoint).step)
    saved, current, processes = split_processes(saved, current, checkpoint)
    differences = settings_differences(saved, current, "checkpoint") + [p for p in (schedule, processes) if p]
    if differences:
        vocabulary = (
            " (data.vocab_sha256 is the tokenizer's vocabulary: the run's own copy, <run>/tokenizer, is missing, and "
            "the tokenizer cache holds a different training: token ids would not mean what the model learned)"
            if any(d.startswith("data.vocab_sha256") for d in differences) else ""
        )  # fmt: skip
        raise CheckpointError(
            f"cannot resume {checkpoint}: this run differs in {'; '.join(differences)}{vocabulary}. "
            "Resume with the checkpoint's settings, or start a new run without --resume_from_checkpoint"
        )


def split_schedule(saved: dict, current: dict, step: int) -> tuple[dict, dict, str | None]:
    """The settings without the learning-rate schedule's, and why the schedules disagree (None when they agree):
    where both record a `schedule`, a resume may change the schedule's arguments (a larger --max_steps, wsd branched
    from a constant run) as long as the rates up to the checkpoint's `step` stay those it trained with
    (`optim.schedule_problem`); elsewhere (an older checkpoint) the arguments are compared one by one."""
    if "schedule" not in saved or "schedule" not in current:
        return saved, current, None
    from .optim import schedule_problem  # deferred: torch and transformers' schedules

    names = {"schedule", *(f"args.{name}" for name in SCHEDULE_ARGUMENTS)}
    rest = [{key: value for key, value in settings.items() if key not in names} for settings in (saved, current)]
    current_schedule = json.loads(json.dumps(current["schedule"]))
    return rest[0], rest[1], schedule_problem(saved["schedule"], current_schedule, step)


def split_processes(saved: dict, current: dict, checkpoint: Path) -> tuple[dict, dict, str | None]:
    """The settings without the process count and accumulation, and why this run cannot continue `checkpoint` on
    its number of processes (None when it can). A run moves to another number of processes when the global
    batch (processes × per-device batch × accumulation) and the per-device batch stay: every optimizer step then
    trains on the same micro-batches of the same sampler, only spread over other ranks (`resharded_position`).
    A DeepSpeed ZeRO-0/1/2 checkpoint moves through DeepSpeed's universal checkpoint (`reshard`); refused for
    ZeRO-3 (its weights are partitioned per rank) and a streamed dataset (its position is per process)."""
    keys = ("world_size", "gradient_accumulation_steps", "args.gradient_accumulation_steps")
    if saved.get("world_size") in (None, current.get("world_size")):
        return saved, current, None
    rest = [{key: value for key, value in settings.items() if key not in keys} for settings in (saved, current)]
    moved = f"world_size: checkpoint {saved['world_size']}, this run {current['world_size']}"

    def global_batch(settings):
        return (
            settings["world_size"] * settings["per_device_train_batch_size"] * settings["gradient_accumulation_steps"]
        )

    if sharded_by_deepspeed(checkpoint):
        if problem := reshard_problem(checkpoint, saved["world_size"]):
            return rest[0], rest[1], f"{moved} ({problem})"
    if saved.get("data.streaming"):
        return rest[0], rest[1], f"{moved} (--streaming: each process holds its own position in the stream)"
    if global_batch(saved) != global_batch(current) or saved.get("per_device_train_batch_size") != current.get(
        "per_device_train_batch_size"
    ):
        needed = global_batch(saved) / (current["world_size"] * saved["per_device_train_batch_size"])
        fix = (f"give --gradient_accumulation_steps {int(needed)}" if needed == int(needed) and needed >= 1 else
               f"use a process count that divides {saved['world_size'] * saved['gradient_accumulation_steps']}")  # fmt: skip
        return (
            rest[0],
            rest[1],
            (
                f"{moved}: another process count continues the run only with the same global batch "
                f"({saved['world_size']} × {saved['per_device_train_batch_size']} × "
                f"{saved['gradient_accumulation_steps']} = {global_batch(saved)} examples a step) and per-device batch "
                f"{saved['per_device_train_batch_size']}; {fix}"
            ),
        )
    return rest[0], rest[1], None
