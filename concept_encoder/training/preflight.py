"""Preflight: what can be checked from the arguments fails here, before the data and the model are built
(types and ranges are already checked by the argument dataclasses).

Torch-free: `fail_fast` runs it from `loops/mlm.py` before torch and transformers' models are imported
(about 4 s on a 2-core machine), so a bad argument is one line in about a second; the loop's step 4
runs it again with the device it really got.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
from pathlib import Path

from ..accounting.architectures import readable_positions
from ..accounting.memory import GIB, estimate_training_memory, zero_settings
from ..checkpoints.checkpoint import resolve_resume
from ..checkpoints.model_folder import model_folder_problem
from ..common.faults import DiskFullError, RunFolderError
from ..common.padding import padded_length
from ..common.paths import cache_path, folder_problem
from ..data.base import DataSourceError
from ..data.mixture import TASK_SOURCE, is_mixture, parse_mixture
from ..machine.checks import nvme_offload_problem, unseen_gpu_problem
from ..machine.extension_locks import StaleLockError, stale_lock_message, stale_op_locks
from ..tasks.arguments import is_listops, is_recall
from .args import ARGUMENT_CLASSES, parse_args
from .plan import (
    decoded_fraction,
    ds_config_problems,
    foreign_run_folder,
    fresh_model_fields,
    launched_ds_config,
    output_dir_problem,
    zero3_compile_problem,
)


def effective_precision(mixed_precision: str | None) -> str:
    """`--mixed_precision`, else the one `accelerate launch` passes on (its config or flag), else no."""
    return mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION") or "no"


def cuda_present() -> bool:
    """Whether this process can see an NVIDIA GPU, without importing torch (driver present, not hidden)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return Path("/proc/driver/nvidia/version").exists() or shutil.which("nvidia-smi") is not None


def preflight(model_args, data_args, training_args, cuda: bool) -> None:
    """ValueError naming the first argument this run cannot work with (`cuda`: a GPU is in use; among them a
    `--profile_steps` folder that cannot be written, a fixed-vocabulary tokenizer on text it cannot read), or what this
    machine lacks for it (`machine.checks`: a GPU torch cannot use, unless --allow_cpu; libaio or nvcc for NVMe
    offload), or `StaleLockError` when the launch offloads the optimizer and a stale CPU Adam build lock would hang it.

    `model_args` needs `model_name_or_path`, `data_args` `max_seq_length` (both loops' arguments have them).
    """
    if problem := output_dir_problem(training_args.output_dir):
        raise ValueError(f"{problem}; choose another --output_dir")
    if training_args.run_name and (
        problem := foreign_run_folder(Path(training_args.output_dir) / training_args.run_name)
    ):
        raise RunFolderError(problem)  # someone's own folder: before any data or model is built
    if problem := folder_problem(cache_path("Cache"), "the cache folder (tokenizers, datasets, logs, reports)"):
        raise ValueError(f"{problem}; run from a folder whose Cache/ can be written, or make it writable")
    if problem := profile_folder_problem(training_args):
        raise ValueError(problem)
    if problem := fixed_vocabulary_problem(getattr(data_args, "dataset", None), getattr(data_args, "tokenizer", None)):
        raise ValueError(problem)
    if not cuda and not training_args.allow_cpu and (problem := unseen_gpu_problem()):
        raise ValueError(problem)  # before the CPU's own refusals: their cause is the torch this machine has
    if effective_precision(training_args.mixed_precision) == "fp16" and not cuda:
        raise ValueError(
            "mixed precision fp16 needs a CUDA GPU and this run is on the CPU; "
            "use --mixed_precision bf16 (supported on CPU) or no"
        )
    if (ds_config := launched_ds_config()) and (problems := ds_config_problems(ds_config)):
        raise ValueError(f"the DeepSpeed config of this launch is out of range: {'; '.join(problems)}")
    for problem in (zero3_compile_problem(training_args, ds_config), nvme_offload_problem(ds_config, cuda)):
        if problem:
            raise ValueError("; ".join(problem))
    if zero_settings(ds_config)[1] and (stale := stale_op_locks("cpu_adam")):
        raise StaleLockError(stale_lock_message("cpu_adam", stale))  # the optimizer would wait on it forever
    config = None  # the saved model's config.json, read once for the checks below
    if model_args.model_name_or_path:
        if problem := model_folder_problem(model_args.model_name_or_path, weights=False):
            raise ValueError(f"--model_name_or_path: {problem}")
        config = json.loads((Path(model_args.model_name_or_path) / "config.json").read_text())
        positions = readable_positions(config)  # roberta-base's 514 rows read 512 tokens
        whole = not getattr(model_args, "chunk_length", None)  # chunks: checked against the table by chunk_problem
        extend = getattr(model_args, "extend_positions", "no") != "no"
        if whole and positions is not None and data_args.max_seq_length > positions and not extend:
            raise ValueError(beyond_positions(data_args.max_seq_length, positions, config))
        multiple = getattr(data_args, "pad_to_multiple_of", None) or getattr(model_args, "pad_to_multiple_of", None)
        readable = max(positions, data_args.max_seq_length) if extend and positions is not None else positions
        # a random twin: its table is built to the padded length, and it needs the config only (no weights)
        fresh = getattr(model_args, "from_scratch", False)
        padded = padded_length(data_args.max_seq_length, multiple)
        if whole and readable is not None and not fresh and padded > readable:
            raise ValueError(padded_beyond_positions(data_args.max_seq_length, multiple, readable))
        if not fresh and (problem := model_folder_problem(model_args.model_name_or_path)):
            raise ValueError(f"--model_name_or_path: {problem}")
    if not cuda and (problem := host_memory_problem(model_args, data_args, training_args, config)):
        raise ValueError(problem)


