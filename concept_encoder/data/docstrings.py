"""The docstring corpus: English prose from the third-party packages installed in this environment.

`--dataset docstrings` reads every `.py` file that an installed distribution lists in its `RECORD`
(torch, transformers, datasets, numpy, scipy, scikit-learn, pandas, ...), parses it with `ast` (no
package code is imported or run) and keeps each module, class and function docstring of at least
`MIN_WORDS` words as one document. `--dataset docstrings:<folder>` reads another `site-packages`
folder instead (another environment's, or a test's fake tree).

- **No network**, and far larger than `embedded`: what the measured size is depends on what is
  installed, so the dataset statistics carry every package name and version read.
- **The standard library is excluded**: only files an installed distribution lists are read (the
  stdlib is no distribution), minus top-level modules named like a stdlib one (backports). The
  `embedded` fine-tuning tasks are built from stdlib docstrings, so as a second guard any docstring
  whose first paragraph is one of those tasks' sentences (a vendored copy) is dropped and counted.
- **Deduplicated** by exact text and by normalised text (lower case, punctuation and whitespace
  collapsed): vendored copies and re-exported docstrings appear once. The first occurrence in the
  deterministic order (distributions by name, files by path, nodes in `ast.walk` order) is kept.
- **Cached** under `<cache_dir>/datasets/docstrings-<key>`, where the key is a digest of every file
  read (path, size, modification time) and the package versions: installing or upgrading a package
  gives a new corpus (and new tokenizer and block caches, which key on the same digest).

Why hand-written: no library extracts docstrings from an installed environment without importing
it (`pydoc`/`inspect` import every module, which runs package code and takes minutes for torch).
"""

from __future__ import annotations

import ast
import hashlib
import importlib.metadata
import io
import json
import logging
import os
import re
import sys
import sysconfig
import tokenize
import warnings
from dataclasses import dataclass
from pathlib import Path

from tqdm.auto import tqdm

from ..common.paths import cache_path, written_aside
from ..constants import DOCSTRINGS_DATASET
from .base import DataSourceError
from .stdlib_sentences import embedded_sentences, first_paragraph

logger = logging.getLogger(__name__)

MIN_WORDS = 8  # shorter docstrings ("Return x.") carry almost no language
EXTRACTOR_VERSION = 1  # part of the cache key: bump when the extraction rules change
DOCSTRING_NODES = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass(frozen=True)
class SourceFile:
    """One `.py` file to read, with the distribution that installed it."""

    path: Path
    package: str  # the distribution's name, as installed (scikit-learn)
    version: str
    top_level: str = ""  # the import name its RECORD entry starts with (sklearn)


def site_roots(spec: str) -> list[Path]:
    """The folders `spec` names: this interpreter's `site-packages` for `docstrings` (or `licenses`), else
    the folder after `docstrings:` (`licenses:`). A folder that does not exist is a DataSourceError."""
    _, _, folder = spec.partition(":")
    if not folder:
        paths = sysconfig.get_paths()
        return sorted({Path(paths["purelib"]).resolve(), Path(paths["platlib"]).resolve()})
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise DataSourceError(f"--dataset {spec!r}: {root} is not a folder; give a site-packages folder")
    return [root.resolve()]


def is_docstrings_spec(spec: str) -> bool:
    return spec == DOCSTRINGS_DATASET or spec.startswith(f"{DOCSTRINGS_DATASET}:")


def shadows_stdlib(relative: Path) -> bool:
    """True for a file whose top-level module is named like a standard-library one (a backport)."""
    return relative.parts[0].removesuffix(".py") in sys.stdlib_module_names


def is_python_source(entry: Path) -> bool:
    """A `.py` file of a distribution, not a backport named like a stdlib module."""
    return entry.suffix == ".py" and not shadows_stdlib(entry)


LICENSE_NAMES = ("LICENSE", "LICENCE", "COPYING", "NOTICE")


def is_license_text(entry: Path) -> bool:
    """LICENSE, LICENCE, COPYING or NOTICE files (any suffix but code: LICENSE.txt, COPYING.md, ...)."""
    return entry.name.upper().startswith(LICENSE_NAMES) and entry.suffix not in (".py", ".pyc", ".so")


FILE_KINDS = {"python": is_python_source, "license": is_license_text}
_listings: dict[tuple, tuple[list[SourceFile], list[str]]] = {}


def installed_files(roots: list[Path], kind: str = "python") -> tuple[list[SourceFile], list[str]]:
    """Every file of `kind` (`FILE_KINDS`: `.py` sources, license texts) the distributions under `roots`
    list in their RECORD, sorted by distribution name then path; each file once. Returns (files, notes on
    distributions or files left out).

    Reading every RECORD takes seconds, and one data preparation asks three times (documents, cache
    key, manifest): the listing is kept per process while no root folder's modification time changes
    (installing, removing or upgrading a distribution adds or removes entries there)."""
    key = (kind, *((str(root), root.stat().st_mtime_ns) for root in roots))
    if key not in _listings:
        _listings[key] = list_installed_files(roots, FILE_KINDS[kind])
    return _listings[key]


