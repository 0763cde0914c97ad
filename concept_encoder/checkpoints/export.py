"""`python -m concept_encoder export <run>/checkpoints/step_N <folder>`: a training checkpoint as a plain model folder.

A preempted run has checkpoints but no `final/`. This writes what `final/` would hold at that step: the model by
`save_pretrained` (config, safetensors weights, the model's code files), the run's tokenizer (`<run>/tokenizer`),
a model card (`README.md`) and `export.json` (checkpoint, step, the check). The model is the run's class built on
its `config.json` "model_config"; the weights are loaded strictly (a tensor missing or left over is an error;
weights tied to a loaded one may be absent, as in `save_pretrained`'s files). Nothing of the checkpoint is
unpickled: accelerate's `model.safetensors` is read by safetensors (`pytorch_model.bin` with
`weights_only=True`); a DeepSpeed checkpoint (`pytorch_model/`) is gathered to fp32 by DeepSpeed's own
`zero_to_fp32` after `checkpoint.verify_deepspeed_states` has read every state file with `weights_only=True`.

The folder is written aside and moved into place only after the check: reloaded with `from_pretrained`, it must
give the logits of the model that loaded the checkpoint (max |Δlogit| <= 1e-5 on fixed ids `[1,N]` drawn from the
vocabulary); otherwise nothing is left behind and the exit code is 1, as for a full disk. A refused input (damaged
weights included) is one line, exit code 2.

What it writes is safe to load and to replace: no code travels from the tokenizer folder (only the project's own
modelling files, which `save_pretrained` writes, are in the folder, and an `auto_map` naming other code is removed:
`trust_remote_code` then runs nothing else), and `export.json` lists every file written with its size and sha256,
so `--overwrite` replaces only a folder whose every file is one an earlier export wrote, unchanged; never a run,
checkpoint, tokenizer or cache folder, nor a user's file beside an export.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import shlex
import shutil
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError
from transformers import BertConfig

from ..common import json_io
from ..common.accelerator_state import deepspeed_config, outside_zero3, plain_model
from ..common.faults import is_disk_full
from ..common.metrics_log import read_metrics
from ..common.paths import (
    OWNER_MARKER,
    OWNER_MARKER_TEXT,
    NotOursError,
    dangling_link_problem,
    folder_problem,
    partial_path,
    written_aside,
)
from ..constants import RUN_TOKENIZER, SAVE_DTYPES
from ..model.bert_baseline import BertForSparseMaskedLM
from ..model.config import ConceptEncoderConfig
from ..model.construct import construct
from ..model.heads import ConceptEncoderForMaskedLM
from .checkpoint import (
    MANIFEST,
    TRAIN_STATE,
    CheckpointError,
    TrainState,
    deepspeed_safe_globals,
    json_or_none,
    load_state_file,
    named_checkpoint_fault,
    saved_train_state,
    verify_deepspeed_states,
)
from .model_card import write_model_card
from .model_folder import (
    ModelFolderError,
    load_checked,
    non_finite_parameters,
    save_model_weights,
    stored_float_dtypes,
    without_foreign_code,
)

TOLERANCE = 1e-5  # max |Δlogit| between the written folder, reloaded, and the model that loaded the checkpoint
PROBE_LENGTH = 64
DEEPSPEED_FOLDER = "pytorch_model"  # accelerate's `save_state` under DeepSpeed: `engine.save_checkpoint(<ckpt>, it)`
WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP's wrapper (accelerate saves the prepared model), torch.compile's
EXPORT_RECORD = "export.json"  # what the export did, and every file it wrote (`files`: name → bytes, sha256)
TOKENIZER_SUFFIXES = (".json", ".txt", ".model", ".jinja")  # the data files a tokenizer's save_pretrained writes
ANOTHER_CHECKPOINT = "export another checkpoint of the run (<run>/checkpoints/step_N), or restore the file from a copy"
SHOWN = 5  # unexpected files named in a refusal before "and N more"
logger = logging.getLogger("concept_encoder")


class ExportError(ValueError):
    """A checkpoint, run or output folder an export refuses; the message names what and what to do."""


class ExportCheckError(ExportError):
    """The written folder, reloaded, does not compute what the checkpoint's weights compute."""


