"""Shared benchmark plumbing: machine description, timing, peak memory, tables, JSON.

Ratios are measured in one run with interleaved repeats after warm-up (absolute times on a shared
machine are noise); peak memory is taken per configuration in a fresh subprocess, because memory a
process once held is often not returned to the system and would hide later peaks.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (CUDA {torch.version.cuda}), torch {torch.__version__}"
    return (
        f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{torch.get_num_threads()} torch threads, torch {torch.__version__}"
    )


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def configure_timing_process() -> None:
    """Run under the CPU set-up `loops/mlm.py` uses (its thread share, freed memory kept for reuse),
    so both sides of every ratio are timed as the loop would run them. Not for the peak-memory
    subprocesses: memory kept for reuse would hide their peaks."""
    from concept_encoder.training.runtime import configure_cpu_runtime

    configure_cpu_runtime()


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], object]) -> float:
    synchronize()
    start = time.perf_counter()
    fn()
    synchronize()
    return time.perf_counter() - start


def interleaved_medians(fns: dict[str, Callable[[], object]], repeats: int, warmup: int = 1) -> dict[str, float]:
    """Median seconds of each callable, run round-robin (A B C A B C ...) after `warmup` rounds."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(timed(fn))
    return {name: statistics.median(values) for name, values in samples.items()}


def peak_memory_of(run: Callable[[], object]) -> float:
    """GiB a call adds at its peak: CUDA max allocated, or on CPU the largest process RSS seen by a
    thread sampling every 0.2 ms, above the RSS before the call. (The kernel's max RSS would include
    the import-time peak of torch and friends, which can exceed a small step's peak.)"""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - before) / 2**30
    import threading

    import psutil

    process = psutil.Process()
    before = process.memory_info().rss
    peak = [before]
    done = threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.0002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        run()
    finally:
        done.set()
        sampler.join()
    peak[0] = max(peak[0], process.memory_info().rss)
    return max(0, peak[0] - before) / 2**30


def in_subprocess(script: Path, *args: str, timeout: int = 1800) -> dict:
    """Run `script --measure ...` in a fresh interpreter; it prints one JSON line last."""
    # A fixed mmap threshold makes glibc return every large tensor to the system when it is freed, so
    # RSS follows live memory and the sampler in `peak_memory_of` sees each step's own peak.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
    out = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env
    )
    if out.returncode != 0:
        raise RuntimeError(f"{script.name} {' '.join(args)} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def add_step_arguments(parser, lengths: str, repeats: int) -> None:
    """The flags of the training-step benchmarks (`scaling.py`, `compile_speed.py`): sizes and precision."""
    parser.add_argument("--full", action="store_true", help="GPU sizes: base shape, batch 8")
    parser.add_argument("--preset", default=None, help="model shape (default: small on CPU, base with --full)")
    parser.add_argument("--lengths", default=lengths, help="comma-separated sequence lengths")
    parser.add_argument("--batch_size", type=int, default=None, help="default 1 (CPU) or 8 (--full)")
    parser.add_argument("--vocab_size", type=int, default=30522)
    parser.add_argument("--repeats", type=int, default=repeats, help="timed steps of each model, interleaved")
    parser.add_argument("--precision", default=None, choices=["fp32", "bf16"], help="default bf16 on CUDA")


def resolve_step_arguments(args) -> None:
    """Defaults that depend on `--full` and the device; lengths as ints."""
    args.preset = args.preset or ("base" if args.full else "small")
    args.batch_size = args.batch_size or (8 if args.full else 1)
    args.precision = args.precision or ("bf16" if torch.cuda.is_available() else "fp32")
    args.lengths = [int(n) for n in args.lengths.split(",")]


def markdown_table(rows: list[dict], columns: list[str]) -> str:
    def fmt(value) -> str:
        if value is None:
            return "—"
        if isinstance(value, float):
            return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.0f}"
        return f"{value:,}" if isinstance(value, int) else str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def print_and_save(title: str, rows: list[dict], args) -> None:
    """A benchmark's result: its title line and rows as a markdown table on the terminal, and with `--json PATH`
    the machine, the arguments and the rows."""
    print(f"{title}\n")
    print(markdown_table(rows, list(rows[0])))
    write_json(args.json, {"machine": machine(), "args": vars(args), "rows": rows})


def write_json(path: str | None, payload: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2))