def profile_folder_problem(training_args) -> str | None:
    """Why `--profile_steps`' trace could not be written into `<run>/profile/` (a file in the way, a folder that is
    not writable), else None: found now, not after the profiled steps were trained. The run folder is known when
    --run_name or a checkpoint folder names it; a new run's folder is a fresh one under --output_dir, checked above."""
    if not getattr(training_args, "profile_steps", ""):
        return None
    resume = training_args.resume_from_checkpoint
    if resume not in (None, "auto"):  # a run folder, or one of its checkpoints (as `checkpoint.resolve_resume`)
        path = Path(resume).expanduser()
        run = path if (path / "checkpoints").is_dir() else path.parent.parent
    elif training_args.run_name:
        run = Path(training_args.output_dir) / training_args.run_name
    else:
        return None
    if problem := folder_problem(run / "profile", f"--profile_steps {training_args.profile_steps}: the profile folder"):
        return f"{problem}; free that path, or choose another --output_dir or --run_name"
    return None


# The fixed vocabularies of `--tokenizer` (data/tokenizer.py `fixed_vocabulary`) and the generated task each is
# made for: any other text reads as [UNK], which is never masked.
FIXED_VOCABULARY_TASKS = {"listops": is_listops, "recall": is_recall}


def fixed_vocabulary_problem(dataset: str | None, tokenizer: str | None) -> str | None:
    """Why a fixed-vocabulary `--tokenizer` (listops, recall) cannot serve `--dataset`, else None: a source that is
    neither that task's text (`task:listops...`) nor a local file (which may hold such text) is natural text, which
    it reads as all [UNK]; nothing is then maskable and every step's loss is NaN (0 masked tokens). Decided from
    the arguments alone, before any data is read; `maskable_problem` checks the tokenized data itself."""
    kind = (tokenizer or "").split(":")[0]
    if dataset is None or kind not in FIXED_VOCABULARY_TASKS:
        return None
    parts = [part.spec for part in parse_mixture(dataset)] if is_mixture(dataset) else [dataset]
    for spec in parts:
        if not (FIXED_VOCABULARY_TASKS[kind](spec.removeprefix(TASK_SOURCE)) or Path(spec).expanduser().exists()):
            return (
                f"--tokenizer {tokenizer} knows only the symbols of {kind} tasks: --dataset source {spec!r} would "
                f"tokenize to [UNK], leaving nothing to mask (a NaN loss at every step); train on {TASK_SOURCE}{kind}"
                "... or give a tokenizer for text, e.g. --tokenizer train:wordpiece:8000"
            )
    return None


