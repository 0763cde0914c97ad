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
vocabulary); otherwise nothing is left behind and the exit code is 1. A refused input is one line, exit code 2.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
from pathlib import Path

import torch
from transformers import BertConfig

from ..common.paths import OWNER_MARKER, NotOursError, folder_problem, replace_problem, written_aside
from ..model.bert_baseline import BertForSparseMaskedLM
from ..model.config import ConceptEncoderConfig
from ..model.heads import ConceptEncoderForMaskedLM
from .args import SAVE_DTYPES
from .checkpoint import (
    CheckpointError,
    TrainState,
    deepspeed_safe_globals,
    json_or_none,
    load_state_file,
    named_checkpoint_fault,
    saved_train_state,
    verify_deepspeed_states,
)
from .deepspeed_setup import deepspeed_config, outside_zero3
from .metrics_log import read_metrics
from .model import construct
from .model_card import write_model_card
from .model_folder import (
    ModelFolderError,
    holds_only_saved_model_files,
    load_checked,
    save_model_weights,
    stored_float_dtypes,
)
from .runs import RUN_TOKENIZER
from .runtime import plain_model

TOLERANCE = 1e-5  # max |Δlogit| between the written folder, reloaded, and the model that loaded the checkpoint
PROBE_LENGTH = 64
DEEPSPEED_FOLDER = "pytorch_model"  # accelerate's `save_state` under DeepSpeed: `engine.save_checkpoint(<ckpt>, it)`
WRAPPER_PREFIXES = ("module.", "_orig_mod.")  # DDP's wrapper (accelerate saves the prepared model), torch.compile's


class ExportError(ValueError):
    """A checkpoint, run or output folder an export refuses; the message names what and what to do."""


class ExportCheckError(ExportError):
    """The written folder, reloaded, does not compute what the checkpoint's weights compute."""


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
                        help="replace the folder when it holds a model folder this project wrote (never anyone else's)")  # fmt: skip
    parser.add_argument("--tokenizer", type=Path, default=None,
                        help="the tokenizer folder to include (default: the run's own, <run>/tokenizer)")  # fmt: skip
    parser.add_argument("--save_dtype", choices=SAVE_DTYPES, default="float32",
                        help="dtype of the written weights (default float32, the checkpoint's fp32 weights; the check "
                        "then runs the checkpoint's model in this dtype too)")  # fmt: skip
    return parser.parse_args(argv)


def checked_checkpoint(path: Path) -> Path:
    """`path` when it is an intact checkpoint; else `ExportError` naming the fault (no checkpoint, a damaged file)
    and the run's newest intact checkpoint (`checkpoint.named_checkpoint_fault`)."""
    if fault := named_checkpoint_fault(path):
        raise ExportError(f"{path} {fault}")
    return path


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
    if not ((folder / "tokenizer_config.json").is_file() or (folder / "tokenizer.json").is_file()):
        raise ExportError(f"{folder} holds no saved tokenizer (tokenizer_config.json); pass --tokenizer with the "
                          "folder of the tokenizer the run was trained with")  # fmt: skip
    return folder


