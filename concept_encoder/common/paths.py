"""Where the project writes by default: one `Cache/` folder, wherever a command is started from.

`Cache/` is `$CONCEPT_ENCODER_CACHE` when set (a relative value is taken from the current folder), else
the `Cache/` of the project checkout this package runs from (the folder holding `pyproject.toml`), else
`./Cache` for an installed package. Every default path that starts with `Cache/` (runs, fine-tuning runs,
reports, curves, logs, tokenizer and dataset caches, reference models) goes through `cache_path`, so a
run started from another folder still lands in the project's `Cache/`. Torch-free.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

CACHE_ENV = "CONCEPT_ENCODER_CACHE"
PROJECT_ROOT = Path(__file__).resolve().parents[2]  # concept_encoder/common/paths.py → the checkout


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


@contextlib.contextmanager
def written_aside(target: str | Path, replace_existing: bool = False) -> Iterator[Path]:
    """Yield `<target>.partial-<pid>`, a sibling path to write the file or folder `target` under; when the
    `with` block completes it is moved onto `target`, so no reader ever sees half of it, and when the block
    raises (a full disk, Ctrl-C) it is removed and the error propagates. A file replaces an existing one
    atomically; an existing folder is replaced only with `replace_existing` (else the move fails on it)::

        with written_aside(run_dir / "config.json") as partial:
            partial.write_text(text)
    """
    target = Path(target)
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")  # per process: ranks may write at once
    remove_path(partial)
    try:
        yield partial
        if replace_existing and target.is_dir():
            shutil.rmtree(target)
        os.replace(partial, target)
    except BaseException:  # the block or the move failed: no partial copy is left behind
        remove_path(partial)
        raise


def remove_path(path: Path) -> None:
    """Remove a file or folder tree if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