class ExportWriteError(ExportError):
    """The system refused to write the folder (a full disk, no permission): nothing half-written is left."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m concept_encoder export",
        description="Turn a training checkpoint (<run>/checkpoints/step_N, plain, DDP or DeepSpeed ZeRO: shards "
        "gathered) into a plain Hugging Face model folder: save_pretrained weights and config, the run's tokenizer, "
        "a model card and export.json. Checked: the folder, reloaded, gives the checkpoint's logits.",
    )
    parser.add_argument(
        "checkpoint", type=Path, help="a checkpoint folder, e.g. Cache/runs/<run>/checkpoints/step_0000600"
    )
    parser.add_argument("folder", type=Path, help="the model folder to write (absent or empty, or see --overwrite)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace the folder when it holds an earlier export, every file as that export wrote it "
                        "(never a run, checkpoint, tokenizer or cache folder, nor a folder with anyone else's file)")  # fmt: skip
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="the tokenizer folder to include (default: the run's own, <run>/tokenizer)")  # fmt: skip
    parser.add_argument("--save_dtype", choices=SAVE_DTYPES, default="float32",
                        help="dtype of the written weights (default float32, the checkpoint's fp32 weights; the check "
                        "then runs the checkpoint's model in this dtype too)")  # fmt: skip
    return parser.parse_args(argv)


def checked_checkpoint(path: Path) -> Path:
    """`path` when it is an intact checkpoint; else `ExportError` naming the fault (a dangling link, no checkpoint,
    a damaged file) and the run's newest intact checkpoint (`checkpoint.named_checkpoint_fault`, asked of the
    checkpoint's real place so that a link to it finds its run)."""
    if dangling := dangling_link_problem(path):
        raise ExportError(
            f"{dangling}; remove the link, or pass the checkpoint folder itself (<run>/checkpoints/step_N)"
        )
    if fault := named_checkpoint_fault(path.resolve()):
        raise ExportError(f"{path} {fault}")
    return path


def run_folder_of(checkpoint: Path) -> Path:
    """The run `<run>/checkpoints/step_N` belongs to, found from the checkpoint's real place (a link to it, e.g.
    `~/latest`, sits outside its run), else from the name as given (checkpoints moved to another disk and linked
    back into their run folder)."""
    real, given = checkpoint.resolve().parent.parent, checkpoint.absolute().parent.parent
    return next((run for run in (real, given) if (run / "config.json").is_file()), real)


def run_config(run_dir: Path) -> dict:
    """The run's `config.json` (what `loops/mlm.py` wrote at its start), with its "model_config"."""
    path = run_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        config = None
    if not isinstance(config, dict) or not isinstance(config.get("model_config"), dict):
        raise ExportError(f"{path} is missing or holds no \"model_config\": the checkpoint must sit in its run folder "
                          "(<run>/checkpoints/step_N beside <run>/config.json); copy the run folder whole")  # fmt: skip
    return config


def tokenizer_folder(given: Path | None, run_dir: Path) -> Path:
    """`given`, else the run's own tokenizer copy, when it holds a saved tokenizer."""
    folder = given or run_dir / RUN_TOKENIZER
    if dangling := dangling_link_problem(folder):
        raise ExportError(f"{dangling}; pass --tokenizer with the folder of the tokenizer the run was trained with")
    if not ((folder / "tokenizer_config.json").is_file() or (folder / "tokenizer.json").is_file()):
        raise ExportError(f"{folder} holds no saved tokenizer (tokenizer_config.json); pass --tokenizer with the "
                          "folder of the tokenizer the run was trained with")  # fmt: skip
    return folder


def output_problem(folder: Path, overwrite: bool, inputs: tuple[Path, ...] = ()) -> str | None:
    """Why the export must not write `folder`, else None: it cannot be written, it is a link (dangling or not: the
    export would replace the link, not write where it points), it is one of the export's `inputs` (or holds one),
    or a folder this project uses for something else (`project_role`), or it holds something: without `overwrite`
    anything; with it, anything but an earlier export's files as that export wrote them (`earlier_export_problem`)."""
    if dangling := dangling_link_problem(folder):
        return f"{dangling}; remove the link or choose another folder (an export never writes through a link)"
    if folder.is_symlink():
        return (f"{folder} is a symbolic link to {os.readlink(folder)}: an export would replace the link, not write "
                "there; give the folder's own path, or choose another folder")  # fmt: skip
    if problem := folder_problem(folder, "output folder"):
        return problem
    if not folder.exists():
        return None
    if not folder.is_dir():
        return f"{folder} is a file, not a folder: refusing to replace it; choose another folder"
    if role := project_role(folder, inputs):
        return f"{folder} is {role}: an export never replaces it, with or without --overwrite; choose another folder"
    if not any(folder.iterdir()):
        return None
    if not overwrite:
        return (f"{folder} exists and is not an empty folder; pass --overwrite to replace it (an earlier export, "
                "every file as it wrote it), or choose another folder")  # fmt: skip
    return earlier_export_problem(folder)


