"""Build DeepSpeed's JIT-compiled ops once, at set-up (`make install` runs this), not in the first DeepSpeed run.

DeepSpeed compiles CPU Adam (the optimizer ZeRO offloads to the CPU) and, on a CPU-only machine, its shared-memory
collectives with g++ the first time a process needs them: about a minute and a half on 2 cores, during which the
run prints nothing. Built here, they wait cached under torch's extensions folder (`~/.cache/torch_extensions`) for
every later run, and a first `make train-3080` or ZeRO test starts at once. DeepSpeed's own install-time build
(`DS_BUILD_CPU_ADAM=1 pip install deepspeed`) would do the same but compiles DeepSpeed from source, minutes more.

    python launch/build_ops.py        # prints what it built or found, and how long it took

A stale build lock (a build killed half-way) is named with the command that removes it, exit 1; without
DeepSpeed or a compiler it says so and exits 0: the ops are then built on first use, or that run says why not.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run as a script from anywhere

from concept_encoder.training.cpu_info import reuse_cpu_info  # noqa: E402
from concept_encoder.training.extension_locks import stale_lock_message, stale_op_locks  # noqa: E402

# (builder class, op folder name): CPU Adam everywhere, the shared-memory collectives on the CPU accelerator
OPS = (("CPUAdamBuilder", "cpu_adam"), ("ShareMemCommBuilder", "deepspeed_shm_comm"))


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(
        prog="launch/build_ops.py", description="Build DeepSpeed's CPU Adam and CPU collectives once (make install)."
    ).parse_args(argv)
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
    for name, op in OPS:
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            continue  # this accelerator has no such op (the shared-memory collectives are CPU-only)
        started = time.perf_counter()
        try:
            builder.load(verbose=False)
        except Exception as error:  # a missing compiler or header: the run that needs the op says it again
            print(f"DeepSpeed's {op} op is not built ({type(error).__name__}: {error})", file=sys.stderr)
            continue
        print(f"DeepSpeed op {op}: ready ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    from concept_encoder.common.entry import run_tool

    sys.exit(run_tool(main, "launch/build_ops.py"))