MAX_FILE_BYTES = 8 * 2**20  # a larger file is skipped and named (the largest .py of torch, transformers: 1.4 MB)


def list_installed_files(roots: list[Path], wanted=is_python_source) -> tuple[list[SourceFile], list[str]]:
    """See `installed_files`. Only files whose real path lies inside a root are listed: a link that leads out
    of the folder given (to a file or through a linked folder) is left out and named in the notes, as is a
    file over `MAX_FILE_BYTES`."""
    seen: set[Path] = set()
    files: list[SourceFile] = []
    notes: list[str] = []
    real_folders: dict[Path, Path] = {}  # resolved once per folder: a resolve() per file costs seconds
    distributions = importlib.metadata.distributions(path=[str(r) for r in roots])
    named = [(str(d.metadata["Name"] or ""), d.version or "", d) for d in distributions]  # METADATA parsed once
    for name, version, dist in sorted(named, key=lambda item: (item[0].lower(), item[1])):
        if not name or name.replace("_", "-").lower() == "concept-encoder":  # this project, if installed
            continue
        if dist.files is None:
            notes.append(f"{name} {version}: no RECORD, not read")
            continue
        for entry in sorted(dist.files, key=str):
            if not wanted(Path(str(entry))):
                continue
            path = Path(os.path.normpath(dist.locate_file(entry)))
            inside = any(path.is_relative_to(root) for root in roots)  # not ../../bin scripts
            if not inside or path in seen or not path.is_file():
                continue
            seen.add(path)
            if path.parent not in real_folders:
                real_folders[path.parent] = path.parent.resolve()
            real = path.resolve() if path.is_symlink() else real_folders[path.parent] / path.name
            if not any(real.is_relative_to(root) for root in roots):
                notes.append(f"{path}: a link to {real}, outside {', '.join(map(str, roots))}: not read")
                continue
            if (size := path.stat().st_size) > MAX_FILE_BYTES:
                notes.append(f"{path}: {size:,} bytes, over the {MAX_FILE_BYTES:,}-byte bound per file: not read")
                continue
            top = Path(str(entry)).parts[0]
            files.append(SourceFile(path, name, version, top.removesuffix(".py")))
    for note in notes:
        if ": not read" in note:
            logger.warning("%s", note)
    return files, notes


def fingerprint(files: list[SourceFile], roots: list[Path], rules: tuple | None = None) -> str:
    """Digest of what the corpus is built from: each file's path (relative to its root), size and
    modification time, each package's version, the extraction `rules` (None: the docstring reader's)."""
    listing = []
    for f in files:
        root = next(r for r in roots if f.path.is_relative_to(r))
        stat = f.path.stat()
        listing.append((str(f.path.relative_to(root)), stat.st_size, stat.st_mtime_ns, f.package, f.version))
    payload = json.dumps([*(rules or (EXTRACTOR_VERSION, MIN_WORDS)), listing])
    return hashlib.sha1(payload.encode()).hexdigest()[:12]


def read_source(path: Path) -> str:
    """The file's text in its declared encoding (PEP 263 cookie, else UTF-8); ValueError naming the
    encoding and byte offset when it does not decode."""
    data = path.read_bytes()
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(data).readline)
    except SyntaxError:  # no usable cookie and undecodable first lines: the decode below names the byte
        encoding = "utf-8"
    try:
        return data.decode(encoding)
    except UnicodeDecodeError as error:
        raise ValueError(f"not {encoding} text (byte {error.start})") from None


