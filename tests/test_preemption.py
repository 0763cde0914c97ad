"""A launch ended from outside ends every rank: SIGTERM to `accelerate launch` (what a scheduler sends)
checkpoints each rank and marks the run preempted; a launch that times out takes its ranks with it."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from loop_runs import COMMON, ROOT, fresh_accelerate, workdir  # noqa: F401 (fixtures)

pytestmark = pytest.mark.alone  # launches ranks and waits on them against the clock

LAUNCHER_WITH_RANKS = """
import subprocess, sys, time
ranks = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"]) for _ in range(2)]
print(" ".join(str(r.pid) for r in ranks), flush=True)
time.sleep(300)
"""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    return state not in ("Z", "X")  # a zombie has ended


def test_a_timed_out_launch_ends_its_ranks_too():
    """What `subprocess.run(timeout=...)` gets wrong: it kills the launcher and orphans the ranks."""
    from concept_encoder.common import process_group

    launcher = process_group.start([sys.executable, "-c", LAUNCHER_WITH_RANKS], stdout=subprocess.PIPE, text=True)
    ranks = [int(pid) for pid in launcher.stdout.readline().split()]
    assert len(ranks) == 2 and all(pid_alive(pid) for pid in ranks)
    with pytest.raises(subprocess.TimeoutExpired):
        process_group.finish(launcher, timeout=1)
    deadline = time.time() + 10
    while any(pid_alive(pid) for pid in ranks) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(pid) for pid in ranks), "ranks outlived the timed-out launch"


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


@pytest.mark.loop
@pytest.mark.parametrize("processes", [1, 2])
def test_sigterm_to_the_launcher_checkpoints_every_rank(workdir, processes):
    """SIGTERM to `accelerate launch` (what a scheduler sends) ends with a checkpoint and no rank left."""
    from concept_encoder.common import process_group

    name = f"preempt{processes}"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes), "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(29640 + processes)]  # fmt: skip
    cmd += ["--multi_gpu"] if processes > 1 else []
    cmd += [str(ROOT / "loops/mlm.py"), *COMMON, "--output_dir", "runs", "--run_name", name, "--max_steps", "100000"]
    launcher = process_group.start(cmd, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = workdir / "runs" / name / "metrics.jsonl"
    try:
        deadline = time.time() + 240
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.time() < deadline:
            assert launcher.poll() is None, launcher.stderr.read()[-3000:]
            time.sleep(0.5)
        ranks = children_of(launcher.pid)
        assert len(ranks) >= 1
        launcher.send_signal(signal.SIGTERM)
        deadline = time.time() + 30
        while any(pid_alive(pid) for pid in ranks) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(pid_alive(pid) for pid in ranks), "a rank was still training 30 s after the SIGTERM"
    finally:
        process_group.end_group(launcher)
    summary = json.loads((workdir / "runs" / name / "summary.json").read_text())
    checkpoints = list((workdir / "runs" / name / "checkpoints").glob("step_*"))
    assert summary["preempted"] and [p.name for p in checkpoints] == [f"step_{summary['steps']:07d}"]
    if processes > 1:
        assert {p.name for p in checkpoints[0].glob("collator_rank*.pt")} == {"collator_rank0.pt", "collator_rank1.pt"}