MIN_MASKABLE_SHARE = 0.05  # below this share of maskable tokens a run masks next to nothing, often nothing at all
MAX_UNKNOWN_SHARE = 0.5  # a tokenizer that reads most of the text as [UNK] is not this text's tokenizer


def maskable_problem(tokenizer, examples, flag: str = "--tokenizer") -> str | None:
    """Why `tokenizer` cannot serve a masking objective on `examples` (token id lists, e.g. the first hundred
    training examples), else None: it has no mask token; or most tokens are [UNK] (`MAX_UNKNOWN_SHARE`: what the
    model would learn is where the unknown words were) or under `MIN_MASKABLE_SHARE` are maskable (special tokens,
    [UNK] among them, are never masked), so steps come out with no masked token and a NaN loss. For the loop to
    call after tokenizing, before building the model (one line, naming both shares)."""
    name = getattr(tokenizer, "name_or_path", "") or "?"
    if getattr(tokenizer, "mask_token", None) is None:
        return f"{flag} {name} has no mask token, so nothing can be masked: give a tokenizer with [MASK]"
    special = set(tokenizer.all_special_ids)
    pad, unk = tokenizer.pad_token_id, tokenizer.unk_token_id
    tokens = [token for ids in examples for token in ids if token != pad]
    if not tokens:
        return f"{flag} {name}: the data tokenizes to no tokens at all; check --dataset and --text_field"
    maskable = sum(token not in special for token in tokens) / len(tokens)
    unknown = sum(token == unk for token in tokens) / len(tokens)
    if maskable >= MIN_MASKABLE_SHARE and unknown <= MAX_UNKNOWN_SHARE:
        return None
    return (
        f"{flag} {name} reads {unknown:.0%} of the data's tokens as [UNK] and leaves {maskable:.0%} maskable "
        "(special tokens are never masked), so steps would have few or no masked tokens and a NaN loss: use a "
        "tokenizer made for this text, e.g. --tokenizer train:wordpiece:8000"
    )


def check_maskable(data, examples: int = 100) -> None:
    """ValueError (`maskable_problem`) when the tokenized data leaves nothing to mask: read on the first `examples`
    validation examples (the first one of a streamed split), after tokenizing and before the model is built."""
    if data.streaming:
        sample = [next(iter(data.validation))["input_ids"]]
    else:
        sample = [data.validation[i]["input_ids"] for i in range(min(examples, len(data.validation)))]
    if problem := maskable_problem(data.tokenizer, sample):
        raise ValueError(problem)


