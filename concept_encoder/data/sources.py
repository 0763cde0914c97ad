"""Text sources: the embedded offline corpus, the installed packages' docstrings, local files or folders,
and Hub datasets.

Every source comes back as a `DatasetDict` with a `train` and a `validation` split of
raw documents in a `text` column. A source without its own validation split gets a
deterministic held-out percentage of its documents (split before tokenisation, so no
document straddles the two splits).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from datasets import Dataset, DatasetDict, IterableDatasetDict, concatenate_datasets, load_dataset
from datasets.exceptions import DatasetsError

from ..constants import DOCSTRINGS_DATASET, EMBEDDED_DATASET, LICENSES_DATASET
from .base import DataSourceError, ensure_hub, group_paragraphs, paragraphs_of, unreachable_message
from .docstrings import docstring_corpus, is_docstrings_spec, site_fingerprint
from .licenses import is_licenses_spec, license_documents, licenses_fingerprint
from .mixture import TASK_SOURCE, is_mixture, parse_mixture, repetition
from .modules import RULES as MODULE_RULES
from .modules import is_modules_spec, module_corpus

logger = logging.getLogger(__name__)

LOCAL_BUILDERS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
SPLIT_SEED = 1234  # fixed: the held-out split must not move when the training seed changes
VALIDATION_SPLIT_NAMES = ("validation", "valid", "dev")
TaskTexts = Callable[[str], list[str]]  # a task's name → its training split's texts (`tasks.loading.training_texts`)


def needs_task_texts(spec: str) -> DataSourceError:
    return DataSourceError(
        f"--dataset {spec!r}: {TASK_SOURCE}<name> sources are read by the pretraining loop (loops/mlm.py) and "
        "check_health, which know the tasks; this tool reads text sources only"
    )


def embedded_documents(min_words: int = 120) -> list[str]:
    """The English reference documentation shipped inside CPython (`pydoc_data.topics`, ~65k words).

    Each topic is cut at blank lines and consecutive paragraphs are grouped until a group has
    at least `min_words` words, giving a few hundred documents: enough for a held-out split.
    """
    from pydoc_data.topics import topics

    return [doc for name in sorted(topics) for doc in group_paragraphs(paragraphs_of(topics[name]), min_words)]


def looks_like_path(spec: str) -> bool:
    """A spec meant as a local path (so a missing one is reported as such, not looked up on the Hub)."""
    return spec.startswith((".", "/", "~")) or Path(spec).suffix.lower() in LOCAL_BUILDERS


def folder_files(path: Path) -> list[Path]:
    """The data files a local `path` stands for: the file itself, or a folder's `.txt/.jsonl/.json/.parquet` files
    whose real path lies inside it (a link leading out of it is left out and named in a warning), sorted."""
    if not path.is_dir():
        return [path]
    root = path.resolve()
    files = sorted(p for p in path.rglob("*") if p.suffix.lower() in LOCAL_BUILDERS)
    outside = [p for p in files if not p.resolve().is_relative_to(root)]
    if outside:
        logger.warning("%s: %d file(s) lead outside the folder through a link and are not read: %s", path,
                       len(outside), ", ".join(map(str, outside[:5])))  # fmt: skip
    return [p for p in files if p not in outside]


SPLIT_WORDS = {"train": "train", "training": "train", "validation": "validation", "valid": "validation",
               "val": "validation", "dev": "validation", "test": "test", "testing": "test"}  # fmt: skip


def split_of(path: Path, root: Path) -> str | None:
    """The split a file's name (or a folder on its way) says it holds, as datasets names them: `train.txt`,
    `valid-00.jsonl`, `dev/part1.txt` → train / validation / validation; None when nothing says."""
    for part in path.relative_to(root).with_suffix("").parts:
        word = re.split(r"[-_.\s]", part.lower())[0]
        if word in SPLIT_WORDS:
            return SPLIT_WORDS[word]
    return None


def local_files(path: Path) -> tuple[str, dict[str, list[str]]]:
    """`path` (file or folder) → (datasets builder name, split → sorted files). One file type per folder. A
    folder whose files are named by split (`train.txt`, `validation.txt`, `test.txt`, ...) keeps them apart:
    the validation files are the held-out split, test files are not read for pretraining (named in a warning),
    files named by no split are training text."""
    files = folder_files(path)
    if not files:
        raise DataSourceError(f"{path} holds no .txt/.jsonl/.json/.parquet file; point --dataset at text data")
    builders = {LOCAL_BUILDERS.get(p.suffix.lower()) for p in files}
    if None in builders:
        raise DataSourceError(f"{path}: unsupported file type; use one of {sorted(LOCAL_BUILDERS)}")
    if len(builders) > 1:
        raise DataSourceError(f"{path} mixes file types {sorted(builders)}; keep one type per dataset folder")
    if all(p.stat().st_size == 0 for p in files):
        raise DataSourceError(f"{path}: every file is empty")
    splits: dict[str, list[str]] = {}
    for p in files:
        splits.setdefault((split_of(p, path) if path.is_dir() else None) or "train", []).append(str(p))
    if test := splits.pop("test", None):
        logger.warning("%s: %d test file(s) left out of pretraining (%s)", path, len(test), ", ".join(test[:3]))
    if "train" not in splits:
        raise DataSourceError(f"{path}: no training text (only {sorted(splits) or 'test'} files); add train files")
    return builders.pop(), splits


def texts_digest(texts: list[str]) -> str:
    """A short digest of a list of texts, in order (a task source's content in cache keys and model configs)."""
    return hashlib.sha1("\0".join(texts).encode()).hexdigest()[:12]


def source_fingerprint(spec: str, task_texts: TaskTexts | None = None) -> str:
    """What identifies the content of `spec` beside its name, for cache keys: each local file's path,
    size and modification time (replacing a file at the same path changes it), the Python version for
    the embedded corpus (it is CPython's own documentation), the digest of every file read for the
    docstring corpus and the license texts, nothing for a Hub name; for a mixture, its parts' (a task's: the
    digest of its training texts, read through `task_texts`)."""
    if is_mixture(spec):
        parts = []
        for part in parse_mixture(spec):
            if part.task is None:
                parts.append(source_fingerprint(part.spec))
            elif task_texts is None:
                raise needs_task_texts(spec)
            else:
                parts.append(texts_digest(task_texts(part.task)))
        return hashlib.sha1(json.dumps(parts).encode()).hexdigest()[:12]
    if spec == EMBEDDED_DATASET:
        return f"py{sys.version_info.major}.{sys.version_info.minor}"
    if spec.startswith(DOCSTRINGS_DATASET):
        if is_docstrings_spec(spec):
            return site_fingerprint(spec)
    if spec.startswith(LICENSES_DATASET):
        if is_licenses_spec(spec):
            return licenses_fingerprint(spec)
    if is_modules_spec(spec):
        return site_fingerprint(spec, rules=MODULE_RULES)
    path = Path(spec).expanduser()
    if not path.exists():
        return ""
    files = folder_files(path)  # the files read: one left out (a link out) or added changes the key
    listing = [
        (str(p.relative_to(path) if p != path else p.name), p.stat().st_size, p.stat().st_mtime_ns) for p in files
    ]
    return hashlib.sha1(json.dumps(listing).encode()).hexdigest()[:12]


def unreadable_file_message(files: list[str], builder: str) -> str | None:
    """The first file that is not UTF-8 text (with the byte offset) or, for JSON lines, the first line
    that does not parse (with its number); None when every file reads."""
    for name in files:
        data = Path(name).read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as error:
            line = data[: error.start].count(b"\n") + 1
            return f"{name} is not UTF-8 text (byte {error.start}, line {line}): re-encode it as UTF-8"
        if builder == "json" and name.endswith(".jsonl"):
            for number, line in enumerate(text.splitlines(), start=1):
                if line.strip():
                    try:
                        json.loads(line)
                    except json.JSONDecodeError as error:
                        return f"{name} line {number} is not valid JSON ({error.msg}): fix or remove that line"
    return None


def load_raw_dataset(
    spec: str,
    text_field: str = "text",
    validation_split_percentage: float | None = 5.0,
    streaming: bool = False,
    streaming_validation_documents: int = 1000,
    cache_dir: str | Path | None = None,
    task_texts: TaskTexts | None = None,
) -> DatasetDict | IterableDatasetDict:
    """Load documents from `spec` as `{train, validation}` with one `text` column.

    `spec` is `embedded`, `docstrings[:<site-packages folder>]` (its documents cached under
    `cache_dir`), `licenses[:<site-packages folder>]` (`concept_encoder.data.licenses`), a local file or folder, or a Hub dataset `name` or `name:config`
    (e.g. `wikitext:wikitext-103-raw-v1`, `JeanKaddour/minipile`). Without a validation split,
    `validation_split_percentage` of the documents are held out at random, or when streaming (the
    size is unknown) the first `streaming_validation_documents`. `validation_split_percentage=None`: nothing is held
    out (a text read whole, e.g. the held-out language check, however few its documents). A mixture
    (`docstrings,task:embedded*8`, `mixture.py`) is read by `load_mixture`.
    """
    if validation_split_percentage is not None and not 0 < validation_split_percentage < 100:
        raise ValueError(f"validation_split_percentage={validation_split_percentage} must be in (0, 100)")
    if is_mixture(spec):
        if streaming:
            raise DataSourceError(f"--dataset {spec!r}: a mixture is read whole; leave out --streaming")
        return load_mixture(spec, text_field, validation_split_percentage, cache_dir, task_texts)
    documents = offline_documents(spec, cache_dir)
    if documents is not None:
        raw = DatasetDict({"train": Dataset.from_dict({"text": documents})})
        if streaming:
            raw = IterableDatasetDict({"train": raw["train"].to_iterable_dataset()})
    elif Path(spec).expanduser().exists():
        builder, files = local_files(Path(spec).expanduser())
        kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
        try:
            raw = load_dataset(builder, data_files=files, streaming=streaming, **kwargs)
        except DatasetsError as error:  # "An error occurred while generating the dataset": find out which file
            listed = [f for split in files.values() for f in split]
            raise DataSourceError(unreadable_file_message(listed, builder) or f"{spec}: {error}") from error
    elif looks_like_path(spec):
        raise DataSourceError(f"--dataset {spec!r}: no such file or folder")
    else:
        name, _, config = spec.partition(":")
        ensure_hub("dataset", spec)
        try:
            raw = load_dataset(name, config or None, streaming=streaming)
        except Exception as error:  # datasets raises many types (ConnectionError, FileNotFoundError, ...)
            raise DataSourceError(unreachable_message("dataset", spec, f"{type(error).__name__}: {error}")) from error
    return select_text_and_split(raw, text_field, validation_split_percentage, spec, streaming_validation_documents)


def load_mixture(
    spec: str, text_field: str, percentage: float | None, cache_dir, task_texts: TaskTexts | None
) -> DatasetDict:
    """Each part split on its own (`task:` parts: their training texts, of which `percentage` are held out like
    any source's), its training documents repeated by its weight, the parts' training documents shuffled together
    (a fixed seed: packing must not put a document's copies side by side); validation: every part's, once."""
    trains, validations = [], []
    for part in parse_mixture(spec):
        if part.task is None:
            split = load_raw_dataset(part.spec, text_field, percentage, cache_dir=cache_dir)
        elif task_texts is None:
            raise needs_task_texts(spec)
        else:
            raw = DatasetDict({"train": Dataset.from_dict({"text": task_texts(part.task)})})
            split = select_text_and_split(raw, "text", percentage, part.spec, 1)
        picked = repetition(len(split["train"]), part.weight, SPLIT_SEED)
        if not picked:
            raise DataSourceError(
                f"--dataset {spec!r}: weight {part.weight:g} of {part.spec} keeps none of its "
                f"{len(split['train'])} training document(s); raise the weight"
            )
        trains.append(split["train"].select(picked))
        validations.append(split["validation"])
    return DatasetDict(
        {
            "train": concatenate_datasets(trains).shuffle(seed=SPLIT_SEED),
            "validation": concatenate_datasets(validations),
        }
    )


def offline_documents(spec: str, cache_dir: str | Path | None) -> list[str] | None:
    """The documents of a built-in offline source (`embedded`, `docstrings[:folder]`, `licenses[:folder]`,
    `modules[:folder]`);
    None for any other."""
    if spec == EMBEDDED_DATASET:
        return embedded_documents()
    if is_licenses_spec(spec):
        return license_documents(spec)
    if is_modules_spec(spec):
        return module_corpus(spec, cache_dir).documents
    return docstring_corpus(spec, cache_dir).documents if is_docstrings_spec(spec) else None


def select_text_and_split(
    raw, text_field: str, percentage: float | None, spec: str, streaming_validation_documents: int
):
    train = raw["train"]
    columns = train.column_names or []
    if columns and text_field not in columns:
        raise DataSourceError(
            f"dataset {spec!r} has no column {text_field!r} (columns: {columns}); pass --text_field with one of them"
        )
    validation = next((raw[s] for s in VALIDATION_SPLIT_NAMES if s in raw), None)
    train = documents_only(train, text_field, spec, "train")
    if validation is not None:
        validation = documents_only(validation, text_field, spec, "validation")
    elif percentage is None:  # read whole: nothing held out
        validation = train.take(0) if isinstance(raw, IterableDatasetDict) else train.select([])
    elif isinstance(raw, IterableDatasetDict):
        validation = train.take(streaming_validation_documents)
        train = train.skip(streaming_validation_documents)
    else:
        held_out = math.ceil(len(train) * percentage / 100)  # as datasets' train_test_split counts it
        if not 1 <= held_out < len(train):
            raise DataSourceError(
                f"dataset {spec!r}: {len(train)} document(s) cannot be split into train and validation at "
                f"--validation_split_percentage {percentage:g} (each side needs at least one document); add "
                "documents, raise --validation_split_percentage, or use a source with its own validation split"
            )
        parts = train.train_test_split(test_size=percentage / 100, seed=SPLIT_SEED, shuffle=True)
        train, validation = parts["train"], parts["test"]
    return type(raw)({"train": train, "validation": validation})


def documents_only(ds, text_field: str, spec: str, split: str):
    """`ds` with one `text` column of non-empty strings. Texts that are not strings (numbers, nulls, lists:
    a JSON or Parquet column can hold them) are skipped and counted in a warning naming the source;
    a split left without any document is a DataSourceError."""
    if text_field != "text":
        ds = ds.rename_column(text_field, "text")
    keep = [c for c in (ds.column_names or []) if c != "text"]
    ds = ds.remove_columns(keep) if keep else ds
    if isinstance(ds, Dataset):
        kinds = Counter(type(t).__name__ for t in ds["text"] if not isinstance(t, str))
        if kinds:
            logger.warning(
                "%s (%s split): %d text(s) are not strings (%s): skipped; make every %r value a string to keep them",
                spec, split, sum(kinds.values()), ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())), text_field,
            )  # fmt: skip
    ds = ds.filter(lambda batch: [isinstance(t, str) and bool(t.strip()) for t in batch["text"]], batched=True)
    if isinstance(ds, Dataset) and len(ds) == 0:
        raise DataSourceError(
            f"dataset {spec!r} has no documents in its {split} split: every {text_field!r} value is empty, "
            "whitespace or not a string; point --dataset at text"
        )
    return ds
