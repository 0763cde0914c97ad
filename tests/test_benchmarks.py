"""Benchmarks run end to end at toy sizes and their analytic FLOP counts have the right shape in N."""

import json

import pytest

from benchmarks import decode_memory, scaling
from concept_encoder.presets import PRESETS


def test_flop_model_is_linear_for_concepts_and_quadratic_for_bert():
    shape = {**PRESETS["small"], "vocab_size": 30522}
    f = {name: [scaling.flops_per_step(name, shape, 1, n) for n in (1024, 2048, 3072)] for name in scaling.MODELS}
    concept = f["concept"]
    assert concept[2] - concept[1] == pytest.approx(concept[1] - concept[0])  # affine in N
    bert = f["bert_sparse"]
    assert bert[2] - bert[1] > 1.2 * (bert[1] - bert[0])  # the N² attention term
    assert f["bert"][0] > f["bert_sparse"][0]  # the dense head decodes every position


def test_scaling_smoke(tmp_path, capsys):
    out = tmp_path / "scaling.json"
    args = ["--preset", "micro", "--lengths", "128,256", "--repeats", "1", "--no_memory", "--vocab_size", "500"]
    assert scaling.main([*args, "--json", str(out), "--plot", str(tmp_path / "scaling.png")]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["N"] for r in rows] == [128, 256]
    assert all(r["speedup_vs_bert_sparse"] > 0 and r["concept_gflops"] > 0 for r in rows)
    assert (tmp_path / "scaling.png").stat().st_size > 0
    assert "| N |" in capsys.readouterr().out


def test_decode_memory_smoke(tmp_path):
    out = tmp_path / "decode.json"
    args = ["--preset", "micro", "--vocab_sizes", "2000", "--batch_size", "2", "--seq_len", "64", "--repeats", "1"]
    assert decode_memory.main([*args, "--json", str(out)]) == 0  # also asserts sparse loss == dense loss
    [row] = json.loads(out.read_text())["rows"]
    assert row["vocab"] == 2000 and row["masked_positions"] > 0
    assert row["sparse_peak_gb"] >= 0 and row["dense_peak_gb"] > 0
