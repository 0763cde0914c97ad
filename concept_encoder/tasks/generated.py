"""The cache of generated tasks (ListOps, associative recall): splits written once under
`<cache_dir>/tasks/<kind>/<key>/`, the key a digest of the generator's version, seed and settings, so a changed
setting is another entry and the same settings are read back, never generated twice."""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from filelock import FileLock

from ..common.paths import cache_path, written_aside

logger = logging.getLogger(__name__)


def settings_digest(settings, version: int) -> str:
    """12 hex digits naming `settings` (a dataclass) and the generator's `version`: the content part of a cache key."""
    fields = {"version": version, **asdict(settings)}
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


def split_digest(rows: list[dict]) -> str:
    return hashlib.sha256("\n".join(f"{r['label']}\t{r['text']}" for r in rows).encode()).hexdigest()


SPLITS = ("train", "dev", "test")  # what every generator makes, in this order (`consecutive_splits`)
MAX_SYMBOLS = 2_000_000_000  # symbols a generator may draw: about fifteen minutes of one core at ~2 million a second
MIN_ROW_BYTES = 400  # a generated row held in memory: its dict, its text, its place in the seen-set and the file
SMALL_EXAMPLE = 16  # symbols drawn for an example of unknown length (a recall example of a few pairs)


def generation_problem(
    where: str,
    wanted: int,
    row_bytes: int = MIN_ROW_BYTES,
    share: float = 1.0,
    symbols: float = SMALL_EXAMPLE,
    kept: str = "",
    fix: str = "",
) -> str | None:
    """Why generating `wanted` distinct rows of about `row_bytes` each (in memory) cannot finish, else None: more
    than this machine's memory holds, or more than `MAX_SYMBOLS` symbols drawn when one draw in 1/`share` is kept
    (`kept`: which) and a draw costs about `symbols` (`fix`: how to need fewer). A generator that cannot finish
    would run for hours, its memory growing; this says so before the first draw."""
    import psutil

    memory = psutil.virtual_memory().total
    if wanted * row_bytes > memory:
        return (
            f"{where}: {wanted:,} examples of about {row_bytes:,} bytes each need {wanted * row_bytes / 2**30:,.1f} GiB "
            f"of memory, this machine has {memory / 2**30:,.1f} GiB: at most {memory // row_bytes:,} examples fit "
            "here; give fewer training examples"
        )
    draws = wanted / share if share > 0 else math.inf
    if draws * symbols > MAX_SYMBOLS:
        return (
            f"{where}: {wanted:,} examples, one in {1 / share if share > 0 else math.inf:,.3g} draws kept{kept}, take "
            f"about {draws:,.3g} draws of ~{symbols:,.0f} symbols, beyond the generator's limit of {MAX_SYMBOLS:,} "
            f"symbols; give fewer examples{fix}"
        )
    return None


def check_generation(where: str, wanted: int) -> None:
    """`generation_problem` for `wanted` small rows, each kept when drawn (recall's), as a ValueError."""
    if problem := generation_problem(where, wanted):
        raise ValueError(problem)


def cached_splits(kind: str, key: str, task: str, meta: dict, generate: Callable[[], dict[str, list[dict]]],
                  cache_dir: str | Path = "Cache") -> dict[str, list[dict]]:  # fmt: skip
    """The splits `generate()` makes, written into `<cache_dir>/tasks/<kind>/<key>/` the first time (under a lock,
    written aside: never half a set) and read from there afterwards; a damaged entry (a split that does not match
    its digest, a `meta.json` that is no settings-and-digests record of these settings) is named and generated
    again. `meta` (the settings, with the split sizes) is recorded in `meta.json` beside each split's digest;
    sizes that cannot be generated are refused before the first draw (`generation_problem`)."""
    folder = cache_path(cache_dir) / "tasks" / kind / key
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{folder}.lock"):
        if (folder / "meta.json").is_file():
            try:
                return read_splits(folder, meta)
            except (OSError, ValueError) as error:
                logger.warning("%s is damaged (%s): generating it again", folder, error)
        check_generation(f"task={task!r}", sum(meta.get(name, 0) for name in SPLITS))
        logger.info("generating %s into %s", task, folder)
        splits = generate()
        meta = {**meta, "task": task, "digests": {name: split_digest(rows) for name, rows in splits.items()}}
        with written_aside(folder, replace_existing=True) as partial:
            partial.mkdir(parents=True, exist_ok=True)
            for name, rows in splits.items():
                (partial / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            (partial / "meta.json").write_text(json.dumps(meta, indent=2))
    return splits


def recorded_digests(folder: Path, settings: dict | None = None) -> dict[str, str]:
    """The split digests `<folder>/meta.json` records; ValueError naming the file and what is wrong when it is no
    record of `settings` (a dict, each of them as given, a digest string for each of `SPLITS`): a list, a partial
    table or a wrong type would otherwise fail later, deep in fine-tuning (AttributeError, KeyError)."""
    path = folder / "meta.json"
    meta = json.loads(path.read_text())
    if not isinstance(meta, dict):
        raise ValueError(f"{path} holds a {type(meta).__name__}, not the settings-and-digests mapping")
    differ = [name for name, value in (settings or {}).items() if meta.get(name) != value]
    if differ:
        raise ValueError(f"{path} records other settings ({', '.join(differ)}) than its cache key's")
    digests = meta.get("digests")
    if not isinstance(digests, dict) or any(not isinstance(digests.get(name), str) for name in SPLITS):
        raise ValueError(f"{path}: 'digests' must map each of {list(SPLITS)} to its split's digest")
    return {name: digests[name] for name in SPLITS}


def read_splits(folder: Path, settings: dict | None = None) -> dict[str, list[dict]]:
    """The splits saved in `folder`, each checked against the digest `meta.json` records (ValueError naming the
    file otherwise, also for a malformed `meta.json` or row: `recorded_digests`)."""
    splits = {}
    for name, digest in recorded_digests(folder, settings).items():
        path = folder / f"{name}.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        if not all(isinstance(r, dict) and isinstance(r.get("text"), str) and "label" in r for r in rows):
            raise ValueError(f"{path}: every line must be a row with a text and a label")
        if split_digest(rows) != digest:
            raise ValueError(f"{name}.jsonl does not match the digest meta.json records")
        splits[name] = rows
    return splits


def consecutive_splits(rows: list[dict], sizes: dict[str, int]) -> dict[str, list[dict]]:
    """`rows` cut in order into splits of `sizes` (train, dev, test): distinct rows make disjoint splits."""
    splits, start = {}, 0
    for name, size in sizes.items():
        splits[name], start = rows[start : start + size], start + size
    return splits


def rule_accuracies(predict: Callable[[dict], object], splits: dict[str, list[dict]]) -> dict[str, float]:
    """A baseline rule's accuracy on the held-out splits (dev, test): the share of rows whose label `predict` gives."""
    return {name: sum(predict(r) == r["label"] for r in splits[name]) / max(1, len(splits[name]))
            for name in ("dev", "test")}  # fmt: skip