def project_role(folder: Path, inputs: tuple[Path, ...]) -> str | None:
    """What `folder` is to this project besides an export's output, else None: an input of this export (the
    checkpoint, its run, the tokenizer) or a folder holding one, a run folder, a checkpoint, or a folder this
    project marked (`OWNER_MARKER`) for something else (a run's `final/` or tokenizer, a cache entry)."""
    real = folder.resolve()
    for path in inputs:
        if real == path.resolve() or real in path.resolve().parents:
            return f"this export's input {path}" + ("" if real == path.resolve() else " or holds it")
    if (folder / "checkpoints").is_dir() or (folder / "metrics.jsonl").is_file():
        return "a training run's folder"
    if (folder / TRAIN_STATE).is_file() or (folder / MANIFEST).is_file():
        return "a training checkpoint"
    if (folder / OWNER_MARKER).is_file() and not (folder / EXPORT_RECORD).is_file():
        return (
            "a folder this project wrote for something else than an export (a run's model or tokenizer, a cache entry)"
        )
    return None


def earlier_export_problem(folder: Path) -> str | None:
    """Why `--overwrite` must not replace `folder`, else None: it is replaceable only when its `export.json` lists
    the files an earlier export wrote and every file in it is one of those, with the size and sha256 recorded
    (a user's file beside them, or one they edited, would be lost)."""
    record = json_or_none(folder / EXPORT_RECORD)
    files = record.get("files") if isinstance(record, dict) else None
    if isinstance(record, dict) and "checkpoint" in record and files is None:
        return (f"{folder} holds an export written before {EXPORT_RECORD} listed its files, so a file added to it "
                "cannot be told from the export's own: refusing to replace it; move it away (or delete it after "
                "checking it holds nothing of yours), or choose another folder")  # fmt: skip
    if not isinstance(files, dict):
        return (f"{folder} holds files this project did not write (no {EXPORT_RECORD} listing the files of an earlier "
                f"export): {some(sorted(e.name for e in folder.iterdir()))}; --overwrite replaces only a folder an "
                "export wrote: move this one away, or choose another folder")  # fmt: skip
    if unexpected := unrecorded_files(folder, files):
        return (f"{folder} holds files this project did not write, or changed since its export wrote them (not as "
                f"its {EXPORT_RECORD} lists them): {some(unexpected)}; refusing to replace it: move those files "
                "away, or choose another folder")  # fmt: skip
    return None


def unrecorded_files(folder: Path, files: dict) -> list[str]:
    """The entries of `folder` that are not the export's own files as `files` recorded them: a file not listed or
    changed, a subfolder or a link (an export writes neither), a marker that is not the project's."""
    unexpected = []
    for entry in sorted(folder.iterdir()):
        if entry.is_symlink() or not entry.is_file():
            unexpected.append(f"{entry.name} (a link)" if entry.is_symlink() else f"{entry.name}/")
        elif entry.name == OWNER_MARKER:
            if entry.read_bytes() != OWNER_MARKER_TEXT.encode():
                unexpected.append(f"{entry.name} (changed)")
        elif entry.name == EXPORT_RECORD:
            continue
        elif entry.name not in files:
            unexpected.append(entry.name)
        elif files[entry.name] != file_record(entry, files[entry.name]):
            unexpected.append(f"{entry.name} (changed)")
    return unexpected


def file_record(path: Path, recorded: object = None) -> dict:
    """`{"bytes": size, "sha256": digest}` of a file; the digest is skipped when the size already differs from
    `recorded`'s (a changed file, told without reading it)."""
    size = path.stat().st_size
    if isinstance(recorded, dict) and recorded.get("bytes") != size:
        return {"bytes": size}
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


