"""Build DeepSpeed's JIT-compiled ops once, at set-up (`make install` runs this), not in the first DeepSpeed run.

DeepSpeed compiles CPU Adam (the optimizer ZeRO offloads to the CPU) and, on a CPU-only machine, its shared-memory
collectives with g++ the first time a process needs them: about a minute and a half on 2 cores, during which the
run prints nothing. Built here, they wait cached under torch's extensions folder (`~/.cache/torch_extensions`) for
every later run, and a first `make train-3080` or ZeRO test starts at once. DeepSpeed's own install-time build
(`DS_BUILD_CPU_ADAM=1 pip install deepspeed`) would do the same but compiles DeepSpeed from source, minutes more.

    python launch/build_ops.py        # prints what it built or found, and how long it took

A stale build lock (a build killed half-way) is named with the command that removes it, exit 1; so is an op that
fails to build (no compiler, a missing header), with the compiler's first error line (`--verbose`: all its output),
since a run that needs the op would fail the same way minutes into its start. Without DeepSpeed it says so and
exits 0: nothing is there to build.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from concept_encoder.machine.cpu_info import reuse_cpu_info  # noqa: E402
from concept_encoder.machine.extension_locks import stale_lock_message, stale_op_locks  # noqa: E402

# (builder class, op folder name): CPU Adam everywhere, the shared-memory collectives on the CPU accelerator
OPS = (("CPUAdamBuilder", "cpu_adam"), ("ShareMemCommBuilder", "deepspeed_shm_comm"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="launch/build_ops.py", description="Build DeepSpeed's CPU Adam and CPU collectives once (make install)."
    )
    parser.add_argument("--verbose", action="store_true", help="show the compiler's output")
    args = parser.parse_args(argv)
    for _, op in OPS:  # a lock nobody holds would make the build below wait forever
        if stale := stale_op_locks(op):
            print(f"error: {stale_lock_message(op, stale)}", file=sys.stderr)
            return 1
    reuse_cpu_info()  # the build asks about the CPU once, and every later run finds the answer kept
    try:
        from deepspeed.accelerator import get_accelerator
    except ImportError as error:
        print(f"DeepSpeed's ops are not built: deepspeed does not import ({error})", file=sys.stderr)
        return 0
    failures = build(get_accelerator(), verbose=args.verbose)
    for failure in failures:
        print(f"error: {failure}", file=sys.stderr)
    return 1 if failures else 0


def build(accelerator, verbose: bool = False) -> list[str]:
    """Build (or find built) each op of `OPS` that DeepSpeed's `accelerator` has; one line per op that failed,
    naming it, why, and what to do."""
    failures = []
    for name, op in OPS:
        builder = accelerator.create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            continue  # this accelerator has no such op (the shared-memory collectives are CPU-only)
        started = time.perf_counter()
        try:
            builder.load(verbose=verbose)
        except Exception as error:  # a missing compiler or header, a compile error
            failures.append(
                f"DeepSpeed's {op} op did not build ({failure_reason(error)}); install what it names (g++ and "
                "ninja: apt-get install g++ ninja-build), then rerun python launch/build_ops.py (--verbose: the "
                "compiler's output)"
            )
            continue
        print(f"DeepSpeed op {op}: ready ({time.perf_counter() - started:.0f} s)")
    return failures


def failure_reason(error: BaseException) -> str:
    """The error's type and first line, and the first later line that names an error (torch's build error
    carries the compiler's whole output), in one line."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    first_error = next((line for line in lines[1:] if "error" in line.lower()), None)
    text = ": ".join(line for line in (lines[0] if lines else "", first_error) if line)
    return f"{type(error).__name__}: {text[:300]}" if text else type(error).__name__


if __name__ == "__main__":
    from concept_encoder.common.entry import run_tool

    sys.exit(run_tool(main, "launch/build_ops.py"))