def output_problem(folder: Path, overwrite: bool) -> str | None:
    """Why the export must not write `folder`, else None: it cannot be written, or it exists and holds something
    (without `overwrite`; with it, only a model folder this project wrote may be replaced)."""
    if problem := folder_problem(folder, "output folder"):
        return problem
    occupied = folder.is_symlink() or folder.exists() and not (folder.is_dir() and not any(folder.iterdir()))
    if not occupied:
        return None
    if not overwrite:
        return f"{folder} exists and is not an empty folder; pass --overwrite to replace it (a model folder this project wrote), or choose another folder"
    return replace_problem(folder, holds_only_saved_model_files)


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
        verify_deepspeed_states(checkpoint)  # before DeepSpeed unpickles any of them
        if any(deepspeed_dir.glob("*_optim_states.pt")):
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=DEEPSPEED_FOLDER)
            return state, f"{DEEPSPEED_FOLDER}/ (ZeRO shards gathered to fp32 by DeepSpeed's zero_to_fp32)"
        with torch.serialization.safe_globals(deepspeed_safe_globals()):
            state = load_state_file(deepspeed_dir / "mp_rank_00_model_states.pt")["module"]
        return state, f"{DEEPSPEED_FOLDER}/mp_rank_00_model_states.pt"
    if (checkpoint / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(checkpoint / "model.safetensors"), "model.safetensors"
    if (checkpoint / "pytorch_model.bin").is_file():
        return load_state_file(checkpoint / "pytorch_model.bin"), "pytorch_model.bin"
    raise ExportError(f"{checkpoint} holds no model weights (model.safetensors, pytorch_model.bin or DeepSpeed's "
                      f"{DEEPSPEED_FOLDER}/); it is not a checkpoint `accelerator.save_state` wrote")  # fmt: skip


def plain_names(state: dict) -> dict:
    """`state` under the plain model's names: a prefix every name carries from a wrapper (DDP's `module.`,
    torch.compile's `_orig_mod.`, in either order) removed."""
    while state and (prefix := next((p for p in WRAPPER_PREFIXES if all(k.startswith(p) for k in state)), None)):
        state = {name.removeprefix(prefix): value for name, value in state.items()}
    return state


def load_strictly(model, state: dict) -> None:
    """`model.load_state_dict(state)`, refused (`ExportError`, the names given) when a tensor of the model is not in
    `state` (one tied to a tensor that is, e.g. the decoder to the word embeddings, may be absent) or `state` holds
    a tensor the model lacks; a shape mismatch is refused by torch and named too."""
    same = {}  # tensor → the names it goes by (tied weights are one tensor under several names)
    for name, tensor in model.state_dict(keep_vars=True).items():
        same.setdefault(id(tensor), set()).add(name)
    tied = {name: names for names in same.values() for name in names}
    try:
        result = model.load_state_dict(state, strict=False)
    except RuntimeError as error:
        raise ExportError(
            f"the checkpoint's weights do not fit the run's model_config: {str(error).strip()[:500]}"
        ) from None
    missing = sorted(k for k in result.missing_keys if not tied[k] & state.keys())
    if missing or result.unexpected_keys:
        raise ExportError(
            f"the checkpoint's weights are not the run's model: {len(missing)} tensor(s) missing "
            f"({', '.join(missing[:5])}), {len(result.unexpected_keys)} unexpected "
            f"({', '.join(sorted(result.unexpected_keys)[:5])}); the run's config.json does not describe this checkpoint"
        )
    model.tie_weights()


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


def export(
    checkpoint: Path, folder: Path, overwrite: bool = False, tokenizer: Path | None = None, save_dtype: str = "float32"
) -> dict:
    """Write the model of `checkpoint` into `folder` in `save_dtype` (see the module doc); returns what
    `export.json` records."""
    checkpoint = checked_checkpoint(checkpoint)
    run_dir = checkpoint.parent.parent
    config = run_config(run_dir)
    tokenizer = tokenizer_folder(tokenizer, run_dir)
    if problem := output_problem(folder, overwrite):
        raise ExportError(problem)
    progress = saved_train_state(checkpoint)
    model = untrained_model(config["model_config"])
    state, source = checkpoint_state_dict(checkpoint)
    load_strictly(model, plain_names(state))
    model.to(getattr(torch, save_dtype))  # compared like with like: the written weights, reloaded, in their dtype
    ids = probe_ids(model.config.vocab_size, model.config.max_position_embeddings)
    reference = logits_of(model, ids)
    record = {"checkpoint": str(checkpoint.resolve()), "run": str(run_dir.resolve()), "step": progress.step,
              "tokens_seen": progress.tokens_seen, "weights_from": source, "tokenizer": str(tokenizer.resolve()),
              "dtype": save_dtype}  # fmt: skip
    command = ["python", "-m", "concept_encoder", "export", *map(str, (checkpoint, folder))]
    with written_aside(folder, replace_existing=overwrite, legacy=holds_only_saved_model_files) as partial:
        save_model_weights(model, partial, dtype=save_dtype)
        for file in sorted(tokenizer.iterdir()):
            if file.is_file() and not file.is_symlink() and file.name != OWNER_MARKER:
                shutil.copy2(file, partial / file.name)
        write_model_card(partial, run_dir.name, config, {**card_summary(run_dir, progress), "save_dtype": save_dtype},
                         command, checkpoint)  # fmt: skip
        difference = (reloaded_logits(type(model), partial, ids) - reference).abs().max().item()
        record["check"] = {"probe_ids": list(ids.shape), "max_abs_logit_diff": difference, "tolerance": TOLERANCE}
        if not difference <= TOLERANCE:  # NaN fails too
            raise ExportCheckError(
                f"export check failed: {folder} reloaded differs from the checkpoint's model by max |Δlogit| "
                f"{difference:.3e} > {TOLERANCE:g} on ids {list(ids.shape)}; nothing was written"
            )
        (partial / "export.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        record = export(args.checkpoint, args.folder, args.overwrite, args.tokenizer, args.save_dtype)
    except ExportCheckError as error:
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
