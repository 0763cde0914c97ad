"""Rules derived from the loop's arguments, defined once for the loop, the plan checker and the ZeRO comparison.

Torch-free (the plan checker must answer in about a second):

- `fresh_model_fields`: the config fields of a fresh preset model, with the position table grown to
  the sequence length (what `build_model` builds, what the memory model is asked about);
- `deepspeed_batch_values`: the batch entries of a ds config for a micro-batch, accumulation and
  world size (what the loop fills into `"auto"`, what the plan checker compares a fixed value with);
- `launch_command`: the `accelerate launch ... loops/mlm.py <flags>` line for parsed arguments;
  `local_launcher`: the launcher the tools that run loops one after another use (ablate, curve).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from ..accounting.memory import zero_settings
from ..common.dataclass_args import to_argv
from ..common.paths import OWNER_MARKER, folder_problem, unusable_path
from ..model.presets import PRESETS

LOOP_SCRIPT = "loops/mlm.py"
PYTHON_ACCELERATE_LAUNCH = (sys.executable, "-m", "accelerate.commands.launch")  # this interpreter's accelerate


def fresh_model_fields(model_args, max_seq_length: int, vocab_size: int, **special_ids) -> dict:
    """Config fields of a fresh `model_args.preset` model: the preset's shape, the overrides of
    `model_args`, the vocabulary (and special ids) of the tokenizer, and a position table grown to
    `max_seq_length` when the preset's is shorter. For `--architecture bert`, the fields of the
    BERT of that shape (`model_type` "bert", no concepts, no decoder)."""
    fields = {**PRESETS[model_args.preset], "vocab_size": vocab_size}
    if model_args.architecture == "bert":
        fields = {key: value for key, value in fields.items() if key != "concept_num"}
        fields["model_type"] = "bert"
    else:
        fields["decoder_type"] = model_args.decoder_type
        fields["token_kv_sharing"] = model_args.token_kv_sharing
        fields["token_refinement"] = getattr(model_args, "token_refinement", False)
        fields["local_mixer"] = getattr(model_args, "local_mixer", "none")
        fields["local_mixer_width"] = getattr(model_args, "local_mixer_width", 3)
        fields["local_mixer_placement"] = getattr(model_args, "local_mixer_placement", "first")
    if model_args.concept_num is not None:
        fields["concept_num"] = model_args.concept_num
    if model_args.hidden_dropout_prob is not None:
        fields["hidden_dropout_prob"] = model_args.hidden_dropout_prob
    fields["max_position_embeddings"] = max(fields["max_position_embeddings"], max_seq_length)
    return {**fields, **special_ids}


def decoded_fraction(training_args, mlm_probability: float) -> float:
    """The largest fraction of a sequence's positions the objective decodes in one step (what memory
    must hold): `mlm_probability` for mlm; 1 for diffusion (a sample's rate t can reach 1) and tsdae."""
    return mlm_probability if training_args.objective in ("mlm", "distill") else 1.0


def deepspeed_batch_values(training_args, world_size: int) -> dict[str, int]:
    """The ds config's batch entries: micro-batch per process, accumulation, and their global product."""
    micro, accumulation = training_args.per_device_train_batch_size, training_args.gradient_accumulation_steps
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accumulation,
        "train_batch_size": micro * accumulation * world_size,
    }


# ds config entries that must be numbers at or above a bound when given (or "auto", filled by the loop)
DS_NUMBER_BOUNDS = {
    ("train_micro_batch_size_per_gpu",): 1, ("gradient_accumulation_steps",): 1, ("train_batch_size",): 1,
    ("gradient_clipping",): 0, ("zero_optimization", "reduce_bucket_size"): 1,
    ("zero_optimization", "allgather_bucket_size"): 1, ("zero_optimization", "stage3_prefetch_bucket_size"): 0,
    ("zero_optimization", "stage3_param_persistence_threshold"): 0, ("zero_optimization", "stage3_max_live_parameters"): 0,
    ("zero_optimization", "stage3_max_reuse_distance"): 0, ("zero_optimization", "sub_group_size"): 1,
}  # fmt: skip
OFFLOAD_DEVICES = ("none", "cpu", "nvme")


def ds_config_problems(config: dict) -> list[str]:
    """What in a DeepSpeed config is out of range (a ZeRO stage other than 0-3, an unknown offload device,
    a bucket or batch size below its bound), each naming the entry; empty when sound."""
    problems = []
    zero = config.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        return ["zero_optimization must be a mapping"]
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3) or isinstance(stage, bool):
        problems.append(f"zero_optimization.stage={stage!r} must be 0, 1, 2 or 3")
    for key in ("offload_optimizer", "offload_param"):
        device = (zero.get(key) or {}).get("device", "none") if isinstance(zero.get(key) or {}, dict) else None
        if device not in OFFLOAD_DEVICES:
            problems.append(f"zero_optimization.{key}.device={device!r} must be one of {OFFLOAD_DEVICES}")
    for path, bound in DS_NUMBER_BOUNDS.items():
        value = config
        for part in path:
            value = value.get(part) if isinstance(value, dict) else None
        if value is None or value == "auto":
            continue
        if isinstance(value, bool) or not isinstance(value, int | float) or value < bound:
            problems.append(f'{".".join(path)}={value!r} must be a number >= {bound} (or "auto")')
    return problems  # precision (fp16 and bf16 both on, bf16 on an old GPU) is the plan checker's own check