def some(names: list[str]) -> str:
    """The first `SHOWN` names, then "and N more"."""
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    return ", ".join(names[:SHOWN]) + more


def untrained_model(model_config: dict):
    """The class `loops/mlm.py` trains (`BertForSparseMaskedLM` for the BERT baseline, else
    `ConceptEncoderForMaskedLM`) on the run's `model_config`, built as the loop builds it (`construct`)."""
    if model_config.get("model_type") == "bert":
        return construct(BertForSparseMaskedLM, BertConfig.from_dict(model_config), seed=0).eval()
    return construct(ConceptEncoderForMaskedLM, ConceptEncoderConfig.from_dict(model_config), seed=0).eval()


def checkpoint_state_dict(checkpoint: Path) -> tuple[dict, str]:
    """The model's weights in `checkpoint` and where they came from: DeepSpeed's `pytorch_model/` (ZeRO-1/2/3:
    the fp32 master weights gathered from every rank's shard; ZeRO-0: the module's state), else accelerate's
    `model.safetensors` or `pytorch_model.bin`. Read without unpickling anything but tensors and plain values."""
    deepspeed_dir = checkpoint / DEEPSPEED_FOLDER
    if deepspeed_dir.is_dir():
        verify_deepspeed_states(checkpoint, fix=ANOTHER_CHECKPOINT)  # before DeepSpeed unpickles any of them
        if any(deepspeed_dir.glob("*_optim_states.pt")):
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=DEEPSPEED_FOLDER)
            return state, f"{DEEPSPEED_FOLDER}/ (ZeRO shards gathered to fp32 by DeepSpeed's zero_to_fp32)"
        with torch.serialization.safe_globals(deepspeed_safe_globals()):
            state = load_state_file(deepspeed_dir / "mp_rank_00_model_states.pt", fix=ANOTHER_CHECKPOINT)["module"]
        return state, f"{DEEPSPEED_FOLDER}/mp_rank_00_model_states.pt"
    if (checkpoint / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(checkpoint / "model.safetensors"), "model.safetensors"
    if (checkpoint / "pytorch_model.bin").is_file():
        return load_state_file(checkpoint / "pytorch_model.bin", fix=ANOTHER_CHECKPOINT), "pytorch_model.bin"
    raise ExportError(f"{checkpoint} holds no model weights (model.safetensors, pytorch_model.bin or DeepSpeed's "
                      f"{DEEPSPEED_FOLDER}/); it is not a checkpoint `accelerator.save_state` wrote")  # fmt: skip


# What reading damaged weights raises: safetensors' and torch's readers, DeepSpeed's gather (its asserts included)
UNREADABLE = (SafetensorError, OSError, RuntimeError, ValueError, EOFError, LookupError, TypeError, AssertionError)


def checkpoint_weights(checkpoint: Path) -> tuple[dict, str]:
    """`checkpoint_state_dict`, with a weights file that its manifest calls whole (the sizes match) but that does
    not read (a corrupt header, a flipped byte, a tensor cut short) refused in one line naming it."""
    try:
        return checkpoint_state_dict(checkpoint)
    except UNREADABLE as error:
        if isinstance(error, (ExportError, CheckpointError)):
            raise
        raise ExportError(f"{weights_path(checkpoint)} does not read as model weights ({one_line(error)}) although "
                          f"the checkpoint's {MANIFEST} matches its size: it is damaged; {ANOTHER_CHECKPOINT}") from None  # fmt: skip


def weights_path(checkpoint: Path) -> Path:
    """The file or folder of `checkpoint` that `checkpoint_state_dict` reads the weights from."""
    names = (DEEPSPEED_FOLDER, "model.safetensors", "pytorch_model.bin")
    return next((checkpoint / name for name in names if (checkpoint / name).exists()), checkpoint)


def one_line(error: BaseException, limit: int = 300) -> str:
    """An error's message on one line (torch's state-dict errors span several), cut to `limit` characters."""
    return " ".join(str(error).split())[:limit] or type(error).__name__


def plain_names(state: dict) -> dict:
    """`state` under the plain model's names: a prefix every name carries from a wrapper (DDP's `module.`,
    torch.compile's `_orig_mod.`, in either order) removed."""
    while state and (prefix := next((p for p in WRAPPER_PREFIXES if all(k.startswith(p) for k in state)), None)):
        state = {name.removeprefix(prefix): value for name, value in state.items()}
    return state


def load_strictly(model, state: dict, source: str = "the checkpoint") -> None:
    """`model.load_state_dict(state)`, refused (`ExportError`, the names given) when a tensor of the model is not in
    `state` (one tied to a tensor that is, e.g. the decoder to the word embeddings, may be absent) or `state` holds
    a tensor the model lacks; a shape mismatch is refused by torch and named too, and so is a NaN or infinite
    weight (a damaged file, or a diverged run: its folder would only predict NaN)."""
    same = {}  # tensor → the names it goes by (tied weights are one tensor under several names)
    for name, tensor in model.state_dict(keep_vars=True).items():
        same.setdefault(id(tensor), set()).add(name)
    tied = {name: names for names in same.values() for name in names}
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as error:
        raise ExportError(
            f"the weights in {source} do not fit the run's model_config ({one_line(error, 500)}): the file is damaged "
            f"or the run's config.json does not describe it; {ANOTHER_CHECKPOINT}"
        ) from None
    missing = sorted(k for k in result.missing_keys if not tied[k] & state.keys())
    if missing or result.unexpected_keys:
        raise ExportError(
            f"the checkpoint's weights are not the run's model: {len(missing)} tensor(s) missing "
            f"({', '.join(missing[:5])}), {len(result.unexpected_keys)} unexpected "
            f"({', '.join(sorted(result.unexpected_keys)[:5])}); the run's config.json does not describe this checkpoint"
        )
    model.tie_weights()
    if bad := non_finite_parameters(model):
        raise ExportError(f"the weights in {source} hold NaN or infinite values ({some(bad)}): the file is damaged "
                          f"or the run diverged by then; {ANOTHER_CHECKPOINT}")  # fmt: skip


def probe_ids(vocab_size: int, max_positions: int) -> torch.Tensor:
    """Fixed input ids `[1,N]`: N = min(64, positions) tokens drawn from the vocabulary with seed 0."""
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (1, min(PROBE_LENGTH, max_positions)), generator=generator)


