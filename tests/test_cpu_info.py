"""DeepSpeed's question about the CPU (py-cpuinfo) is asked once per machine: once per process, then from the file."""

import json

import cpuinfo
import pytest

from concept_encoder.machine import cpu_info


@pytest.fixture
def asked(monkeypatch, tmp_path):
    """py-cpuinfo's own call, counted; the kept answers under a fresh extensions folder."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    calls = []

    def ask():
        calls.append(1)
        return {"arch": "X86_64", "flags": ["avx2", "fma"], "vendor_id_raw": "GenuineIntel"}

    monkeypatch.setattr(cpuinfo, "get_cpu_info", ask)
    return calls


def test_a_process_asks_once_and_the_next_process_reads_the_kept_answer(asked, monkeypatch):
    assert cpu_info.reuse_cpu_info() and cpu_info.reuse_cpu_info()  # twice in place is once
    first = cpuinfo.get_cpu_info()
    first["flags"] = []  # a caller that edits its answer
    assert cpuinfo.get_cpu_info()["flags"] == ["avx2", "fma"] and len(asked) == 1
    kept = cpu_info.cache_file()
    assert json.loads(kept.read_text())["vendor_id_raw"] == "GenuineIntel"
    assert not [p for p in kept.parent.iterdir() if p != kept]  # no partial file left beside it

    fresh = []  # the next process: py-cpuinfo's own function again, nothing asked of it
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: fresh.append(1) or {"arch": "other"})
    cpu_info.reuse_cpu_info()
    assert cpuinfo.get_cpu_info()["arch"] == "X86_64" and not fresh


def test_a_half_written_answer_is_asked_again_and_an_unwritable_folder_only_costs_the_call(
    asked, monkeypatch, tmp_path
):
    kept = cpu_info.cache_file()
    kept.parent.mkdir(parents=True)
    kept.write_text('{"arch": "X86')  # a process killed while writing it
    cpu_info.reuse_cpu_info()
    assert cpuinfo.get_cpu_info()["arch"] == "X86_64" and len(asked) == 1
    assert json.loads(kept.read_text())["arch"] == "X86_64"

    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(blocked))  # its cpu_info/ folder cannot be made
    monkeypatch.setattr(cpuinfo, "get_cpu_info", lambda: asked.append(1) or {"arch": "X86_64"})
    cpu_info.reuse_cpu_info()
    assert cpuinfo.get_cpu_info() == {"arch": "X86_64"} and len(asked) == 2


def test_the_kept_answer_is_named_by_the_kind_of_cpu_not_its_clock(tmp_path):
    def fingerprint(flags: str, mhz: str) -> str:
        path = tmp_path / "cpuinfo"
        lines = ["processor\t: 0", "vendor_id\t: GenuineIntel", "model name\t: Some CPU", f"cpu MHz\t\t: {mhz}"]
        path.write_text("\n".join([*lines, f"flags\t\t: {flags}", ""]))
        return cpu_info.cpu_fingerprint(path)

    assert fingerprint("fpu avx2", "2200.0") == fingerprint("fpu avx2", "3100.5")  # the clock moves
    assert fingerprint("fpu avx2", "2200.0") != fingerprint("fpu avx2 avx512f", "2200.0")  # another kind of CPU
    assert cpu_info.cpu_fingerprint(tmp_path / "absent") is None