def file_docstrings(text: str) -> list[str]:
    """The module, class and function docstrings of one source file (cleaned of indentation), in
    `ast.walk` order; SyntaxError when it is not Python this interpreter parses, ValueError when it is too
    deeply nested for `ast` (a RecursionError or MemoryError there ends only this file, not the corpus)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # invalid escape sequences in old files: irrelevant here
        try:
            tree = ast.parse(text)
        except (RecursionError, MemoryError) as error:
            raise ValueError(f"too deeply nested to parse ({type(error).__name__})") from None
    found = (ast.get_docstring(node, clean=True) for node in ast.walk(tree) if isinstance(node, DOCSTRING_NODES))
    return [doc.strip() for doc in found if doc and doc.strip()]


def normalised(text: str) -> str:
    """Lower case, every run of non-alphanumerics as one space: the key for near-exact duplicates."""
    return re.sub(r"[\W_]+", " ", text.lower()).strip()


def digest(text: str) -> bytes:
    return hashlib.sha1(text.encode("utf-8", "surrogatepass")).digest()


def task_sentence_keys() -> set[bytes]:
    """Normalised digests of every `embedded` task sentence (stdlib docstrings' first paragraphs)."""
    return {digest(normalised(text)) for text in embedded_sentences()[0]}


def seen_or_task(text: str, seen: set[bytes], task_keys: set[bytes]) -> str | None:
    """Why `text` is not kept: "repeated" (its normalised text is in `seen`) or "task_sentence" (it begins with an
    `embedded` task sentence); None when it is kept, and then it is added to `seen`."""
    key = digest(normalised(text))
    if key in seen:
        return "repeated"
    seen.add(key)
    return "task_sentence" if digest(normalised(first_paragraph(text))) in task_keys else None


def extract(files: list[SourceFile], min_words: int = MIN_WORDS) -> tuple[list[str], dict]:
    """Documents (deduplicated docstrings of at least `min_words` words, none starting with a task sentence)
    and the manifest: packages with versions and document counts, words, what was dropped and why, and
    every file skipped with its reason."""
    task_keys = task_sentence_keys()
    exact: set[bytes] = set()
    near: set[bytes] = set()
    documents: list[str] = []
    packages: dict[str, dict] = {}
    skipped: list[str] = []
    dropped = {"short": 0, "exact_duplicates": 0, "normalised_duplicates": 0, "task_sentences": 0}
    words = 0
    for f in tqdm(files, desc="reading docstrings", unit="file", mininterval=2.0, disable=len(files) < 200):
        try:
            docstrings = file_docstrings(read_source(f.path))
        except (SyntaxError, ValueError) as error:
            reason = error.msg if isinstance(error, SyntaxError) else str(error)
            skipped.append(f"{f.path}: {reason}")
            continue
        entry = packages.setdefault(f.package, {"version": f.version, "files": 0, "documents": 0})
        entry["files"] += 1
        for doc in docstrings:
            count = len(doc.split())
            if count < min_words:
                dropped["short"] += 1
                continue
            key = digest(doc)
            if key in exact:
                dropped["exact_duplicates"] += 1
                continue
            exact.add(key)
            if why := seen_or_task(doc, near, task_keys):
                dropped["normalised_duplicates" if why == "repeated" else "task_sentences"] += 1
                continue
            documents.append(doc)
            entry["documents"] += 1
            words += count
    for path in skipped:
        logger.warning("docstring corpus: skipped %s", path)
    manifest = {
        "documents": len(documents),
        "words": words,
        "files_read": len(files) - len(skipped),
        "min_words": min_words,
        "dropped": dropped,
        "skipped_files": skipped,
        "packages": {name: packages[name] for name in sorted(packages, key=str.lower)},
    }
    return documents, manifest


@dataclass
class DocstringCorpus:
    documents: list[str]
    manifest: dict


def docstring_corpus(spec: str, cache_dir: str | Path | None = "Cache") -> DocstringCorpus:
    """The corpus `spec` names (`docstrings` or `docstrings:<site-packages folder>`), built once per
    fingerprint and cached as JSON lines under `<cache_dir>/datasets/docstrings-<key>`."""
    return cached_site_corpus(spec, DOCSTRINGS_DATASET, None, extract, cache_dir,
                              f"no docstring has {MIN_WORDS} words or more")  # fmt: skip


def cached_site_corpus(spec: str, name: str, rules: tuple | None, build, cache_dir, empty: str) -> DocstringCorpus:
    """The documents `build(files) -> (documents, manifest)` makes of the installed `.py` files `spec` names
    (`<name>` or `<name>:<site-packages folder>`), built once per fingerprint (files and `rules`) and cached as
    JSON lines under `<cache_dir>/datasets/<name>-<key>`; DataSourceError (`empty` says why) when none."""
    roots = site_roots(spec)
    files, notes = installed_files(roots)
    if not files:
        raise DataSourceError(
            f"--dataset {spec!r}: no third-party .py file found under {', '.join(map(str, roots))} (stdlib files "
            f"are excluded); install packages there, or point {name}:<folder> at a site-packages folder"
        )
    key = fingerprint(files, roots, rules)
    folder = None if cache_dir is None else cache_path(cache_dir) / "datasets" / f"{name}-{key}"
    if folder is not None and (folder / "manifest.json").exists():
        with open(folder / "documents.jsonl", encoding="utf-8") as handle:
            documents = [json.loads(line) for line in handle]
        return DocstringCorpus(documents, json.loads((folder / "manifest.json").read_text()))
    documents, manifest = build(files)
    if not documents:
        raise DataSourceError(f"--dataset {spec!r}: {len(files)} files read, but {empty}")
    manifest.update(fingerprint=key, roots=[str(r) for r in roots], notes=notes)
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        with written_aside(folder / "documents.jsonl") as partial, open(partial, "w", encoding="utf-8") as handle:
            handle.writelines(json.dumps(doc) + "\n" for doc in documents)
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))  # written last: marks it complete
    return DocstringCorpus(documents, manifest)


def site_fingerprint(spec: str, kind: str = "python", rules: tuple | None = None) -> str:
    """The cache key of a site-packages source (`docstrings`, `licenses`) without reading any file's text (a
    listing and a stat per file of `kind`), with the `rules` that turn those files into documents."""
    roots = site_roots(spec)
    return fingerprint(installed_files(roots, kind)[0], roots, rules)