@torch.no_grad()
def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    """`[1,N]` ids → `[1,N,V]` float logits of `model` in eval mode."""
    return model.eval()(input_ids=ids).logits.float()


def reloaded_logits(model_class, folder: Path, ids: torch.Tensor) -> torch.Tensor:
    """The logits of `folder` loaded back by `from_pretrained` in its stored dtype (`load_checked`: every tensor
    present, finite)."""
    return logits_of(load_checked(model_class, folder, whole=True, dtype="auto")[0], ids)


# The end-of-run check of `final/` (`saved_model_check`): the same weights on the same device in the same precision
# compute the same logits, up to kernel noise; 1e-4 is held by the tests under bf16 autocast on the CPU. Where the
# two sides cannot be alike (the saved weights rounded below the run's precision by --save_dtype, or the reloaded
# copy run on the CPU because the run offloads its parameters), only a gross fault (a lost gather: logits off by
# their own size) is told from precision noise.
RUN_CHECK_TOLERANCE = 1e-4
ROUNDED_CHECK_TOLERANCE = 1e-1


def saved_model_check(accelerator, model, folder: Path, ids: torch.Tensor, reference: torch.Tensor) -> dict:
    """`folder` (the run's `final/`) reloaded and run as the run's model ran: on its device, its parameters in the
    run's dtype (DeepSpeed's 16-bit copies, or fp32 under autocast), under `accelerator.autocast()` (the autocast
    `prepare` wrapped the model's forward in, or none). Its logits on `ids [1,N]` against `reference [1,N,V]` (the
    run's model's, float). Returns what `summary.json` records: the max |Δlogit|, the tolerance, whether it passed,
    where and in what dtype it ran. Main process only; the run's model is not touched."""
    plain = plain_model(accelerator, model)
    dtype = next(plain.parameters()).dtype
    offloaded = ((deepspeed_config(accelerator) or {}).get("zero_optimization") or {}).get("offload_param") or {}
    device = torch.device("cpu") if offloaded.get("device", "none") != "none" else accelerator.device
    saved = {getattr(torch, name) for name in stored_float_dtypes(folder)}
    rounded = any(torch.finfo(d).eps > torch.finfo(dtype).eps for d in saved)
    alike = device == accelerator.device and not rounded
    with outside_zero3():
        reloaded = type(plain).from_pretrained(folder, dtype=dtype).to(device).eval()
    with torch.no_grad(), accelerator.autocast():
        logits = reloaded(input_ids=ids.to(device)).logits.float().cpu()
    difference = (logits - reference).abs().max().item()
    tolerance = RUN_CHECK_TOLERANCE if alike else ROUNDED_CHECK_TOLERANCE
    return {"max_abs_diff": difference, "tolerance": tolerance, "passed": difference <= tolerance,
            "device": str(device), "dtype": str(dtype).removeprefix("torch."), "alike": alike}  # fmt: skip


