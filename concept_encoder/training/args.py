"""Arguments of the training loops: typed dataclasses, an optional YAML file, CLI overrides on top.

`parse_args(["--config", "run.yaml", "--learning_rate", "1e-3"])`: YAML values replace the
defaults, command-line flags replace the YAML. Unknown keys, in the YAML or on the command
line, are an error. Every value is validated in `__post_init__`, before anything heavy runs.

Each loop's argument set checks its own rules between classes (`check_pretraining_combination`,
`check_finetune_combination`); the generic parsing (YAML, typed values, repeated flags, `to_argv`, the flags
that reproduce a parse) is `concept_encoder/common/dataclass_args.py`.

This module imports neither torch nor transformers' model code: the launch plan checker parses
the loop's flags with this very parser (`parse_args`), so a flag the loop rejects is rejected
there too, with the same message.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import sys
from dataclasses import dataclass, field, fields
from pathlib import Path

from ..checkpoints.model_folder import model_folder_problem
from ..common.dataclass_args import (
    ArgumentSet,
    field_default,
    given_fields,
    imply_defaults,
    parse_dataclasses,
    read_yaml_mapping,
    resolve_default,
)
from ..common.padding import check_pad_multiple, pad_multiple_field
from ..common.paths import cache_path
from ..constants import (
    ARCHITECTURES,
    CONCEPT_LOSS_NAMES,
    DIFFUSION_WEIGHTINGS,
    DISTILL_LOSSES,
    LOSS_WEIGHTING_NAMES,
    OBJECTIVES,
    SAVE_DTYPES,
    TASK_METRIC_NAMES,
    check_concept_loss_settings,
    pretraining_metric_names,
)
from ..data.arguments import DataArguments
from ..data.mixture import TASK_SOURCE, is_mixture, parse_mixture
from ..model.constants import (
    CLASSIFIER_POOLINGS,
    DECODER_TYPES,
    LOCAL_MIXER_PLACEMENTS,
    LOCAL_MIXERS,
    POSITION_EXTENSIONS,
    TOKEN_QUERY_DECODERS,
    local_mixer_problem,
    mixed_decoder_problem,
    token_kv_groups,
    token_refinement_problem,
)
from ..model.presets import PRESETS
from ..tasks.arguments import (
    EMBEDDED_TASKS,
    LISTOPS_TASKS,
    LONG_TASKS,
    MODULES_PACKAGE,
    MODULES_SPLICED,
    NEEDLE_PREFIX,
    RECALL_TASKS,
    TaskArguments,
    is_listops,
    is_recall,
)
from .gates import GATE_ACTIONS, GATE_EXIT_CODE, parse_gates

EXTEND_HELP = (
    f"one of {POSITION_EXTENSIONS}: a saved model whose position table is shorter than --max_seq_length is refused (no), "
    "or its table grown by repeating the trained rows (copy; model/positions.py)"
)


LR_SCHEDULES = ("cosine", "linear", "constant", "wsd")
WSD_DECAYS = ("1-sqrt", "linear", "cosine")  # transformers' get_wsd_schedule decay_type
SCHEDULE_ARGUMENTS = ("lr_scheduler_type", "warmup_steps", "warmup_ratio", "decay_steps", "decay_type", "min_lr_ratio")
# The schedules each schedule-specific setting acts under: anywhere else it would be ignored while the run's
# config.json recorded it, so it is refused set to anything but its default (`check_schedule`).
SCHEDULE_ONLY = {"decay_steps": ("wsd",), "decay_type": ("wsd",), "min_lr_ratio": ("wsd", "cosine")}


def schedule_setting_problem(args, name: str) -> str | None:
    """Why `--<name>` (a `SCHEDULE_ONLY` setting) cannot stand beside this run's schedule: it is set away from its
    default and the schedule ignores it. None when it applies or is left at its default."""
    schedules = SCHEDULE_ONLY[name]
    if (
        args.lr_scheduler_type in schedules
        or getattr(args, name) == TrainingArguments.__dataclass_fields__[name].default
    ):
        return None
    return (
        f"--{name} applies to --lr_scheduler_type {' or '.join(schedules)} only (this run: {args.lr_scheduler_type}), "
        "which ignores it: drop it, or choose a schedule that uses it"
    )


def check_schedule(args) -> None:
    """The learning-rate schedule's settings (ValueError naming the fix): every choice is checked against its
    choices whatever the schedule (a misspelt value is an error, not silently unused); a setting the schedule
    ignores is refused (`SCHEDULE_ONLY`); wsd needs a decay that fits after the warm-up."""
    kind = args.lr_scheduler_type
    if kind not in LR_SCHEDULES:
        raise ValueError(f"lr_scheduler_type={kind!r} is unknown; choose one of {LR_SCHEDULES}")
    if args.decay_type not in WSD_DECAYS:
        raise ValueError(f"decay_type={args.decay_type!r} is unknown; choose one of {WSD_DECAYS}")
    if not 0 <= args.min_lr_ratio < 1:
        raise ValueError(f"min_lr_ratio={args.min_lr_ratio} must be in [0, 1): the last step's rate over the peak")
    if args.decay_steps is not None and args.decay_steps < 1:
        raise ValueError(f"decay_steps={args.decay_steps} must be >= 1: the decay's length in optimizer steps")
    for name in SCHEDULE_ONLY:
        if problem := schedule_setting_problem(args, name):
            raise ValueError(problem)
    if kind != "wsd":
        return
    if args.decay_steps is None:
        raise ValueError(
            "--lr_scheduler_type wsd needs --decay_steps N >= 1: the decay's length, ending at --max_steps"
        )
    warmup = args.warmup_steps or int(args.warmup_ratio * args.max_steps)
    if warmup + args.decay_steps > args.max_steps:
        raise ValueError(
            f"--lr_scheduler_type wsd: warm-up {warmup} + decay_steps {args.decay_steps} exceed max_steps "
            f"{args.max_steps}; shorten the decay or the warm-up"
        )


def step_list(text: str, name: str) -> list[int]:
    """`"250,1000"` → [250, 1000] (sorted, once each); ValueError naming `name`."""
    try:
        return sorted({int(step) for step in text.split(",") if step.strip()})
    except ValueError:
        raise ValueError(f"{name}={text!r} is not a comma-separated list of step numbers, e.g. 250,1000") from None


PROFILE_RANGE = re.compile(r"\s*(\d+)\s*:\s*(\d+)\s*", re.ASCII)


def profile_range(text: str, max_steps: int) -> tuple[int, int] | None:
    """`--profile_steps "3:5"` → (3, 5), `""` → None; ValueError saying what is wrong and what to give: a range
    that cannot happen (reversed, starting at 0, reaching past --max_steps) would otherwise record nothing, silently."""
    if not text.strip():
        return None
    if not (match := PROFILE_RANGE.fullmatch(text)):
        raise ValueError(f"profile_steps={text!r} is not a step range a:b, e.g. 10:12 (optimizer steps 10 to 12)")
    first, last = int(match[1]), int(match[2])
    reason = (
        "a is 0" if first < 1
        else f"b={last} comes before a={first}" if last < first
        else f"b={last} is beyond max_steps, which ends the run first" if last > max_steps
        else None
    )  # fmt: skip
    if reason:
        raise ValueError(
            f"profile_steps={text!r}: {reason}; need 1 <= a <= b <= max_steps ({max_steps}); steps are 1-based "
            "optimizer steps"
        )
    return first, last


DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str, name: str) -> float:
    """Seconds in `text` such as `2h`, `90m`, `1h30m`, `45s` or `3600` (seconds); ValueError naming `name`. A time
    budget is finite and positive: `inf` would be written into summary.json as `Infinity`, which is no JSON, and
    spends nothing a run without the flag would not."""
    parts = re.fullmatch(r"\s*(?:(\d+(?:\.\d+)?)\s*([smhd])\s*)+", text.lower()) and re.findall(
        r"(\d+(?:\.\d+)?)\s*([smhd])", text.lower()
    )
    try:
        seconds = sum(float(n) * DURATION_UNITS[u] for n, u in parts) if parts else float(text)
    except ValueError:
        seconds = None
    if seconds is None or not 0 < seconds < math.inf:  # nan, inf, 0 and negatives: no budget to keep
        raise ValueError(
            f"{name}={text!r} is no duration > 0: write e.g. 2h, 90m, 1h30m or 45s (finite: nan and inf are no budget)"
        )
    return seconds


def check_extension(value: str) -> None:
    if value not in POSITION_EXTENSIONS:
        raise ValueError(f"extend_positions={value!r} is unknown; choose one of {POSITION_EXTENSIONS}")


@dataclass
class ModelArguments:
    """Which model to build (a preset plus overrides) or load."""

    preset: str = field(default="small", metadata={"help": f"size preset: one of {sorted(PRESETS)}"})
    architecture: str = field(
        default="concept",
        metadata={"help": f"one of {ARCHITECTURES}: a Concept Encoder, or transformers' BertForMaskedLM of the "
                  "preset's shape (the baseline; --objective mlm or diffusion)"},
    )  # fmt: skip
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "start from a saved model folder instead of a fresh preset"}
    )
    decoder_type: str | None = field(
        default=None,
        metadata={
            "help": f"MLM decoder: one of {DECODER_TYPES} (default: posonly for tsdae, else perceiver); mixed "
            "queries the tokens after the local mixer (needs --local_mixer conv; docs/model.md)"
        },
    )
    concept_num: int | None = field(default=None, metadata={"help": "override the preset's number of concepts"})
    hidden_dropout_prob: float | None = field(
        default=None,
        metadata={
            "help": "override dropout (default: 0 for a fresh Concept Encoder, see DEFAULT_RECIPE; 0.1 for bert)"
        },
    )
    gradient_checkpointing: bool = field(default=False, metadata={"help": "recompute layer activations in backward"})
    token_kv_sharing: str = field(
        default="none",
        metadata={"help": "token keys/values: none (per layer), all (computed once, read by every layer) or groups:K"},
    )
    token_refinement: bool = field(
        default=False,
        metadata={"help": "tokens cross-attend to the concepts in each layer (Luna/BiXT; still O(N·C)); needs "
                  "token_kv_sharing none"},
    )  # fmt: skip
    local_mixer: str = field(
        default="none",
        metadata={"help": f"one of {LOCAL_MIXERS}: conv adds to each token embedding a depthwise convolution of its "
                  "neighbours, then a LayerNorm, once before the first layer (O(N·H·w); docs/model.md)"},
    )  # fmt: skip
    local_mixer_width: int = field(default=3, metadata={"help": "the local mixer's window w, odd (3, 5, ...)"})
    local_mixer_placement: str = field(
        default="first",
        metadata={"help": f"one of {LOCAL_MIXER_PLACEMENTS}: first, the local mixer acts once before the first layer; "
                  "every, each layer has a mixer of its own on the tokens it reads (O(N·H·w) per layer; needs "
                  "--local_mixer conv and --token_kv_sharing none; docs/model.md)"},
    )  # fmt: skip
    extend_positions: str = field(default="no", metadata={"help": EXTEND_HELP})

    def __post_init__(self):
        check_extension(self.extend_positions)
        if self.model_name_or_path is None and self.preset not in PRESETS:
            raise ValueError(f"preset={self.preset!r} is unknown; choose one of {sorted(PRESETS)}")
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture={self.architecture!r} is unknown; choose one of {ARCHITECTURES}")
        if self.decoder_type is not None and self.decoder_type not in DECODER_TYPES:
            raise ValueError(f"decoder_type={self.decoder_type!r} is unknown; choose one of {DECODER_TYPES}")
        if self.concept_num is not None and self.concept_num < 1:
            raise ValueError(f"concept_num={self.concept_num} must be >= 1 (or unset for the preset's)")
        if self.model_name_or_path is None:
            token_kv_groups(self.token_kv_sharing, PRESETS[self.preset]["num_hidden_layers"])
        if problem := token_refinement_problem(self.token_refinement, self.token_kv_sharing):
            raise ValueError(problem)
        if problem := local_mixer_problem(
            self.local_mixer, self.local_mixer_width, self.local_mixer_placement, self.token_kv_sharing
        ):
            raise ValueError(problem)
        if self.model_name_or_path is None and (problem := mixed_decoder_problem(self.decoder_type, self.local_mixer)):
            raise ValueError(problem)  # before any data loads (the config would refuse it only at the model)
        if self.hidden_dropout_prob is not None and not 0 <= self.hidden_dropout_prob < 1:
            raise ValueError(f"hidden_dropout_prob={self.hidden_dropout_prob} must be in [0, 1)")


RUN_NAME_RULE = "a run name is one folder name under --output_dir: letters, digits, '.', '_', '-' (not '.' or '..')"


def run_name_problem(name: str) -> str | None:
    """Why `name` cannot be a run folder's name (it would leave --output_dir, or is no portable folder name)."""
    if name in (".", "..") or not re.fullmatch(r"[A-Za-z0-9._\-]{1,200}", name) or name.startswith("-"):
        return f"cannot be a run folder: {RUN_NAME_RULE}, at most 200 characters, not starting with '-'"
    return None


