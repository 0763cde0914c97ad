"""Where the project writes by default: one `Cache/` folder, wherever a command is started from.

`Cache/` is `$CONCEPT_ENCODER_CACHE` when set (a relative value is taken from the current folder), else
the `Cache/` of the project checkout this package runs from (the folder holding `pyproject.toml`), else
`./Cache` for an installed package. Every default path that starts with `Cache/` (runs, fine-tuning runs,
reports, curves, logs, tokenizer and dataset caches, reference models) goes through `cache_path`, so a
run started from another folder still lands in the project's `Cache/`. Torch-free.
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "CONCEPT_ENCODER_CACHE"
PROJECT_ROOT = Path(__file__).resolve().parents[1]


def cache_root() -> Path:
    """The project's `Cache/` (see the module docstring)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    return PROJECT_ROOT / "Cache" if (PROJECT_ROOT / "pyproject.toml").is_file() else Path("Cache")


def cache_path(path: str | Path) -> Path:
    """`path` with a leading `Cache` component moved to `cache_root()`; any other path unchanged."""
    path = Path(path)
    if path.is_absolute() or not path.parts or path.parts[0] != "Cache":
        return path
    return cache_root().joinpath(*path.parts[1:])