def card_summary(run_dir: Path, progress: TrainState) -> dict:
    """What the model card reports of the checkpoint's step: steps and tokens, the precision that ran (the run's
    `summary.json`, which a preempted run writes too) and the run's evaluation at that step, when it made one."""
    summary = json_or_none(run_dir / "summary.json")
    card = {"steps": progress.step, "tokens_seen": progress.tokens_seen,
            "mixed_precision": summary.get("mixed_precision") if isinstance(summary, dict) else None}  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    for record in read_metrics(metrics) if metrics.is_file() else []:
        if record.get("kind") == "eval" and record.get("step") == progress.step:
            card.update({key: value for key, value in record.items() if key not in ("kind", "step")})
    return card


def copy_tokenizer(tokenizer: Path, folder: Path) -> list[str]:
    """Copy the tokenizer's data files into the model folder `folder`; returns what was left out. Only the files a
    tokenizer's `save_pretrained` writes as data travel (`TOKENIZER_SUFFIXES`): no code (`*.py`, which
    `trust_remote_code` would run), no link (it may name any file of the machine), no subfolder, nothing a file
    of the model already holds by that name (a `config.json` beside a tokenizer would replace the model's); an
    `auto_map` of a copied JSON file keeps only the entries naming the folder's own code (`without_foreign_code`)."""
    own_code = {path.stem for path in folder.glob("*.py")}  # the project's modelling files, from save_pretrained
    left_out = []
    for file in sorted(tokenizer.iterdir()):
        if file.name == OWNER_MARKER:
            continue
        if (
            file.is_symlink()
            or not file.is_file()
            or file.suffix not in TOKENIZER_SUFFIXES
            or (folder / file.name).exists()
        ):
            left_out.append(f"{file.name}/" if file.is_dir() and not file.is_symlink() else file.name)
            continue
        shutil.copyfile(file, folder / file.name)
        if file.suffix == ".json":
            left_out += without_foreign_code(folder / file.name, own_code)
    return left_out


def write_export_folder(partial: Path, model, tokenizer: Path, card: tuple, record: dict, ids, reference) -> None:
    """The model folder, in `partial`: weights and config, the tokenizer's data files, the card, the check's
    result, and `export.json` last with every file written (`file_record`), which `--overwrite` trusts later."""
    save_model_weights(model, partial, dtype=record["dtype"])
    if left_out := copy_tokenizer(tokenizer, partial):
        record["left_out"] = left_out
        logger.warning("export: left out of the tokenizer copied from %s: %s (no code and no auto_map naming code "
                       "travel into the folder: only this project's own modelling files are in it)",
                       tokenizer, "; ".join(left_out))  # fmt: skip
    write_model_card(partial, *card)
    difference = (reloaded_logits(type(model), partial, ids) - reference).abs().max().item()
    record["check"] = {"probe_ids": list(ids.shape), "max_abs_logit_diff": difference, "tolerance": TOLERANCE}
    if not difference <= TOLERANCE:  # NaN fails too
        raise ExportCheckError(
            f"export check failed: the folder reloaded differs from the checkpoint's model by max |Δlogit| "
            f"{difference:.3e} > {TOLERANCE:g} on ids {list(ids.shape)}; nothing was written"
        )
    record["files"] = {path.name: file_record(path) for path in sorted(partial.iterdir()) if path.is_file()}
    (partial / EXPORT_RECORD).write_text(json_io.dumps(record, indent=2) + "\n")