@dataclass
class TrainingArguments:
    """How to train: steps, optimisation, precision, logging, evaluation, checkpoints, tracking."""

    output_dir: str = field(default="Cache/runs", metadata={"help": "parent of the run directories"})
    run_name: str | None = field(default=None, metadata={"help": "fixed run id (default: preset-size-timestamp)"})
    seed: int = field(default=42, metadata={"help": "seed for init, data order, masking and dropout"})
    max_steps: int = field(default=600, metadata={"help": "optimizer steps to train (the default recipe's budget)"})
    per_device_train_batch_size: int = field(default=16, metadata={"help": "micro-batch per process"})
    per_device_eval_batch_size: int = field(default=32, metadata={"help": "evaluation batch per process"})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "micro-batches per optimizer step"})
    learning_rate: float = field(default=5e-4, metadata={"help": "peak learning rate"})
    weight_decay: float = field(default=0.01, metadata={"help": "AdamW decay (not on biases, norms, embeddings)"})
    adam_beta1: float = 0.9
    adam_beta2: float = 0.98
    adam_epsilon: float = 1e-6
    max_grad_norm: float = field(default=1.0, metadata={"help": "clip the global gradient norm (0 disables)"})
    lr_scheduler_type: str = field(
        default="cosine",
        metadata={"help": f"one of {LR_SCHEDULES} (after the warm-up); wsd: warm-up, stable, then a decay over the "
                  "last --decay_steps steps, extendable while stable (a larger --max_steps on resume)"},
    )  # fmt: skip
    warmup_steps: int = field(default=0, metadata={"help": "linear warmup, in optimizer steps"})
    warmup_ratio: float = field(default=0.06, metadata={"help": "warmup as a fraction of max_steps if warmup_steps=0"})
    decay_steps: int | None = field(
        default=None, metadata={"help": "wsd: the decay's length in optimizer steps, ending at --max_steps"}
    )
    decay_type: str = field(
        default="1-sqrt",
        metadata={"help": f"wsd: the decay's shape, one of {WSD_DECAYS} (1-sqrt: Hägele et al. 2024 found it matches "
                  "cosine runs of the same length)"},
    )  # fmt: skip
    min_lr_ratio: float = field(
        default=0.0, metadata={"help": "wsd and cosine: the rate at the last step as a fraction of the peak"}
    )
    max_time: str | None = field(
        default=None,
        metadata={"help": "wall-clock budget of this invocation, e.g. 2h, 90m, 45s: when it is spent the run stops "
                  "with a checkpoint and its final model, summary.json says why; the schedule still ends at "
                  "--max_steps (resume to go on)"},
    )  # fmt: skip
    tf32: bool = field(
        default=True,
        metadata={"help": "TF32 matmuls and convolutions on GPUs that have them (Ampere and later; "
                  "torch.set_float32_matmul_precision('high')); --no_tf32 or --tf32 false for full fp32"},
    )  # fmt: skip
    mixed_precision: str | None = field(
        default=None,
        metadata={
            "help": "no, bf16 or fp16 (default: the accelerate launch config's, else no; under DeepSpeed set it there)"
        },
    )
    save_dtype: str = field(
        default="float32",
        metadata={"help": "dtype of every model folder the run writes (final/, snapshots, fine-tuned models): float32 "
                  "(the fp32 master weights, whatever --mixed_precision trained), or bfloat16/float16 to halve the "
                  "files (recorded in config.json and the model card)"},
    )  # fmt: skip
    logging_steps: int = field(default=10, metadata={"help": "log train metrics every N optimizer steps"})
    eval_steps: int = field(default=100, metadata={"help": "evaluate every N optimizer steps (0: only at the end)"})
    max_eval_batches: int | None = field(default=None, metadata={"help": "cap evaluation batches per process"})
    save_steps: int = field(default=100, metadata={"help": "checkpoint every N optimizer steps (0: never)"})
    save_total_limit: int = field(default=2, metadata={"help": "keep only the newest N checkpoints"})
    snapshot_steps: str = field(
        default="",
        metadata={"help": "pretraining: comma-separated optimizer steps at which the model is also evaluated and saved "
                  "as <run>/snapshots/step-<N> (save_pretrained + tokenizer), e.g. for a learning curve"},
    )  # fmt: skip
    checkpoint_steps: str = field(
        default="",
        metadata={"help": "comma-separated optimizer steps at which a checkpoint is also saved and kept beyond "
                  "--save_total_limit: points to branch from (the curve's wsd decays) or to go back to"},
    )  # fmt: skip
    resume_from_checkpoint: str | None = field(
        default=None, metadata={"help": "`auto` (newest checkpoint of the run) or a checkpoint folder"}
    )
    max_bad_steps: int = field(default=3, metadata={"help": "stop after this many consecutive non-finite losses"})
    torch_compile: bool = field(default=False, metadata={"help": "torch.compile(model, dynamic=True)"})
    dataloader_num_workers: int = field(
        default=0,
        metadata={"aliases": ["--dataloader_workers"],
                  "help": "DataLoader worker processes (config key: dataloader_num_workers); > 0 also masks each "
                  "window on a background thread while the step before it runs (same masks, exact resume)"},
    )  # fmt: skip
    profile_steps: str = field(
        default="",
        metadata={"help": "pretraining: a:b, torch.profiler trace of optimizer steps a..b (1-based, within max_steps) "
                  "into <run>/profile/ (trace_step<a>-<b>.json for ui.perfetto.dev, ops.txt: the op table)"},
    )  # fmt: skip
    report_to: str = field(default="wandb", metadata={"help": "wandb or none"})
    wandb_project: str = field(default="concept-encoder", metadata={"help": "W&B project"})
    progress_bar: bool = field(default=True, metadata={"help": "tqdm progress bar on the main process"})
    peak_tflops: float | None = field(
        default=None,
        metadata={"help": "one device's peak dense TFLOP/s in the training precision, to log MFU "
                  "(e.g. 989 for an H100/H200 in bf16, 71 for an RTX 3090 in bf16)"},
    )  # fmt: skip
    concept_losses: str | None = field(
        default=None,
        metadata={"help": f"comma-separated concept regularisers from {CONCEPT_LOSS_NAMES}, or none "
                  "(default: DEFAULT_RECIPE's for a Concept Encoder, none for bert)"},
    )  # fmt: skip
    loss_weighting: str = field(
        default="fixed", metadata={"help": f"how the losses are weighted: one of {LOSS_WEIGHTING_NAMES}"}
    )
    concept_loss_weight: float = field(default=1.0, metadata={"help": "fixed weighting: weight of each concept loss"})
    concept_loss_warmup_steps: int | None = field(
        default=None,
        metadata={"help": "fixed weighting: linear warm-up of the concept weights from 0, in optimizer steps "
                  "(default: DEFAULT_RECIPE's for a Concept Encoder with fixed weighting, else 0)"},
    )  # fmt: skip
    cuda_memory_budget_gb: float | None = field(
        default=None, metadata={"help": "cap this process's CUDA memory (e.g. 10 to emulate an RTX 3080)"}
    )
    allow_cpu: bool = field(
        default=False,
        metadata={"help": "train on the CPU even where the NVIDIA driver sees a GPU this torch cannot use (a CPU "
                  "wheel, or one built for a newer CUDA than the driver runs): refused without it"},
    )  # fmt: skip
    objective: str = field(
        default="mlm",
        metadata={"help": f"pretraining objective: one of {OBJECTIVES} (concept_encoder.data.objectives)"},
    )
    recipe: str = field(
        default="default",
        metadata={"help": "pretraining recipe: default, or budget (the small-budget recipe of Cramming and the "
                  "academic-budget BERT, RECIPES: rate 1e-3 decayed linearly to 0 at the last step after a warm-up "
                  "of 0.06 of the steps, masking rate 0.25, no dropout); flags and --config values given beside it "
                  "win"},
    )  # fmt: skip
    t_min: float = field(default=0.1, metadata={"help": "diffusion: masking rates t ~ U(t_min, 1), 0 < t_min < 1"})
    diffusion_weighting: str = field(
        default="elbo", metadata={"help": f"diffusion: {DIFFUSION_WEIGHTINGS}; elbo weights each masked token by 1/t"}
    )
    deletion_rate: float = field(
        default=0.6, metadata={"help": "tsdae: fraction of each sample's tokens deleted from the encoder's view"}
    )
    teacher: str | None = field(
        default=None,
        metadata={"help": "distill: the teacher, a local model folder (e.g. Cache/models/all-MiniLM-L6-v2 from make "
                  "reference) whose mean-pooled last hidden states the pooled student learns (training/distill.py)"},
    )  # fmt: skip
    distill_loss: str = field(
        default="cosine", metadata={"help": f"distill: one of {DISTILL_LOSSES} (1 - cosine, or mean squared error)"}
    )
    distill_weight: float = field(default=1.0, metadata={"help": "distill: weight of the distillation loss"})
    mlm_weight: float = field(
        default=1.0, metadata={"help": "distill: weight of the MLM loss beside it (0: distillation alone)"}
    )
    teacher_embedding_init: bool = field(
        default=False,
        metadata={"help": "distill: start the student's word embeddings from the teacher's, projected to its width "
                  "(needs the teacher's vocabulary: --tokenizer <teacher folder>)"},
    )  # fmt: skip
    gate: list[str] = field(
        default_factory=list,
        metadata={"help": 'decision gate "metric>=threshold@step", checked at every evaluation from that step '
                  "(repeatable; a list in --config); metric: any key the loop evaluates (eval_loss, health/...)"},
    )  # fmt: skip
    gate_action: str = field(
        default="stop",
        metadata={"help": f"on a failed gate: {GATE_ACTIONS[0]} (checkpoint, final model, exit code "
                  f"{GATE_EXIT_CODE}) or {GATE_ACTIONS[1]} (log it and go on)"},
    )  # fmt: skip

    def __post_init__(self):
        for name in (
            "max_steps",
            "per_device_train_batch_size",
            "per_device_eval_batch_size",
            "gradient_accumulation_steps",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("logging_steps",):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("eval_steps", "save_steps", "warmup_steps", "save_total_limit", "dataloader_num_workers"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.mixed_precision not in (None, "no", "bf16", "fp16"):
            raise ValueError(f"mixed_precision={self.mixed_precision!r}: choose no, bf16 or fp16")
        if self.save_dtype not in SAVE_DTYPES:
            raise ValueError(f"save_dtype={self.save_dtype!r}: choose one of {', '.join(SAVE_DTYPES)}")
        check_schedule(self)
        if self.max_time is not None:
            parse_duration(self.max_time, "max_time")
        if self.report_to not in ("wandb", "none"):
            raise ValueError(f"report_to={self.report_to!r}: choose wandb or none")
        if not 0 <= self.warmup_ratio < 1:
            raise ValueError(f"warmup_ratio={self.warmup_ratio} must be in [0, 1)")
        if self.peak_tflops is not None and self.peak_tflops <= 0:
            raise ValueError(f"peak_tflops={self.peak_tflops} must be > 0 (or left unset to skip MFU)")
        for name in ("learning_rate", "adam_epsilon"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0")
        for name in ("weight_decay", "max_grad_norm"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be in [0, 1)")
        if self.max_bad_steps < 1:
            raise ValueError(f"max_bad_steps={self.max_bad_steps} must be >= 1")
        if self.max_eval_batches is not None and self.max_eval_batches < 1:
            raise ValueError(f"max_eval_batches={self.max_eval_batches} must be >= 1 (or unset for all)")
        if self.cuda_memory_budget_gb is not None and self.cuda_memory_budget_gb <= 0:
            raise ValueError(f"cuda_memory_budget_gb={self.cuda_memory_budget_gb} must be > 0 (or unset)")
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective={self.objective!r} is unknown; choose one of {OBJECTIVES}")
        if self.recipe not in RECIPES:
            raise ValueError(f"recipe={self.recipe!r} is unknown; choose one of {sorted(RECIPES)}")
        if not 0 < self.t_min < 1:
            raise ValueError(f"t_min={self.t_min} must be in (0, 1): diffusion draws masking rates t ~ U(t_min, 1)")
        if self.diffusion_weighting not in DIFFUSION_WEIGHTINGS:
            raise ValueError(f"diffusion_weighting={self.diffusion_weighting!r}: choose one of {DIFFUSION_WEIGHTINGS}")
        if self.distill_loss not in DISTILL_LOSSES:
            raise ValueError(f"distill_loss={self.distill_loss!r} is unknown; choose one of {DISTILL_LOSSES}")
        if not self.distill_weight > 0 or self.mlm_weight < 0:
            raise ValueError(
                f"distill_weight={self.distill_weight} must be > 0 and mlm_weight={self.mlm_weight} >= 0 (0: "
                "distillation alone)"
            )
        if not 0 <= self.deletion_rate < 1:
            raise ValueError(f"deletion_rate={self.deletion_rate} must be in [0, 1): tsdae must keep some tokens")
        if self.gate_action not in GATE_ACTIONS:
            raise ValueError(f"gate_action={self.gate_action!r}: choose one of {GATE_ACTIONS}")
        if self.run_name is not None and (problem := run_name_problem(self.run_name)):
            raise ValueError(f"run_name={self.run_name!r} {problem}")
        if any(not 0 < step <= self.max_steps for step in step_list(self.checkpoint_steps, "checkpoint_steps")):
            raise ValueError(
                f"checkpoint_steps={self.checkpoint_steps!r}: every step must be in 1..max_steps ({self.max_steps})"
            )
        profile_range(self.profile_steps, self.max_steps)  # a malformed or out-of-range a:b fails here
        steps = self.snapshot_step_list  # parses, so a malformed list fails here
        if any(not 0 < step <= self.max_steps for step in steps):
            raise ValueError(
                f"snapshot_steps={self.snapshot_steps!r}: every step must be in 1..max_steps ({self.max_steps})"
            )
        self.gates = parse_gates(self.gate)  # syntax here; metric names where the loop's metrics are known
        check_concept_loss_settings(
            self.concept_loss_names, self.loss_weighting, self.concept_loss_weight, self.concept_loss_warmup_steps or 0
        )

    @property
    def concept_loss_names(self) -> list[str]:
        if self.concept_losses in (None, "none"):
            return []
        return [name.strip() for name in self.concept_losses.split(",") if name.strip()]

    @property
    def snapshot_step_list(self) -> list[int]:
        return step_list(self.snapshot_steps, "snapshot_steps")

    @property
    def checkpoint_step_list(self) -> list[int]:
        return step_list(self.checkpoint_steps, "checkpoint_steps")

    @property
    def profile_step_range(self) -> tuple[int, int] | None:
        return profile_range(self.profile_steps, self.max_steps)

    @property
    def num_warmup_steps(self) -> int:
        return self.warmup_steps or int(self.warmup_ratio * self.max_steps)

    @property
    def schedule(self) -> dict:
        """The learning-rate schedule as the steps see it (`optim.scheduler_for` builds it): a run trained
        further (a larger `max_steps` on resume) is the run a longer plan would have been only where both give the
        same rates up to the checkpoint (`optim.schedule_problem`): a constant rate after a warm-up given in
        steps, or wsd in its stable phase; cosine and linear decay to their own last step."""
        decays = self.lr_scheduler_type != "constant"
        wsd = (
            {"decay_steps": self.decay_steps, "decay_type": self.decay_type} if self.lr_scheduler_type == "wsd" else {}
        )
        floor = {"min_lr_ratio": self.min_lr_ratio} if self.min_lr_ratio else {}
        return {"lr_scheduler_type": self.lr_scheduler_type, "warmup_steps": self.num_warmup_steps,
                "decays_to_step": self.max_steps if decays else None, **wsd, **floor}  # fmt: skip

    @property
    def max_time_s(self) -> float | None:
        return None if self.max_time is None else parse_duration(self.max_time, "max_time")


DEFAULT_LEARNING_RATES = "5e-5,1e-4,3e-4,1e-3"  # the dev split picks one per model (BERT's paper used a grid too)
PER_SEED = "{seed}"  # in a model path: each fine-tuning seed starts from its own model (`seed_model`)


def seed_model(path: str, seed: int) -> str:
    """The model folder fine-tuning seed `seed` starts from: `path` with `{seed}` replaced by the seed (a curriculum:
    each seed continues its own run of an earlier stage, `<run>-seed{seed}/final`); a path without it, as given."""
    return path.replace(PER_SEED, str(seed))


POOLINGS = ("auto", *CLASSIFIER_POOLINGS)  # auto: the model's own; the others where the model has that choice


@dataclass
class FinetuneArguments:
    """Which model to fine-tune (`loops/finetune.py`), how often, and what to put beside it."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "a save_pretrained folder: a Concept Encoder run's final/ or any HF encoder; {seed} in it "
                  "(e.g. Cache/finetune/<run>-seed{seed}/final): each seed starts from its own model"},
    )  # fmt: skip
    from_scratch: bool = field(
        default=False, metadata={"help": "same architecture, random weights: the control for pretraining"}
    )
    seeds: int = field(default=3, metadata={"help": "fine-tuning runs per model (seeds seed, seed+1, ...)"})
    compare_to: str | None = field(
        default=None,
        metadata={
            "help": "comma-separated further model folders ({seed} as in --model_name_or_path), fine-tuned "
            "under the same protocol"
        },
    )
    learning_rates: str = field(
        default=DEFAULT_LEARNING_RATES,
        metadata={"help": "comma-separated peak learning rates: each model is trained at each (first seed), the "
                  "rate with the best dev metric is used for all its seeds; one value for a fixed rate"},
    )  # fmt: skip
    epochs: float | None = field(
        default=None, metadata={"help": "training length in passes over the training split (replaces --max_steps)"}
    )
    pooling: str = field(
        default="auto",
        metadata={"help": f"one of {POOLINGS}: the model's own (auto); a Concept Encoder: mean/weighted over its "
                  "concepts, or cls (the [CLS] token, with token_refinement); a Hugging Face encoder: cls, or mean "
                  "(its mean token state into its pooler)"},
    )  # fmt: skip
    probe: bool = field(
        default=False,
        metadata={
            "help": "also fit a linear probe (LogisticRegression, C chosen on dev) on each model's frozen features"
        },
    )
    finetune: bool = field(default=True, metadata={"help": "fine-tune (false with --probe: probe only, make probe)"})
    report_dir: str = field(default="Cache/reports", metadata={"help": "where finetune_<time>.{md,json,png} go"})
    tokenizer: str | None = field(
        default=None,
        metadata={"help": "tokenizer folder for model folders saved without one (save_pretrained of a model alone)"},
    )
    extend_positions: str = field(default="no", metadata={"help": EXTEND_HELP})
    bucket_by_length: bool = field(
        default=False,
        metadata={"help": "training batches of similar lengths (seeded, resumable; training/batches.py): inputs of "
                  "mixed lengths are then barely padded"},
    )  # fmt: skip
    pad_to_multiple_of: int | None = pad_multiple_field(
        "pad each batch's length up to a multiple of this (transformers' DataCollatorWithPadding): fewer distinct "
        "shapes for inputs of many lengths (CPU convolution buffers, GPU kernels, torch.compile); refused where it "
        "would pad past the model's positions"
    )
    report_last_step: bool = field(
        default=False,
        metadata={"help": "also save each run's last step and report its validation metrics beside the dev-chosen "
                  "step's (a run that peaks then collapses shows it)"},
    )  # fmt: skip
    stop_at_dev: float | None = field(
        default=None,
        metadata={"help": "stop a run once its main dev metric reaches this value (e.g. 1.0 for accuracy: no later "
                  "step can beat it on dev); that step is the run's chosen step. Saves the rest of a long schedule "
                  "for runs that solve their task early (associative recall's jump)"},
    )  # fmt: skip
    chunk_length: int | None = field(
        default=None,
        metadata={"help": "token encoders: read inputs in chunks of this many tokens, each encoded alone, their mean "
                  "token states averaged (the chunked BERT baseline of long documents; finetuning/chunked.py)"},
    )  # fmt: skip

    def __post_init__(self):
        check_extension(self.extend_positions)
        if self.chunk_length is not None and self.chunk_length < 2:
            raise ValueError(f"chunk_length={self.chunk_length} must be >= 2 (or unset to read inputs whole)")
        if self.seeds < 1:
            raise ValueError(f"seeds={self.seeds} must be >= 1")
        check_pad_multiple(self.pad_to_multiple_of)
        if self.stop_at_dev is not None and not math.isfinite(self.stop_at_dev):
            raise ValueError(f"stop_at_dev={self.stop_at_dev} must be a finite number (or unset to run every step)")
        if self.model_name_or_path is None:
            raise ValueError("--model_name_or_path is required: a saved model folder such as Cache/runs/<run>/final")
        rates = self.rates  # parses, so a malformed grid fails here
        if not rates or any(not 0 < r < 1 for r in rates) or len(set(rates)) != len(rates):
            raise ValueError(
                f"learning_rates={self.learning_rates!r}: give distinct rates in (0, 1), comma-separated, "
                f"e.g. {DEFAULT_LEARNING_RATES}"
            )
        if self.epochs is not None and not self.epochs > 0:
            raise ValueError(f"epochs={self.epochs} must be > 0 (or unset to train --max_steps steps)")
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling={self.pooling!r} is unknown; choose one of {POOLINGS}")
        if not (self.finetune or self.probe):
            raise ValueError("--finetune false leaves nothing to do: add --probe (a probe-only run), or drop it")

    @property
    def rates(self) -> list[float]:
        try:
            return [float(r) for r in self.learning_rates.split(",") if r.strip()]
        except ValueError:
            raise ValueError(
                f"learning_rates={self.learning_rates!r} is not a comma-separated list of numbers, e.g. "
                f"{DEFAULT_LEARNING_RATES}"
            ) from None

    @property
    def models(self) -> list[str]:
        """The model paths as given (`{seed}` kept: `seed_folders` gives the folders)."""
        return [self.model_name_or_path, *[m.strip() for m in (self.compare_to or "").split(",") if m.strip()]]

    def seed_folders(self, path: str, first_seed: int) -> list[str]:
        """The folders `path` names for this invocation's seeds (`first_seed` on): one per seed with `{seed}` in
        it, else `path` alone."""
        return list(dict.fromkeys(seed_model(path, seed) for seed in range(first_seed, first_seed + self.seeds)))

    def per_folder(self, first_seed: int) -> list[FinetuneArguments]:
        """These arguments once per model folder they name (each model's, each seed's where a path holds `{seed}`),
        as `model_name_or_path`: what `preflight` checks one at a time."""
        folders = [folder for path in self.models for folder in self.seed_folders(path, first_seed)]
        return [dataclasses.replace(self, model_name_or_path=folder) for folder in folders]


# What a fresh Concept Encoder pretrains with unless told otherwise: the configuration of the decision table
# (docs/results.md) that kept the concepts healthy (effective rank 0.99 of 64 at 1.3M tokens, where plain
# MLM, diffusion and TSDAE collapsed to 0.03-0.06) at the same masked-token loss, with the concept losses
# warmed up over the first 100 steps: the recipe ablation (600 steps, 3 seeds) found it learns
# held-out English better (2.50x the unigram baseline against 2.29x without, higher on each seed; held-out
# loss 8.36 against 8.53) and stays healthy (0.989 of full rank). `--concept_losses none` gives plain MLM.
DEFAULT_RECIPE = {
    "concept_losses": "orthogonality,uniformity",
    "concept_loss_warmup_steps": 100,
    "hidden_dropout_prob": 0.0,
}

# `--recipe budget`: what the small-budget literature found pays when compute is short. Cramming (Geiping &
# Goldstein 2022: peak rate 1e-3, decayed to zero over the budget, no dropout, 25% masking, length 128) and the
# academic-budget BERT (Izsak et al. 2021: rate 1e-3, 6% warm-up, linear decay to zero). The values are argument
# defaults under the recipe (a flag or --config value given beside it wins); dropout 0 also for BERT, in
# `check_pretraining_combination` (a model folder keeps its own). A decaying schedule ends at the run's own last
# step: a learning curve under it measures each budget as a run of its own (one --tokens per curve).
RECIPES = {
    "default": {},
    "budget": {"learning_rate": 1e-3, "lr_scheduler_type": "linear", "warmup_ratio": 0.06, "mlm_probability": 0.25},
}


# What a saved model's config.json decides when a run starts from it: given beside --model_name_or_path they
# would be ignored while the run's config.json recorded them.
FOLDER_DECIDES = ("preset", "concept_num", "decoder_type", "hidden_dropout_prob", "token_kv_sharing",
                  "token_refinement", "local_mixer", "local_mixer_width", "local_mixer_placement")  # fmt: skip


def check_task_sources(dataset: str) -> None:
    """Each `task:<name>` of a `--dataset` mixture names a task fine-tuning knows, or an existing local task file
    or folder (ValueError naming it), before anything loads."""
    if not is_mixture(dataset):
        return
    for part in parse_mixture(dataset):
        if part.task is None:
            continue
        TaskArguments(task=part.task)  # its own rules: needle:<words>, glue:<name>
        known = (
            part.task in (*EMBEDDED_TASKS, MODULES_PACKAGE, MODULES_SPLICED)
            or part.task.startswith((NEEDLE_PREFIX, "glue:"))
            or is_listops(part.task)
            or is_recall(part.task)
        )
        if not known and not Path(part.task).expanduser().exists():
            raise ValueError(
                f"dataset={dataset!r}: {TASK_SOURCE}{part.task} is no task: use {TASK_SOURCE}<one of "
                f"{[*EMBEDDED_TASKS, *LONG_TASKS, *LISTOPS_TASKS, *RECALL_TASKS]}>, {TASK_SOURCE}glue:<name> or {TASK_SOURCE}<local task file or folder>"
            )


DISTILL_ONLY = ("teacher", "distill_loss", "distill_weight", "mlm_weight", "teacher_embedding_init")


def check_distillation(data_args: DataArguments, args: TrainingArguments) -> None:
    """`--objective distill` needs a local teacher folder and one document or sentence per example; its settings
    mean nothing under another objective (ValueError naming the fix)."""
    given = [
        f"--{name}"
        for name in DISTILL_ONLY
        if getattr(args, name) != TrainingArguments.__dataclass_fields__[name].default
    ]
    if args.objective != "distill":
        if given:
            raise ValueError(f"{given} apply to --objective distill only: add it, or leave them out")
        return
    if args.teacher is None:
        raise ValueError(
            "--objective distill needs --teacher <model folder>, e.g. Cache/models/all-MiniLM-L6-v2 (make reference)"
        )
    if problem := model_folder_problem(cache_path(args.teacher).expanduser()):  # format and config, in a second
        raise ValueError(
            f"--teacher: {problem}; a teacher is never downloaded: e.g. Cache/models/all-MiniLM-L6-v2 from make "
            "reference"
        )
    if data_args.packing:
        raise ValueError(
            "--objective distill learns one teacher embedding per document or sentence: add --packing false (a "
            "packed block glues several documents together)"
        )
    if data_args.streaming:
        raise ValueError("--objective distill embeds every document with the teacher first: leave out --streaming")


def check_overridden(args: TrainingArguments) -> None:
    """A setting given beside the one that overrides it is refused (ValueError naming both), not silently
    unused: `--warmup_ratio` applies only while `--warmup_steps` is 0. Defaults (a recipe's, the fine-tuning
    loop's) are not choices, so only a flag or `--config` key counts (`given_fields`)."""
    if args.warmup_steps > 0 and "warmup_ratio" in given_fields(args):
        raise ValueError(
            f"--warmup_ratio {args.warmup_ratio:g} is ignored beside --warmup_steps {args.warmup_steps} (the steps "
            "win): give one of them"
        )


def check_pretraining_combination(model_args: ModelArguments, data_args: DataArguments, args: TrainingArguments):
    """The pretraining set's rules between the model and the objective (ValueError naming the conflict and the
    fix); resolves the defaults that depend on them: the decoder (`posonly` for tsdae, `perceiver` otherwise), and
    for a Concept Encoder the concept losses and dropout of `DEFAULT_RECIPE`. The tasks a `--dataset` mixture
    reads must exist; distillation's settings (`check_distillation`)."""
    check_task_sources(data_args.dataset)
    check_distillation(data_args, args)
    check_overridden(args)
    if args.recipe == "budget" and model_args.model_name_or_path is None and model_args.hidden_dropout_prob is None:
        resolve_default(model_args, "hidden_dropout_prob", 0.0)  # no dropout, BERT too (see RECIPES)
    if model_args.model_name_or_path is not None:  # the folder's config.json decides the model's shape
        shaped = [f"--{name}" for name in FOLDER_DECIDES
                  if getattr(model_args, name) != ModelArguments.__dataclass_fields__[name].default]  # fmt: skip
        if shaped:
            raise ValueError(
                f"{shaped} shape a fresh model; --model_name_or_path {model_args.model_name_or_path} has its own "
                "shape (its config.json): leave them out"
            )
        resolve_default(model_args, "preset", None)  # recorded as no preset, not the unused default
    if model_args.architecture == "bert":
        parse_gates(args.gate, pretraining_metric_names(args.objective, "bert"), "loops/mlm.py with bert")
        if args.concept_losses is None:
            resolve_default(args, "concept_losses", "none")
        if args.concept_loss_warmup_steps is None:
            resolve_default(args, "concept_loss_warmup_steps", 0)
        if args.objective == "tsdae":
            raise ValueError(
                "--objective tsdae needs a bottleneck to reconstruct through; --architecture bert has none "
                "(each token's state would simply copy it): use --objective mlm or diffusion with bert"
            )
        if args.concept_loss_names:
            raise ValueError("--concept_losses act on concepts; --architecture bert has none: drop --concept_losses")
        if model_args.model_name_or_path is None and model_args.decoder_type is not None:
            raise ValueError("--decoder_type applies to --architecture concept only: drop it for bert")
        if model_args.concept_num is not None or model_args.token_kv_sharing != "none":
            raise ValueError(
                "--concept_num and --token_kv_sharing apply to --architecture concept only: drop them for bert"
            )
        if model_args.local_mixer != "none" or model_args.local_mixer_placement != "first":
            raise ValueError(
                "--local_mixer and --local_mixer_placement apply to --architecture concept only: drop them for bert"
            )
        return
    if args.objective == "tsdae" and model_args.decoder_type in TOKEN_QUERY_DECODERS:
        raise ValueError(
            f"--objective tsdae with --decoder_type {model_args.decoder_type} would hand the decoder the deleted "
            "tokens it must reconstruct (its queries are the input tokens): use --decoder_type posonly (the "
            "default) or weighted"
        )
    parse_gates(args.gate, pretraining_metric_names(args.objective, model_args.architecture), "loops/mlm.py")
    if args.concept_losses is None:
        resolve_default(args, "concept_losses", DEFAULT_RECIPE["concept_losses"])
    if args.concept_loss_warmup_steps is None:  # a warm-up applies to fixed weights of concept losses only
        recipe = args.loss_weighting == "fixed" and args.concept_loss_names
        resolve_default(args, "concept_loss_warmup_steps", DEFAULT_RECIPE["concept_loss_warmup_steps"] if recipe else 0)
    if model_args.model_name_or_path is None:
        if model_args.decoder_type is None:
            resolve_default(model_args, "decoder_type", "posonly" if args.objective == "tsdae" else "perceiver")
        if model_args.hidden_dropout_prob is None:
            resolve_default(model_args, "hidden_dropout_prob", DEFAULT_RECIPE["hidden_dropout_prob"])


# Training arguments only pretraining reads: fine-tuning refuses any of them set, instead of ignoring it while the
# run's config.json records it (a fine-tuning run that claims a diffusion objective).
PRETRAINING_ONLY = (*DISTILL_ONLY, "objective", "recipe", "t_min", "diffusion_weighting", "deletion_rate", "concept_losses", "loss_weighting",
                    "concept_loss_weight", "concept_loss_warmup_steps", "snapshot_steps", "max_time", "checkpoint_steps",
                    "profile_steps")  # fmt: skip


def check_finetune_combination(finetune_args: FinetuneArguments, task_args: TaskArguments, args: TrainingArguments):
    """The fine-tuning set's rules: no pretraining-only setting, gates name dev-split metrics, and the learning
    rate comes from one flag."""
    given = [
        f"--{name}"
        for name in PRETRAINING_ONLY
        if getattr(args, name) != TrainingArguments.__dataclass_fields__[name].default
    ]
    if given:  # pretraining settings: an error, not a silently ignored flag
        raise ValueError(f"loops/finetune.py does not support {given} (they are for pretraining)")
    check_overridden(args)
    parse_gates(args.gate, TASK_METRIC_NAMES, "loops/finetune.py (dev split)")
    if args.learning_rate != FINETUNE_DEFAULTS["learning_rate"]:  # one flag for the rate, not two
        raise ValueError(
            f"loops/finetune.py chooses the learning rate on the dev split from --learning_rates; give "
            f"--learning_rates {args.learning_rate:g} for one fixed rate instead of --learning_rate"
        )


REPEATABLE_FLAGS = ("--gate",)  # `--gate a --gate b` means `--gate a b`
ARGUMENT_CLASSES = ArgumentSet(
    (ModelArguments, DataArguments, TrainingArguments), check_pretraining_combination, REPEATABLE_FLAGS
)
# Fine-tuning shares the optimisation, logging and run settings; its defaults suit a small labelled set.
FINETUNE_ARGUMENT_CLASSES = ArgumentSet(
    (FinetuneArguments, TaskArguments, TrainingArguments), check_finetune_combination, REPEATABLE_FLAGS
)
FINETUNE_DEFAULTS = {
    "output_dir": "Cache/finetune", "learning_rate": 1e-4, "per_device_train_batch_size": 32, "max_steps": 300, "eval_steps": 25,
    "save_steps": 0, "logging_steps": 10, "lr_scheduler_type": "linear", "warmup_ratio": 0.1,
}  # fmt: skip


def recipe_named(argv: list[str]) -> str | None:
    """The `--recipe` of `argv`, or of its `--config` file; None when neither names one (an unknown name is
    `TrainingArguments`' error)."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--recipe")
    pre.add_argument("--config")
    known, _ = pre.parse_known_args(argv)
    if known.recipe is None and known.config:
        return read_yaml_mapping(known.config, "--config").get("recipe")
    return known.recipe


def parse_args(argv: list[str] | None = None, classes=ARGUMENT_CLASSES, defaults: dict | None = None) -> tuple:
    """Parse `argv` (default `sys.argv[1:]`) into one instance of each dataclass in `classes` (`ARGUMENT_CLASSES`
    for pretraining, `FINETUNE_ARGUMENT_CLASSES` for fine-tuning; each set checks its own rules): see
    `parse_dataclasses` for the precedence of defaults, `defaults` (e.g. a hardware profile's), `--config` and
    flags. `Cache/...` output folders then mean the project's `Cache/`, wherever the command starts. A `--recipe`
    (flag or --config key) sets its `RECIPES` values as defaults, above a profile's, below --config and flags."""
    argv = list(sys.argv[1:] if argv is None else argv)
    recipe = RECIPES.get(recipe_named(argv)) if classes is ARGUMENT_CLASSES else None
    parsed = parse_dataclasses(argv, classes, {**(defaults or {}), **(recipe or {})})
    if recipe:
        imply_defaults(parsed, recipe)
    for instance in parsed:  # `Cache/...` means the project's Cache/, wherever the command starts (paths.py)
        for name in ("output_dir", "report_dir", "teacher"):
            value = getattr(instance, name, None)
            if isinstance(value, str) and (resolved := str(cache_path(value))) != value:
                default = field_default(next(f for f in fields(instance) if f.name == name))
                (resolve_default if value == default else setattr)(instance, name, resolved)
    return parsed
