"""The faults a run's folder can meet, as errors with one-line messages: the folder unusable or gone, the disk full.

Plain exceptions and the full-disk check (no torch), shared by checkpoints, run folders, the metrics log and the
loops' preflight. Building the disk-full message needs the newest intact checkpoint: `checkpoint.disk_full`.
"""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path


class RunFolderError(ValueError):
    """The run folder cannot be used: another process holds it, or it holds another run's results."""


class NonFiniteLossError(RuntimeError):
    """The training loss stayed NaN/Inf: the run stops (one line) instead of training on, or reporting, NaN."""


class DiskFullError(RuntimeError):
    """No space left while saving: the message names the last intact checkpoint."""


# How a full disk shows: ENOSPC, or torch's zip writer failing mid-file ("unexpected pos", "file write failed").
DISK_FULL_TEXTS = ("No space left on device", "unexpected pos", "file write failed")


def is_disk_full(error: BaseException) -> bool:
    """ENOSPC, raised directly or wrapped (torch.save's writer reports it inside a RuntimeError)."""
    while error is not None:
        if isinstance(error, OSError) and error.errno == errno.ENOSPC or any(t in str(error) for t in DISK_FULL_TEXTS):
            return True
        error = error.__cause__ or error.__context__
    return False


def raise_run_folder_gone(run_dir: Path) -> None:
    raise RunFolderError(
        f"run folder {run_dir} disappeared while training (deleted, moved or unmounted): nothing more can be saved "
        "there; this run stops. Start it again, or resume from a copy of its checkpoints"
    )


@contextlib.contextmanager
def written_whole(paths: list[Path], what: str, hint: str = "free space, then run again"):
    """Write several files as one (a report's md/json/png): when the writing fails (or is interrupted), all of
    `paths` are removed, so no empty (a claimed name) or half-written file is left, and a full disk is one line
    (`DiskFullError`); other errors go on as they are."""
    try:
        yield
    except BaseException as error:
        for path in paths:
            path.unlink(missing_ok=True)
        if is_disk_full(error):
            raise DiskFullError(
                f"no space left on the disk of {paths[0].parent} while writing {what} (nothing of it was kept); {hint}"
            ) from error
        raise