def launched_ds_config() -> dict | None:
    """The ds config `accelerate launch` handed this process (known before the Accelerator exists): its
    `--deepspeed_config_file`, or the stage and offload devices of its flags; None without DeepSpeed."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return None
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "none")
    if path != "none" and Path(path).is_file():
        return json.loads(Path(path).read_text())
    zero = {"stage": int(os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", 0))}
    for key, variable in (("offload_optimizer", "OPTIMIZER"), ("offload_param", "PARAM")):
        zero[key] = {"device": os.environ.get(f"ACCELERATE_DEEPSPEED_OFFLOAD_{variable}_DEVICE", "none")}
    return {"zero_optimization": zero}


def zero3_compile_problem(training_args, ds_config: dict | None) -> tuple[str, str] | None:
    """(why, the fix) when `--torch_compile` meets a ZeRO-3 ds config, else None. ZeRO-3 keeps each layer's
    parameters partitioned and gathers them in forward hooks just before the layer runs; dynamo would trace
    those hooks (collectives, parameters whose storage comes and goes) or break its graph at every layer."""
    if not training_args.torch_compile or zero_settings(ds_config)[0] != 3:
        return None
    return (
        "--torch_compile under ZeRO-3 (this launch's ds config has stage 3): dynamo would trace the hooks with which "
        "ZeRO-3 gathers each layer's partitioned parameters",
        "launch with a ZeRO-0/1/2 config (ds_configs/zero2.json) or drop --torch_compile",
    )


def output_dir_problem(output_dir: str) -> str | None:
    """Why runs cannot be written under `output_dir` (a file in the way, no write permission), else None."""
    return folder_problem(output_dir, "--output_dir")


def output_file_problem(path: str | Path, what: str) -> str | None:
    """Why the file `path` cannot be written (a folder in its place, its folder not writable), else None:
    checked before the work whose result it is to hold."""
    path = Path(path).expanduser()
    if problem := unusable_path(path):
        return f"{what} {path}: {problem}"
    if path.is_dir():
        return f"{what} {path} is a folder; give a file name, e.g. {path / 'result.json'}"
    return folder_problem(path.parent, what)


def local_launcher(script: str | Path, num_processes: int = 1) -> list[str]:
    """This interpreter's `accelerate launch` of `script` on one machine (dynamo off: the loops compile
    themselves with --torch_compile), for tools that run the loops one after another."""
    return [*PYTHON_ACCELERATE_LAUNCH, "--quiet", "--num_processes", str(num_processes), "--num_machines", "1",
            "--dynamo_backend", "no", str(script)]  # fmt: skip  # quiet: a failed loop's one line, no launcher trace


def launch_command(accelerate_options: list[str], *loop_arguments, launcher=("accelerate", "launch"),
                   script: str = LOOP_SCRIPT) -> list[str]:  # fmt: skip
    """`launcher + accelerate_options + [script] + to_argv(*loop_arguments)`: the exact command that runs
    the loop with these parsed arguments (only values that differ from the defaults are spelled out)."""
    return [*launcher, *accelerate_options, script, *to_argv(*loop_arguments)]


def foreign_run_folder(run_dir: Path) -> str | None:
    """Why `run_dir` cannot be a run folder of this project (a link or a file there; a folder holding files without
    the `OWNER_MARKER` this project puts in each run folder and without a run config of its own: someone's own
    folder, which a run would overwrite), else None. Run folders written before the marker are recognised by
    their `config.json` (a JSON object with `training_args`, what both loops write)."""
    if run_dir.is_symlink() or run_dir.exists() and not run_dir.is_dir():
        return f"{run_dir} is a link or a file, not a run folder; choose another --run_name"
    if not run_dir.is_dir() or (run_dir / OWNER_MARKER).is_file():
        return None

    def checkpoints_only(entry: Path) -> bool:  # `checkpoints/` holding nothing but step_N folders (copied in)
        return (
            entry.name == "checkpoints" and entry.is_dir() and all(c.name.startswith("step_") for c in entry.iterdir())
        )

    entries = [e for e in run_dir.iterdir() if e.name not in (".lock", OWNER_MARKER) and not checkpoints_only(e)]
    config = run_dir / "config.json"
    try:
        legacy = config.is_file() and isinstance(json.loads(config.read_text()).get("training_args"), dict)
    except (OSError, ValueError, AttributeError):
        legacy = False
    if entries and not legacy:
        return (
            f"{run_dir} holds files this project did not write (no {OWNER_MARKER} marker, no run config of its own: "
            f"{', '.join(sorted(e.name for e in entries)[:5])}): refusing to write a run into it; choose another "
            "--run_name"
        )
    return None