def unwritten(folder: Path, error: BaseException) -> str:
    """The one line for a folder the system refused to write (`ExportWriteError`): the file, why, that nothing
    half-written is left and what is at `folder` now, and what to do."""
    where = written_path(folder, getattr(error, "filename", None))
    now = f"{folder} is as it was" if folder.exists() or folder.is_symlink() else f"{folder} was not created"
    if is_disk_full(error):
        return (f"no space left on the disk of {folder.parent} while writing {where}: nothing half-written was left "
                f"and {now}; free space on that disk, or export to a folder on another disk")  # fmt: skip
    why = getattr(error, "strerror", None) or one_line(error)
    failed = f"could not write {where}" if where == folder or folder in where.parents else f"could not read {where}"
    return (f"{failed} ({why}) while exporting to {folder}: nothing half-written was left and {now}; make it "
            "readable, the folder writable, or choose another folder")  # fmt: skip


def written_path(folder: Path, name: str | None) -> Path:
    """The path a user knows for the file `name` an error names: under `folder` for one of the copy written aside
    (`<folder>.partial-<pid>/x` is `<folder>/x`), else `name` itself (a file read, e.g. of the tokenizer)."""
    if not name:
        return folder
    try:
        return folder / Path(name).relative_to(partial_path(folder, os.getpid()))
    except ValueError:
        return Path(name)


def export(
    checkpoint: Path, folder: Path, overwrite: bool = False, tokenizer: Path | None = None, save_dtype: str = "float32"
) -> dict:
    """Write the model of `checkpoint` into `folder` in `save_dtype` (see the module doc); returns what
    `export.json` records."""
    checkpoint = checked_checkpoint(checkpoint)
    run_dir = run_folder_of(checkpoint)
    config = run_config(run_dir)
    tokenizer = tokenizer_folder(tokenizer, run_dir)
    inputs = (checkpoint, run_dir, tokenizer)
    if problem := output_problem(folder, overwrite, inputs):
        raise ExportError(problem)
    progress = saved_train_state(checkpoint)
    model = untrained_model(config["model_config"])
    state, source = checkpoint_weights(checkpoint)
    load_strictly(model, plain_names(state), f"{checkpoint}/{source.split()[0]}")
    model.to(getattr(torch, save_dtype))  # compared like with like: the written weights, reloaded, in their dtype
    ids = probe_ids(model.config.vocab_size, model.config.max_position_embeddings)
    reference = logits_of(model, ids)
    record = {"checkpoint": str(checkpoint.resolve()), "run": str(run_dir.resolve()), "step": progress.step,
              "tokens_seen": progress.tokens_seen, "weights_from": source, "tokenizer": str(tokenizer.resolve()),
              "dtype": save_dtype}  # fmt: skip
    command = ["python", "-m", "concept_encoder", "export", *map(str, (checkpoint, folder))]
    card = (run_dir.name, config, {**card_summary(run_dir, progress), "save_dtype": save_dtype}, command, checkpoint)
    try:
        with written_aside(folder, replace_existing=overwrite, sweep_stale=True,
                           replaceable=lambda target: output_problem(target, True, inputs)) as partial:  # fmt: skip
            write_export_folder(partial, model, tokenizer, card, record, ids, reference)
    except (OSError, SafetensorError) as error:  # a full disk, no permission: written_aside removed the partial copy
        raise ExportWriteError(unwritten(folder, error)) from None
    return record


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        record = export(args.checkpoint, args.folder, args.overwrite, args.tokenizer, args.save_dtype)
    except (ExportCheckError, ExportWriteError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except (ExportError, CheckpointError, ModelFolderError, NotOursError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"export check: max |Δlogit| {record['check']['max_abs_logit_diff']:.2e} (<= {TOLERANCE:g}) on ids "
          f"{record['check']['probe_ids']}")  # fmt: skip
    print(f"step {record['step']} of {record['run']} written to {args.folder} (weights from {record['weights_from']}); "
          f"load it with AutoModelForMaskedLM.from_pretrained({shlex.quote(str(args.folder))}) after `import concept_encoder`")  # fmt: skip
    return 0


if __name__ == "__main__":
    from ..common.entry import run_tool

    sys.exit(run_tool(main, "python -m concept_encoder export"))
