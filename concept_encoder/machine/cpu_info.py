"""py-cpuinfo's answer about this machine's CPU, asked once per machine instead of several times per process.

DeepSpeed calls `cpuinfo.get_cpu_info()` whenever it loads one of its JIT ops (the architecture and SIMD
width for the compile flags of CPU Adam and, on a CPU-only machine, the shared-memory collectives) and
when CPU Adam is created (the vendor, for a warning): 2 to 4 calls in every rank of a DeepSpeed run. Each
call starts py-cpuinfo afresh in a Python subprocess that probes CPUID and times the clock, about a second
on 2 cores, so a rank of an offloaded run spent ~4 s of its start asking the same question (measured with
py-spy on a 1-process `zero2_offload` launch: 4.7 s of its 25 s of CPU time).

`reuse_cpu_info()` (step 1 of each loop, and `launch/build_ops.py` at `make install`) replaces
`cpuinfo.get_cpu_info` with a version that answers from this process's first answer, and that first answer
from a JSON file beside the JIT-built ops (`<torch_extensions>/cpu_info/<fingerprint>.json`, written by the
first process that asks). The file is named by a hash of what tells CPUs apart (`/proc/cpuinfo`'s vendor,
model and flags, the machine type, py-cpuinfo's version), so a home folder shared by nodes of different CPUs
keeps one answer per kind of CPU. An unreadable or unwritable file only costs the one call it would have
saved. DeepSpeed imports `get_cpu_info` from the module at each call, so replacing the module's attribute
is enough; nothing else of py-cpuinfo changes.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import platform
from pathlib import Path

from ..common.paths import written_aside
from .extension_locks import extensions_root

IDENTIFYING_FIELDS = ("vendor_id", "model name", "flags", "Features", "CPU implementer", "CPU part", "isa")


def cpu_fingerprint(proc_cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """A short hash of what identifies this kind of CPU, or None where `/proc/cpuinfo` cannot be read."""
    try:
        lines = proc_cpuinfo.read_text(errors="ignore").splitlines()
    except OSError:
        return None
    identifying = sorted({line.strip() for line in lines if line.split(":")[0].strip() in IDENTIFYING_FIELDS})
    try:
        cpuinfo_version = importlib.metadata.version("py-cpuinfo")
    except importlib.metadata.PackageNotFoundError:  # not installed as a distribution
        cpuinfo_version = "unknown"
    text = "\n".join([platform.machine(), cpuinfo_version, *identifying])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def cache_file() -> Path | None:
    """Where this machine's answer is kept, or None when the CPU cannot be identified."""
    fingerprint = cpu_fingerprint()
    return None if fingerprint is None else extensions_root() / "cpu_info" / f"{fingerprint}.json"


def reuse_cpu_info() -> bool:
    """Make `cpuinfo.get_cpu_info()` ask py-cpuinfo at most once per machine. Returns whether it is in place
    (False without py-cpuinfo, which DeepSpeed then does without as well)."""
    try:
        import cpuinfo
    except ImportError:
        return False
    if getattr(cpuinfo.get_cpu_info, "asks_once", False):
        return True
    ask = cpuinfo.get_cpu_info

    @functools.cache
    def answer() -> dict:
        path = cache_file()
        if path is not None:
            try:
                kept = json.loads(path.read_text())
                if isinstance(kept, dict) and kept:
                    return kept
            except (OSError, ValueError):
                pass  # not written yet, or half-written by a killed process: ask again
        info = ask()
        if path is not None and info:
            keep(path, info)
        return info

    def get_cpu_info() -> dict:
        return dict(answer())  # a copy: a caller that edits it cannot change the next caller's answer

    get_cpu_info.asks_once = True
    get_cpu_info.__doc__ = ask.__doc__
    cpuinfo.get_cpu_info = get_cpu_info
    return True


def keep(path: Path, info: dict) -> None:
    """Write `info` as JSON at `path`, whole or not at all (`written_aside`: two ranks asking at once both write
    the same answer); a folder that cannot be written is left alone."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with written_aside(path) as partial:
            partial.write_text(json.dumps(info, default=str))
    except OSError:
        pass
