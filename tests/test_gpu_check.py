"""`benchmarks/gpu_check.py`'s parts under their time limits: a part out of time leaves no process behind (also
one in a session of its own), and the zero part's finished runs are in the summary as they finish and after the
part runs out of time. (The dry run of every part: tests/test_benchmarks.py.)"""

import json
import sys
import textwrap

import psutil
import pytest

from benchmarks.timed_part import run_part

# A part that starts a launch of its own in a session of its own (as launch/zero_compare.py does) and prints its pid
SPAWNER = textwrap.dedent("""
    import subprocess, sys, time
    launch = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(launch.pid, flush=True)
    if sys.argv[1] == "waits":
        time.sleep(120)
""")


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.parametrize("leader", ["waits", "exits"])
def test_no_process_of_a_part_survives_it_not_even_one_in_a_session_of_its_own(tmp_path, leader):
    """`waits`: the part runs past its limit; `exits`: it ends at once, its launch orphaned. Either way the launch,
    in a session of its own (which `killpg` on the part's group misses), is ended with the part."""
    outcome = run_part([sys.executable, "-c", SPAWNER, leader], limit_s=3, cwd=tmp_path)
    launch = int(outcome.output.split()[0])
    assert not alive(launch), f"the part's launch (pid {launch}) outlived it"
    if leader == "waits":
        assert outcome.code is None and "ran past its 3 s limit" in outcome.output
        assert outcome.host_rss_peak_gb > 0.005  # two Python processes, summed
    else:
        assert outcome.code == 0 and outcome.seconds < 3


def test_the_zero_part_writes_each_run_as_it_finishes_and_keeps_them_when_its_time_runs_out(tmp_path, monkeypatch):
    from benchmarks import gpu_check, gpu_parts

    def zero_command(settings, work, cuda, config, preset, limit_s, index):
        """The first run writes zero_compare's csv; the second copies the summary as it stands, then hangs."""
        folder = work / "zero" / f"{config}-{preset}"
        csv_text = f"config,preset,status,tokens_per_s,rss_gb\n{config},{preset},ok,123.5,0.5\n"
        if index == 0:
            code = f"import pathlib; p = pathlib.Path({str(folder)!r}); p.mkdir(parents=True); "
            code += f"(p / 'zero_compare_1.csv').write_text({csv_text!r})"
        else:
            code = f"import shutil, time; shutil.copy({str(work / 'summary.json')!r}, {str(work / 'seen.json')!r}); "
            code += "time.sleep(120)"
        return [sys.executable, "-c", code]

    monkeypatch.setattr(gpu_parts, "zero_command", zero_command)
    runs = (("zero2_offload", "micro"), ("zero3_offload", "micro"), ("zero2_offload", "xl"))
    monkeypatch.setitem(gpu_parts.ZERO_RUNS, False, runs)  # xl: a larger preset, started only with its whole limit
    monkeypatch.setattr(gpu_parts, "MIN_RUN_S", 1)
    monkeypatch.setattr(gpu_check, "MIN_PART_S", 1)
    assert gpu_check.main(["--dry", "--out", str(tmp_path), "--parts", "zero", "--budget_s", "4"]) == 0
    seen = json.loads((tmp_path / "seen.json").read_text())["parts"]["zero"]  # written after the first run
    assert seen["status"] == "running" and [r["status"] for r in seen["result"]["runs"]] == ["ok"]
    entry = json.loads((tmp_path / "summary.json").read_text())["parts"]["zero"]
    assert entry["status"] == "timed out" and "the runs that finished are kept" in entry["error"]
    first, second, third = entry["result"]["runs"]
    assert (first["status"], first["tokens_per_s"], second["status"]) == ("ok", 123.5, "timed out")
    assert third["status"] == "skipped" and third["error"] == "needs up to 110 s; 0 s of the part's time left"
    assert first["parameters"] > 0 and "host_rss_peak_gb" in first
    assert entry["result"]["largest_that_completes"]["zero2_offload"]["preset"] == "micro"
    summary = (tmp_path / "summary.md").read_text()
    assert "| zero | timed out |" in summary and "zero2_offload micro (0.7M): ok" in summary, summary
