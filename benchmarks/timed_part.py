"""One part of a benchmark run as a command with a time limit: ended with its whole process tree when the limit
passes, and its host memory measured while it runs.

`benchmarks/gpu_check.py` runs each part this way so that a part out of time frees what it held (GPU memory,
pinned host memory) before the next part starts: `concept_encoder.common.process_group` ends the part's group and
every descendant that left it (a launch in a session of its own, an orphan). The host RSS of the whole tree (the
sum over its processes, sampled every `SAMPLE_S`) stands beside every memory verdict: a run that fits a 10 GB GPU
while it holds 70 GB of host memory does not fit a machine with 32 GB.
"""

from __future__ import annotations

import dataclasses
import re
import subprocess
import threading
import time
from pathlib import Path

from concept_encoder.common import process_group

SAMPLE_S = 0.5
OUTPUT_TAIL = 3000  # characters of a part's output kept for its entry in the summary


@dataclasses.dataclass
class Outcome:
    code: int | None  # None: it ran past its limit and was ended
    output: str  # the tail of its standard output and error
    seconds: float
    host_rss_peak_gb: float  # the largest sum of its processes' RSS seen; 0.0 when it ended before the first look


class TreeRss(threading.Thread):
    """Samples the summed RSS of `process`'s tree (`process_group.tree`) until `stop()`; `peak_gb` is the largest."""

    def __init__(self, process: subprocess.Popen):
        super().__init__(daemon=True)
        self.process, self.peak_gb, self.done = process, 0.0, threading.Event()

    def run(self) -> None:
        import psutil

        while not self.done.is_set():
            total = 0
            for member in process_group.tree(self.process):
                try:
                    total += member.memory_info().rss
                except psutil.Error:  # ended between the look and the read
                    pass
            self.peak_gb = max(self.peak_gb, total / 2**30)
            self.done.wait(SAMPLE_S)

    def stop(self) -> float:
        self.done.set()
        self.join()
        return round(self.peak_gb, 3)


def run_part(command: list[str], limit_s: float, cwd: Path) -> Outcome:
    """`command` in a session of its own; past `limit_s` it is ended with every process it started, wherever
    they are (`process_group.end_group`), and its output so far is kept."""
    started = time.perf_counter()
    process = process_group.start(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = TreeRss(process)
    sampler.start()
    try:
        code, output, _ = process_group.finish(process, limit_s)
    except subprocess.TimeoutExpired:  # the whole tree is ended by now
        code, output = None, leftover_output(process)
        output += f"\nran past its {limit_s:.0f} s limit: ended with every process it started"
    finally:
        peak = sampler.stop()
    return Outcome(code, (output or "")[-OUTPUT_TAIL:], time.perf_counter() - started, peak)


def leftover_output(process: subprocess.Popen) -> str:
    """What an ended process had written: `communicate` after its timeout returns the output read so far."""
    try:
        return process.communicate(timeout=5)[0] or ""
    except (subprocess.TimeoutExpired, ValueError, OSError):  # a writer outside the tree holds the pipe open
        return ""


def error_line(output: str) -> str:
    """The line of a failed command's output that says why: the last naming an error, but not the launcher's report
    that its child failed (`CalledProcessError`, which says nothing more), else the last line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    named = [line for line in lines if re.search(r"Error|error:|Exception|out of memory", line)]
    said = [line for line in named if "CalledProcessError" not in line] or lines[-1:]
    return said[-1][:300] if said else ""
