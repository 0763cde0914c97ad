"""Where the project writes by default: one `Cache/` folder, wherever a command is started from.

`Cache/` is `$CONCEPT_ENCODER_CACHE` when set (a relative value is taken from the current folder), else
the `Cache/` of the project checkout this package runs from (the folder holding `pyproject.toml`), else
`./Cache` for an installed package. Every default path that starts with `Cache/` (runs, fine-tuning runs,
reports, curves, logs, tokenizer and dataset caches, reference models) goes through `cache_path`, so a
run started from another folder still lands in the project's `Cache/`. Torch-free.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

logger = logging.getLogger("concept_encoder")
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
OWNER_MARKER_TEXT = '{"written_by": "concept-encoder"}\n'


class NotOursError(ValueError):
    """A folder this project would replace was not written by it (or is a link or a file): refused, untouched."""


def replace_problem(target: str | Path, legacy: Callable[[Path], bool] | None = None) -> str | None:
    """Why writing a folder at `target` must not replace what is there, else None: nothing there, or a folder
    holding `OWNER_MARKER`, or one `legacy` recognises (a layout this project wrote before it marked folders)."""
    target = Path(target)
    if dangling := dangling_link_problem(target):
        return f"{dangling}; remove the link or choose another path"
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


def dangling_link_problem(path: str | Path) -> str | None:
    """The line "<path> is a dangling symbolic link to <where>" when `path` is a link to nothing, else None: such a path
    neither exists nor can be created (writing through it would create its target elsewhere), and "does not exist"
    or "exists" would both mislead the user who typed it."""
    path = Path(path)
    if not path.is_symlink() or path.exists():
        return None
    return f"{path} is a dangling symbolic link to {os.readlink(path)}"


@contextlib.contextmanager
def written_aside(
    target: str | Path,
    replace_existing: bool = False,
    legacy: Callable[[Path], bool] | None = None,
    replaceable: Callable[[Path], str | None] | None = None,
    sweep_stale: bool = False,
) -> Iterator[Path]:
    """Yield `<target>.partial-<pid>`, a sibling path to write the file or folder `target` under; when the
    `with` block completes it is moved onto `target`, so no reader ever sees half of it, and when the block
    raises (a full disk, Ctrl-C) it is removed and the error propagates. A file replaces an existing one
    atomically. A folder gets `OWNER_MARKER`; an existing folder is replaced only with `replace_existing`, and
    only if this project wrote it (`replace_problem`, or the caller's own rule `replaceable`: a problem line or
    None; checked before the block and again before the move: otherwise `NotOursError` and nothing is touched).
    The old folder is renamed aside before the new one moves in and removed after, so a failed move puts it back.
    `sweep_stale` first removes the partial copies of `target` that processes no longer alive left (killed while
    writing: no `except` ran); only for single-host tools, since a pid says nothing of another host's processes::

        with written_aside(run_dir / "config.json") as partial:
            partial.write_text(text)
    """
    target = Path(target)
    problem = replaceable or (lambda folder: replace_problem(folder, legacy))
    if replace_existing:
        check_replaceable_by(target, problem)
    if sweep_stale:
        remove_stale_partials(target)
    partial = partial_path(target, os.getpid())  # per process: ranks may write at once
    remove_path(partial)
    try:
        yield partial
        if partial.is_dir() and not partial.is_symlink():
            (partial / OWNER_MARKER).write_text(OWNER_MARKER_TEXT)
        if replace_existing and (target.is_dir() or target.is_symlink()):
            check_replaceable_by(target, problem)
            replace_folder(partial, target)
        else:
            os.replace(partial, target)
    except BaseException:  # the block or the move failed: no partial copy is left behind
        remove_path(partial)
        raise


def check_replaceable_by(target: Path, problem: Callable[[Path], str | None]) -> None:
    """Raise `NotOursError` with `problem(target)`'s line, when there is one."""
    if line := problem(target):
        raise NotOursError(line)


def partial_path(target: Path, pid: int) -> Path:
    """Where process `pid` writes `target` aside: `<target>.partial-<pid>`, from a thread other than the main one
    `<target>.partial-<pid>-t<its id>` (a driver's `--jobs` may write the same file from two threads at once)."""
    return target.with_name(f"{target.name}.partial-{pid}{thread_part()}")


def thread_part() -> str:
    """`-t<native thread id>` in a thread other than the main one, else nothing: what tells two threads' copies
    apart."""
    import threading

    return "" if threading.current_thread() is threading.main_thread() else f"-t{threading.get_native_id()}"


def replace_folder(new: Path, target: Path) -> None:
    """Move the folder `new` onto the folder `target`: `target` is renamed aside first (never deleted before `new`
    is in place: a failure puts it back) and removed, without following links, once `new` is there."""
    aside = target.with_name(f"{target.name}.replaced-{os.getpid()}{thread_part()}")
    remove_path(aside)
    os.rename(target, aside)
    try:
        os.replace(new, target)
    except BaseException:
        os.rename(aside, target)
        raise
    remove_path(aside)


def process_alive(pid: int) -> bool:
    """Whether a process `pid` runs on this host (another user's, which this one may not signal, counts too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def remove_stale_partials(target: Path) -> list[Path]:
    """Remove the `<target>.partial-<pid>` files and folders (`-t<thread>` after the pid: a thread's) whose process
    is gone (a writer killed by SIGKILL or an unhandled SIGTERM runs no cleanup), without following links; a live
    process's copy is left alone. Returns what was removed (one log line each)."""
    pattern = re.compile(re.escape(f"{target.name}.partial-") + r"([0-9]+)(-t[0-9]+)?")  # a thread's too
    removed = []
    with contextlib.suppress(OSError):
        for entry in sorted(target.parent.iterdir()):
            match = pattern.fullmatch(entry.name)
            if match and int(match[1]) > 0 and int(match[1]) != os.getpid() and not process_alive(int(match[1])):
                remove_path(entry)
                logger.warning("removed %s, left by process %s, which no longer runs", entry, match[1])
                removed.append(entry)
    return removed


def remove_path(path: Path) -> None:
    """Remove a file or folder tree if it exists. A symbolic link is unlinked, never followed: what it points to is
    untouched (and `shutil.rmtree` unlinks the links inside a tree it removes)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def remove_below(path: str | Path, root: str | Path) -> None:
    """Remove `path`, a folder this project made under `root`, following no link on the way: when a component
    between `root` and `path` is a link (or a file), that link is unlinked instead, and nothing it points to is
    touched (`shutil.rmtree(path)` would remove the contents of the folder the link names)."""
    path, current = Path(path), Path(root)
    for part in path.relative_to(root).parts:
        current = current / part
        if current.is_symlink() or current.exists() and not current.is_dir():
            current.unlink()
            return
    remove_path(path)


def fresh_folder(path: str | Path, root: str | Path) -> Path:
    """An empty new folder at `path` under `root`, whatever was there (`remove_below`: links unlinked, not
    followed), with real folders, not links, on the way from `root`."""
    remove_below(path, root)
    Path(path).mkdir(parents=True)
    return Path(path)


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
