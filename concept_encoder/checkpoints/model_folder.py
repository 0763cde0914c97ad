"""A saved model folder is what it claims, checked before it is trained or judged.

Its `config.json` is a JSON object; its weights are safetensors (a pickle is never loaded: it can run code) whose
header and size agree; once loaded, every tensor of the pretrained backbone was in the file with its shape, only
the new task head is initialised at random, and every parameter is finite. Each fault ends in one line naming the
file and what to do (`ModelFolderError`), before any training; without these checks transformers loads a folder
with no encoder tensors as a random encoder (an INFO line) and a NaN weight trains to NaN everywhere.

`model_folder_problem` reads files only (torch-free: the loops' preflight runs it); `load_checked` loads.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from ..common.paths import unusable_path

logger = logging.getLogger("concept_encoder")

SAFE_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
PICKLED_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "tf_model.h5", "flax_model.msgpack")
SAVED_BY = "pass a folder written by save_pretrained (e.g. Cache/runs/<run>/final)"


SAVED_MODEL_SUFFIXES = (".json", ".safetensors", ".py", ".txt", ".model", ".md")  # what save_pretrained writes


def holds_only_saved_model_files(folder: Path) -> bool:
    """A folder of plain files `save_pretrained` (model, tokenizer, code, card) writes, nothing else, its
    `config.json` and safetensors weights among them: how a model folder this project wrote before it marked its
    folders (`common.paths.OWNER_MARKER`) is recognised."""
    entries = list(folder.iterdir())
    names = {e.name for e in entries}
    weights = any(name.endswith(suffix) for name in names for suffix in (".safetensors", SAFE_WEIGHTS[1]))
    return (
        "config.json" in names
        and weights
        and all(e.is_file() and not e.is_symlink() and e.suffix in SAVED_MODEL_SUFFIXES for e in entries)
    )


class ModelFolderError(ValueError):
    """A model folder does not hold what it claims; the message names the file and what to do."""


def safetensors_problem(path: Path) -> str | None:
    """Why `path` is not a whole safetensors file (empty, cut short, header not JSON), from its header alone: an
    8-byte little-endian header length, the JSON header, then the tensors, whose byte ranges end at the file's end.
    (Read by hand, not with `safetensors`, to stay torch-free and to name the fault instead of a Rust error.)"""
    size = path.stat().st_size
    again = "save the model again, or copy the folder whole"
    if size < 8:
        return f"{path} is {size} bytes, not a safetensors file (empty or cut short); {again}"
    with open(path, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little")
        if length > size - 8:
            return f"{path}: its header claims {length:,} bytes and the file holds {size - 8:,}: cut short; {again}"
        try:
            header = json.loads(handle.read(length))
            end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, TypeError, IndexError):
            return f"{path}: its header is not a safetensors header; {again}"
    if 8 + length + end != size:
        return f"{path}: its tensors need {8 + length + end:,} bytes and the file holds {size:,}: cut short; {again}"
    return None


SAFETENSORS_FLOATS = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}  # header name → torch's


def stored_float_dtypes(folder: str | Path) -> set[str]:
    """The floating dtypes (torch's names) of the tensors in the folder's safetensors files, from their headers
    alone (torch-free; the folder is assumed checked by `model_folder_problem`)."""
    found = set()
    for path in Path(folder).glob("*.safetensors"):
        with open(path, "rb") as handle:
            header = json.loads(handle.read(int.from_bytes(handle.read(8), "little")))
        found |= {SAFETENSORS_FLOATS[e["dtype"]] for k, e in header.items() if e.get("dtype") in SAFETENSORS_FLOATS
                  and k != "__metadata__"}  # fmt: skip
    return found


def save_model_weights(model, folder: Path, state_dict: dict | None = None, dtype: str = "float32") -> None:
    """`model.save_pretrained(folder, state_dict=...)` with every floating tensor in `dtype` (`--save_dtype`, float32
    by default) and `config.json`'s `dtype` saying so.

    transformers records the module's dtype in `config.json`, and transformers 5 reloads with `dtype="auto"`, which
    reads it: under DeepSpeed's bf16 the module holds bf16 copies (the fp32 masters live in its optimizer), so a
    folder of fp32 masters would still reload, and fine-tune, as bf16 weights whose spacing at 1.0 (2^-7) rounds
    most updates away. Tensors that share memory (tied weights) still share it after the cast."""
    import torch

    target = getattr(torch, dtype)
    state = model.state_dict() if state_dict is None else state_dict
    cast: dict[tuple, torch.Tensor] = {}  # one cast per storage: tied weights stay one tensor

    def in_target(tensor: torch.Tensor) -> torch.Tensor:
        if not tensor.is_floating_point() or tensor.dtype == target:
            return tensor
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in cast:
            cast[key] = tensor.to(target)
        return cast[key]

    model.save_pretrained(folder, state_dict={name: in_target(tensor) for name, tensor in state.items()})
    config = Path(folder) / "config.json"
    settings = json.loads(config.read_text())
    settings["dtype"] = dtype
    config.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")


def model_folder_problem(path: str | Path, weights: bool = True) -> str | None:
    """Why the folder `path` is not a saved model to load (no folder, config not a JSON object; with `weights`:
    no safetensors weights, pickled weights only, a weights file cut short), else None. Reads files only."""
    folder = Path(path)
    config = folder / "config.json"
    if problem := unusable_path(folder):
        return f"{folder}: {problem}"
    if not folder.is_dir():
        return f"{folder} is not a folder; {SAVED_BY}"
    if not config.is_file():
        return f"{folder} holds no config.json; {SAVED_BY}"
    try:
        settings = json.loads(config.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        return f"{config} is not JSON ({getattr(error, 'msg', error)}); {SAVED_BY}"
    if not isinstance(settings, dict):
        return f"{config} holds a JSON {type(settings).__name__}, not an object of settings; {SAVED_BY}"
    if not weights:
        return None
    if (folder / SAFE_WEIGHTS[1]).is_file():
        try:
            shards = sorted(set(json.loads((folder / SAFE_WEIGHTS[1]).read_text())["weight_map"].values()))
        except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
            return f"{folder / SAFE_WEIGHTS[1]} is not a safetensors index (no weight_map); {SAVED_BY}"
        files = [folder / Path(shard).name for shard in shards]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            return f"{folder / SAFE_WEIGHTS[1]} names shard(s) {missing[:3]} that the folder lacks; copy it whole"
    elif (folder / SAFE_WEIGHTS[0]).is_file():
        files = [folder / SAFE_WEIGHTS[0]]
    elif pickled := [name for name in PICKLED_WEIGHTS if (folder / name).is_file()]:
        return (
            f"{folder} holds its weights only as {pickled[0]}, which this project does not load (a pickle can run "
            "code); where you trust it, re-save the model as safetensors: save_pretrained (transformers 5 writes "
            "nothing else; older versions with safe_serialization=True)"
        )
    else:
        return f"{folder} holds no model.safetensors; {SAVED_BY}"
    return next((problem for f in files if (problem := safetensors_problem(f))), None)


def check_model_folder(path: str | Path, weights: bool = True) -> None:
    """Raise `ModelFolderError` with `model_folder_problem`'s line."""
    if problem := model_folder_problem(path, weights):
        raise ModelFolderError(problem)


def non_finite_parameters(model) -> list[str]:
    """Names of the parameters holding NaN or infinity."""
    import torch

    return [name for name, p in model.named_parameters() if not torch.isfinite(p).all()]


def note_upcast(path: str | Path) -> None:
    """One log line when the folder's weights are stored in less than float32 and are loaded as float32."""
    if stored := sorted(stored_float_dtypes(path) - {"float32", "float64"}):
        logger.info("%s holds %s weights: loaded as float32 (training keeps fp32 weights)", path, "/".join(stored))


def load_checked(model_class, path: str | Path, whole: bool = False, dtype: str = "float32", **kwargs):
    """`model_class.from_pretrained(path, **kwargs)` after `check_model_folder`, then refused (`ModelFolderError`)
    when a tensor of the backbone (`base_model_prefix`; a BERT pooler excepted: MLM checkpoints have none) was not
    in the file (with `whole`: any tensor, heads included, for tools that read the model's own predictions), when
    shapes do not match, or when a parameter is not finite. Returns (model, loading info).

    The parameters are loaded in `dtype`: float32 by default, whatever the folder holds, because every caller but
    the export check trains or fine-tunes them (a 16-bit folder is upcast, with one log line); `"auto"` keeps the
    stored dtype."""
    import torch

    check_model_folder(path)
    if dtype == "float32":
        note_upcast(path)
    try:
        model, info = model_class.from_pretrained(
            path, output_loading_info=True, dtype=dtype if dtype == "auto" else getattr(torch, dtype), **kwargs
        )
    except (RuntimeError, ValueError, OSError) as error:  # size mismatches, unreadable files
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ModelFolderError(f"{path}: the weights do not load into its config's model ({first})") from error
    absent = sorted(k for k in info["missing_keys"] if in_backbone(model, k) and ".pooler." not in f".{k}")
    if whole and (lacking := sorted(set(info["missing_keys"]) - set(absent))):
        raise ModelFolderError(
            f"{path}: {len(lacking)} tensor(s) of its {model_class.__name__} are not in its weights (e.g. "
            f"{', '.join(lacking[:3])}): they would start random, and what they predict would not be the model's. "
            "A fine-tuned classifier's folder holds no MLM decoder: pass a pretraining run's final/ or a snapshot"
        )
    if absent:
        raise ModelFolderError(
            f"{path}: {len(absent)} tensor(s) of the pretrained {model.base_model_prefix} are not in its weights "
            f"(e.g. {', '.join(absent[:3])}): they would start random. The folder does not hold the model its config "
            "describes; save it again, or pass --from_scratch to train a random model on purpose"
        )
    if bad := non_finite_parameters(model):
        raise ModelFolderError(
            f"{path}: {len(bad)} parameter tensor(s) hold NaN/Inf (e.g. {', '.join(bad[:3])}); a model with them "
            "trains and predicts NaN. Use an earlier checkpoint of it"
        )
    return model, info


def in_backbone(model, key: str) -> bool:
    """Whether the tensor `key` belongs to the pretrained backbone: under a head model, the keys under its
    `base_model_prefix`; a bare backbone (`AutoModel`, e.g. a distillation teacher) is all backbone, its keys unprefixed."""
    return model.base_model is model or key.startswith(f"{model.base_model_prefix}.")


def save_tokenizer_without_code(tokenizer, folder: Path) -> list[str]:
    """`tokenizer.save_pretrained(folder)` into a model folder the project writes, leaving no code the project did
    not write: a tokenizer class registered for the Auto classes copies its own module beside it and names it in
    `auto_map` (a `repo--module` entry makes transformers download one), which a reader loading the folder with
    `trust_remote_code=True` for the model's sake would run. The model's own modelling files (saved first) stay;
    any other `*.py` is removed and the `auto_map` entries naming it dropped. Returns what was left out."""
    folder = Path(folder)
    own_code = {path.stem for path in folder.glob("*.py")}
    tokenizer.save_pretrained(folder)
    left_out = sorted(path.name for path in folder.glob("*.py") if path.stem not in own_code)
    for name in left_out:
        (folder / name).unlink()
    for path in sorted(folder.glob("*.json")):
        left_out += without_foreign_code(path, own_code)
    if left_out:
        logger.warning("tokenizer code left out of %s: %s", folder, ", ".join(left_out))
    return left_out


def without_foreign_code(path: Path, own_code: set[str]) -> list[str]:
    """Remove from the JSON file `path` the `auto_map` entries that name code other than `own_code` (the folder's
    own modules): a module the folder does not hold, or one of another repository (`repo--module.Class`, which
    transformers downloads). Returns what was removed, as "file's auto_map entry (targets)"."""
    try:
        settings = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(settings, dict) or "auto_map" not in settings:
        return []
    auto_map = settings["auto_map"] if isinstance(settings["auto_map"], dict) else {"auto_map": settings["auto_map"]}
    kept = {key: value for key, value in auto_map.items() if names_own_code(value, own_code)}
    if kept:
        settings["auto_map"] = kept
    else:
        del settings["auto_map"]
    path.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")
    return [f"{path.name}'s auto_map {key} ({value})" for key, value in auto_map.items() if key not in kept]


def names_own_code(value, own_code: set[str]) -> bool:
    """Whether an `auto_map` value ("module.Class", or a list of them and None) names only modules in `own_code`."""
    targets = [value] if isinstance(value, str) else value if isinstance(value, list) else [object()]
    named = [t for t in targets if t is not None]
    return bool(named) and all(isinstance(t, str) and "--" not in t and t.rpartition(".")[0] in own_code for t in named)


_digests: dict[tuple, str] = {}


def model_digest(path: str | Path, weights: bool = True) -> str:
    """sha256 (16 hex digits) of what decides a saved model's results: its `config.json` and, with `weights`, its
    safetensors files (weights, index, shards). A finished result is reused only for the same digest: the same
    path may hold another model by now. Computed once per process while the files' sizes and times stay."""
    folder = Path(path)
    files = [folder / "config.json"]
    if weights:
        files += sorted(p for p in folder.iterdir() if p.suffix == ".safetensors" or p.name == SAFE_WEIGHTS[1])
    key = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    if key not in _digests:
        hasher = hashlib.sha256()
        for f in files:
            hasher.update(f.name.encode() + b"\0")
            with open(f, "rb") as handle:
                while chunk := handle.read(2**20):
                    hasher.update(chunk)
        _digests[key] = hasher.hexdigest()[:16]
    return _digests[key]