def padded_beyond_positions(max_seq_length: int, multiple: int, positions: int) -> str:
    """The refusal of a padding multiple that would pad the longest batch past the model's position table."""
    near = [d for d in range(max(2, multiple // 2), 2 * multiple + 1) if positions % d == 0][:3]  # divisors
    return (
        f"--pad_to_multiple_of {multiple} pads a batch of max_seq_length={max_seq_length} tokens to "
        f"{padded_length(max_seq_length, multiple)}, past the model's {positions} positions; give --max_seq_length "
        f"{positions // multiple * multiple} (a multiple of {multiple} within them), or a multiple that rounds "
        f"{max_seq_length} up to at most {positions}"
        + (
            f" (divisors of {positions} near {multiple}: {', '.join(map(str, near))})"
            if near and max_seq_length == positions
            else ""
        )
    )


def beyond_positions(max_seq_length: int, positions: int, config: dict | None = None) -> str:
    """The refusal of a saved model read past its position table, with both ways out (`config`: its config.json,
    to name table rows that sit before the first position, as RoBERTa's do)."""
    rows = (config or {}).get("max_position_embeddings", positions)
    table = f"max_position_embeddings={positions}"
    if rows != positions:
        table = f"{positions} positions (max_position_embeddings={rows}; its {config['model_type']} position ids start "
        table += f"after the padding index, so {rows - positions} rows are never read)"
    return (
        f"max_seq_length={max_seq_length} exceeds the model's {table}; lower "
        "--max_seq_length, or pass --extend_positions copy to grow its position table by repeating the trained "
        "rows (docs/model.md)"
    )


def host_memory_problem(model_args, data_args, training_args, config: dict | None = None) -> str | None:
    """A line when a CPU run's estimated host memory (`accounting.memory`, `MemoryEstimate.host_peak`: per process
    on this machine its baseline, the fp32 model, the model states and ZeRO buffers and the activations of one
    micro-batch, attention probabilities kept as the CPU's math kernel does) is beyond the machine's memory: it
    would fail minutes later allocating it, or swap. None when it fits or cannot be estimated (a model folder whose config the memory model does not know). `config`: the saved
    model's, else a fresh preset's fields (with a 30,522-token vocabulary: the tokenizer is not built yet)."""
    import psutil

    if config is None:
        config = fresh_model_fields(model_args, data_args.max_seq_length, vocab_size=30522)
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    ds_config = launched_ds_config()
    stage, offload_optimizer, offload_params = zero_settings(ds_config)
    try:
        estimate = estimate_training_memory(
            config, training_args.per_device_train_batch_size, data_args.max_seq_length, zero_stage=stage,
            offload_optimizer=offload_optimizer, offload_params=offload_params, gpus_per_node=processes,
            mixed_precision=effective_precision(training_args.mixed_precision),
            gradient_checkpointing=bool(getattr(model_args, "gradient_checkpointing", False)),
            mlm_probability=decoded_fraction(training_args, getattr(data_args, "mlm_probability", 0.15)),
            fused_attention=False, ds_config=ds_config, cpu_run=True,
        )  # fmt: skip
    except (KeyError, TypeError, ValueError):
        return None
    need = estimate.host_peak
    have = psutil.virtual_memory().total
    if need <= have:
        return None
    return (
        f"this run needs about {need / GIB:,.1f} GiB of memory ({processes} process(es): baseline and fp32 model "
        f"{(estimate.host_baseline + estimate.host_fp32_model) / GIB:,.1f} GiB, model states "
        f"{(estimate.gpu_model_states + estimate.zero_buffers) / GIB:,.1f} GiB and activations "
        f"{estimate.activations / GIB:,.1f} GiB each, at "
        f"batch {training_args.per_device_train_batch_size} x length {data_args.max_seq_length}"
        f"{', ' + str(config.get('concept_num')) + ' concepts' if config.get('concept_num') else ''}) and this "
        f"machine has {have / GIB:,.1f} GiB; lower --per_device_train_batch_size (raise --gradient_accumulation_steps "
        f"to keep the batch), --max_seq_length{', --concept_num' if config.get('concept_num') else ''} or the model's size"
    )


def user_errors() -> tuple[type[BaseException], ...]:
    """Failures that are the input's or the environment's, not the code's: reported in one line."""
    return ValueError, DataSourceError, StaleLockError, DiskFullError, OSError  # OSError: a path or file refused


@contextlib.contextmanager
def one_line_errors(*more: type[BaseException]):
    """End a script on a user error (`user_errors()` and `more`) with one line and exit code 1 instead of
    a traceback; `CONCEPT_ENCODER_TRACEBACK=1` shows the traceback."""
    try:
        yield
    except Exception as error:
        if os.environ.get("CONCEPT_ENCODER_TRACEBACK") or not isinstance(error, (*more, *user_errors())):
            raise
        print(f"error: {error}\n(set CONCEPT_ENCODER_TRACEBACK=1 for the traceback)", file=sys.stderr)
        sys.exit(1)


def fail_fast(argv: list[str], classes=ARGUMENT_CLASSES, defaults: dict | None = None) -> None:
    """Parse and preflight `argv` (and find the checkpoint to resume); on a bad argument print one
    line and exit 1, as the loop would, seconds earlier."""
    with one_line_errors():
        model_args, data_args, training_args = parse_args(argv, classes=classes, defaults=defaults)
        for each in model_args.per_folder(training_args.seed) if hasattr(model_args, "per_folder") else [model_args]:
            preflight(each, data_args, training_args, cuda=cuda_present())  # fine-tuning: every folder, every seed's
        resolve_resume(training_args.resume_from_checkpoint, training_args.output_dir, training_args.run_name)
