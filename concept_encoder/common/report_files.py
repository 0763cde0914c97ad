"""Report names no two invocations share: `<prefix>_<time>` claimed by creating it exclusively.

Every tool that writes a report (`compare`, `ablate` through compare, `loops/finetune.py`, the merged
fine-tuning report, `launch/zero_compare.py`, `benchmarks/gpu_check.py`, the curve's points) asks here
for its name. Two invocations that start within the same second (or on two machines sharing the
folder) get `<prefix>_<time>` and `<prefix>_<time>_02` (names sort in the order they were claimed, so
the newest report is the last in a sorted listing: `_` sorts after the `.` of `<prefix>_<time>.json`,
where `-2` sorted before it): the claim is an exclusive create (`open(..., "x")`
for a file, `mkdir` for a folder), which the filesystem settles, not a check followed by a write.
A folder that cannot hold reports (a file in the way, read-only) is `ReportFolderError`, one line; tools call
`check_report_dir` before their work, so hours of runs are not lost to it at the end. Torch-free.
"""

from __future__ import annotations

import datetime as dt
import itertools
from pathlib import Path

from .paths import cache_path, folder_problem


class ReportFolderError(ValueError):
    """Reports cannot be written to the folder given (the message names it and why)."""


def check_report_dir(directory: str | Path, what: str = "the report folder") -> Path:
    """`directory` (a `Cache/...` path means the project's) when reports can be written there, else
    `ReportFolderError`."""
    directory = cache_path(directory)
    if problem := folder_problem(directory, what):
        raise ReportFolderError(f"{problem}; choose another folder for the reports")
    return directory


def candidates(directory: Path, prefix: str):
    base = f"{prefix}_{dt.datetime.now():%Y%m%d-%H%M%S}"
    for n in itertools.count(1):
        yield directory / (base if n == 1 else f"{base}_{n:02d}")


def claim_report_stem(directory: str | Path, prefix: str, first_suffix: str = ".md") -> Path:
    """A stem for `<stem>.md/.json/.png` that no other invocation holds: `<stem><first_suffix>` is created
    (empty) by this call, the caller writes it and its siblings."""
    directory = check_report_dir(directory)  # `Cache/reports` is the project's (paths.py)
    directory.mkdir(parents=True, exist_ok=True)
    for stem in candidates(directory, prefix):
        try:
            with open(f"{stem}{first_suffix}", "x", encoding="utf-8"):
                return stem
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def claim_report_folder(directory: str | Path, prefix: str) -> Path:
    """A folder `<directory>/<prefix>_<time>[_NN]` created by this call and by no other invocation."""
    directory = check_report_dir(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for folder in candidates(directory, prefix):
        try:
            folder.mkdir()
            return folder
        except FileExistsError:
            continue
    raise AssertionError("unreachable")
