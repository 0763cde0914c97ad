"""Stale build locks of torch's JIT-compiled extensions (DeepSpeed's CPU Adam), found before they hang a run.

torch builds an extension under `<torch_extensions>/<py>_<cpu|cuXY>/<op>/` holding a `lock` file
(`torch.utils.file_baton.FileBaton`): created with O_EXCL and kept open by its owner until the build
or load is done, then removed. A process killed in between leaves the file behind, and every later
load of that op then waits for it forever, silently. A lock that no process holds open has no live
owner: that is the test here (torch-free, so the plan checker can run it too).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


class StaleLockError(RuntimeError):
    """A JIT-built op's lock file has no live owner: loading the op would hang."""


def extensions_root() -> Path:
    """Where torch puts JIT-built extensions (`TORCH_EXTENSIONS_DIR`, else the user cache)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "torch_extensions"


def op_lock_files(op: str) -> list[Path]:
    """Existing `lock` files of `op` under this Python's build folders (any CPU/CUDA flavour)."""
    root = extensions_root()
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    candidates = [root / op / "lock", *root.glob(f"{python}_*/{op}/lock")]
    return [path for path in candidates if path.exists()]


def has_live_owner(lock: Path) -> bool:
    """Whether any process on this machine (that we may inspect) holds `lock` open."""
    target = str(lock.resolve())
    for fd_dir in Path("/proc").glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                if os.readlink(fd) == target:
                    return True
        except OSError:  # the process ended, or is not ours to inspect
            continue
    return False


def stale_op_locks(op: str, settle_s: float = 1.0) -> list[Path]:
    """`op`'s lock files with no live owner, confirmed after `settle_s` (an owner closes its file an
    instant before removing it)."""
    suspects = [lock for lock in op_lock_files(op) if not has_live_owner(lock)]
    if suspects and settle_s:
        time.sleep(settle_s)
        suspects = [lock for lock in suspects if lock.exists() and not has_live_owner(lock)]
    return suspects


def stale_lock_message(op: str, locks: list[Path]) -> str:
    paths = " ".join(str(lock) for lock in locks)
    return (
        f"DeepSpeed's {op} op is locked by {paths}, which no process holds (left by a run interrupted while "
        f"the op was being built or loaded); every run would wait on it forever. Remove it: rm {paths}"
    )
