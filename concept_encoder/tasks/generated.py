"""The cache of generated tasks (ListOps, associative recall): splits written once under
`<cache_dir>/tasks/<kind>/<key>/`, the key a digest of the generator's version, seed and settings, so a changed
setting is another entry and the same settings are read back, never generated twice."""

from __future__ import annotations

import hashlib
import json
import logging
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


def cached_splits(kind: str, key: str, task: str, meta: dict, generate: Callable[[], dict[str, list[dict]]],
                  cache_dir: str | Path = "Cache") -> dict[str, list[dict]]:  # fmt: skip
    """The splits `generate()` makes, written into `<cache_dir>/tasks/<kind>/<key>/` the first time (under a lock,
    written aside: never half a set) and read from there afterwards; a damaged entry is named and generated
    again. `meta` (the settings) is recorded in `meta.json` beside each split's digest."""
    folder = cache_path(cache_dir) / "tasks" / kind / key
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{folder}.lock"):
        if (folder / "meta.json").is_file():
            try:
                return read_splits(folder)
            except (OSError, ValueError, KeyError) as error:
                logger.warning("%s is damaged (%s): generating it again", folder, error)
        logger.info("generating %s into %s", task, folder)
        splits = generate()
        meta = {**meta, "task": task, "digests": {name: split_digest(rows) for name, rows in splits.items()}}
        with written_aside(folder, replace_existing=True) as partial:
            partial.mkdir(parents=True, exist_ok=True)
            for name, rows in splits.items():
                (partial / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            (partial / "meta.json").write_text(json.dumps(meta, indent=2))
    return splits


def read_splits(folder: Path) -> dict[str, list[dict]]:
    """The splits saved in `folder`, each checked against the digest `meta.json` records (ValueError otherwise)."""
    meta = json.loads((folder / "meta.json").read_text())
    splits = {}
    for name, digest in meta["digests"].items():
        rows = [json.loads(line) for line in (folder / f"{name}.jsonl").read_text().splitlines()]
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
