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
from collections.abc import Callable, Iterator
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


# Written into every folder `written_aside` writes: what marks a folder as this project's, so that replacing it
# (a model folder, a cache entry, the reference model) never deletes a folder a user filled.
OWNER_MARKER = ".concept-encoder"


class NotOursError(ValueError):
    """A folder this project would replace was not written by it (or is a link or a file): refused, untouched."""


def replace_problem(target: str | Path, legacy: Callable[[Path], bool] | None = None) -> str | None:
    """Why writing a folder at `target` must not replace what is there, else None: nothing there, or a folder
    holding `OWNER_MARKER`, or one `legacy` recognises (a layout this project wrote before it marked folders)."""
    target = Path(target)
    if target.is_symlink():
        return f"{target} is a symbolic link: refusing to replace it (or what it points to); choose another path"
    if not target.exists():
        return None
    if not target.is_dir():
        return f"{target} is a file, not a folder this project wrote: refusing to replace it; choose another path"
    if (target / OWNER_MARKER).is_file() or (legacy is not None and legacy(target)):
        return None
    return (
        f"{target} holds files this project did not write (no {OWNER_MARKER} marker): refusing to replace it; "
        "choose another path, or move that folder away first"
    )


def check_replaceable(target: str | Path, legacy: Callable[[Path], bool] | None = None) -> None:
    """Raise `NotOursError` with `replace_problem`'s line; call it before expensive work writes `target`."""
    problem = replace_problem(target, legacy)
    if problem:
        raise NotOursError(problem)


@contextlib.contextmanager
def written_aside(
    target: str | Path, replace_existing: bool = False, legacy: Callable[[Path], bool] | None = None
) -> Iterator[Path]:
    """Yield `<target>.partial-<pid>`, a sibling path to write the file or folder `target` under; when the
    `with` block completes it is moved onto `target`, so no reader ever sees half of it, and when the block
    raises (a full disk, Ctrl-C) it is removed and the error propagates. A file replaces an existing one
    atomically. A folder gets `OWNER_MARKER`; an existing folder is replaced only with `replace_existing`, and
    only if this project wrote it (`replace_problem`, checked before the block and again before the move:
    otherwise `NotOursError` and nothing is touched)::

        with written_aside(run_dir / "config.json") as partial:
            partial.write_text(text)
    """
    target = Path(target)
    if replace_existing:
        check_replaceable(target, legacy)
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")  # per process: ranks may write at once
    remove_path(partial)
    try:
        yield partial
        if partial.is_dir() and not partial.is_symlink():
            (partial / OWNER_MARKER).write_text('{"written_by": "concept-encoder"}\n')
        if replace_existing and (target.is_dir() or target.is_symlink()):
            check_replaceable(target, legacy)
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


def folder_problem(folder: str | Path, what: str) -> str | None:
    """Why nothing can be written under `folder` (a file in the way, no permission, a read-only filesystem),
    else None. The nearest existing ancestor is tried with a real file (created and removed at once):
    permission bits say nothing for root or on a read-only mount."""
    import tempfile

    out = Path(folder).expanduser()
    if problem := unusable_path(out):
        return f"{what} {out}: {problem}"
    probe = out
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return f"{what} {out}: {probe} is a file, not a folder"
    try:
        with tempfile.TemporaryFile(dir=probe):
            pass
    except OSError as error:
        return f"{what} {out} is not writable (checked {probe}: {error.strerror or error})"
    return None


def unusable_path(path: str | Path) -> str | None:
    """Why the system refuses to look `path` up at all (a name longer than it allows, a NUL byte), else None:
    such a path makes `Path.exists` raise instead of answering, so every check of a user's path asks here first."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return None  # answers: the callers' own checks name them
    except (OSError, ValueError) as error:
        return f"not a usable path ({getattr(error, 'strerror', None) or error})"
    return None
