"""launch/zero_compare.py's host-memory guard: a run whose estimated host RAM exceeds what the machine has
available is not launched, and the report says why (no run is launched here: the launch is faked)."""

import csv

import pytest

import launch.zero_compare as zero_compare
from concept_encoder.accounting.memory import GIB


@pytest.fixture
def launches(monkeypatch):
    """The runs zero_compare would launch, each answered as a completed run; none starts."""
    started = []

    def launch_and_read(args, config, preset, run_dir, log_path, port):
        started.append((config, preset))
        return {"status": "ok", "rss_gb": 1.0, "median_step_s": 1.0, "tokens_per_s": 1.0, "final_loss": 1.0}

    monkeypatch.setattr(zero_compare, "launch_and_read", launch_and_read)
    return started


def fake_ram(monkeypatch, gib: float) -> None:
    monkeypatch.setattr(zero_compare, "host_memory_bytes", lambda field="MemAvailable": int(gib * GIB))


def report(tmp_path) -> list[dict]:
    [path] = tmp_path.glob("zero_compare_*.csv")
    with path.open() as f:
        return list(csv.DictReader(f))


def test_a_preset_beyond_the_hosts_memory_is_skipped_with_the_reason(tmp_path, monkeypatch, launches, capsys):
    fake_ram(monkeypatch, 8)  # a CPU run of 3b: ~45 GiB of model states alone
    argv = ["--configs", "zero3,zero2", "--preset", "3b", "--out_dir", str(tmp_path), "--num_processes", "2"]
    assert zero_compare.main(argv) == 0
    assert launches == []
    rows = report(tmp_path)
    assert [(r["config"], r["status"]) for r in rows] == [("zero3", "skipped"), ("zero2", "skipped")]
    assert float(rows[0]["est_host_gb"]) > 8
    assert "this machine has 8.0 GiB available (MemAvailable): not launched" in rows[0]["error"]
    assert "2 processes × (0.6 baseline + 11.4 fp32 model + " in rows[0]["error"]
    err = capsys.readouterr().err
    assert f"zero3 3b: {rows[0]['error']}" in err  # one line per skipped run


def test_find_max_stops_at_the_first_preset_the_host_cannot_hold(tmp_path, monkeypatch, launches):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # --find_max walks presets under a CUDA budget
    fake_ram(monkeypatch, 40)  # xl under optimizer offload needs ~26 GiB of host RAM, 3b ~80 GiB
    argv = ["--configs", "zero2_offload", "--find_max", "--find_max_from", "xl", "--memory_budget", "10GB",
            "--out_dir", str(tmp_path)]  # fmt: skip
    assert zero_compare.main(argv) == 0
    assert launches == [("zero2_offload", "xl")]  # 3b never launched
    [row] = report(tmp_path)
    assert row["preset"] == "xl" and row["status"] == "ok"
    assert row["note"].startswith("3b skipped: needs ~") and "this machine has 40.0 GiB available" in row["note"]
    fake_ram(monkeypatch, 4)
    assert zero_compare.main([*argv[:-1], str(tmp_path / "small_host")]) == 0
    [row] = report(tmp_path / "small_host")
    assert (row["preset"], row["status"]) == ("xl", "skipped") and "4.0 GiB available" in row["error"]
