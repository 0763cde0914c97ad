"""Benchmarks run end to end at toy sizes and their analytic FLOP counts have the right shape in N."""

import csv
import json
import sys

import pytest
import torch

from benchmarks import decode_memory, scaling, shape_memory
from concept_encoder.model.presets import PRESETS


def test_flop_model_is_linear_for_concepts_and_quadratic_for_bert():
    shape = {**PRESETS["small"], "vocab_size": 30522}
    f = {name: [scaling.flops_per_step(name, shape, 1, n) for n in (1024, 2048, 3072)] for name in scaling.MODELS}
    concept = f["concept"]
    assert concept[2] - concept[1] == pytest.approx(concept[1] - concept[0])  # affine in N
    bert = f["bert_sparse"]
    assert bert[2] - bert[1] > 1.2 * (bert[1] - bert[0])  # the N² attention term
    assert f["bert"][0] > f["bert_sparse"][0]  # the dense head decodes every position


@pytest.mark.parametrize("name", scaling.MODELS)
def test_flop_formulas_equal_the_flop_counter_of_each_models_training_step(name):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    shape = scaling.shapes("micro", 500, 512)
    model = scaling.build(name, shape)
    ids = torch.randint(5, 500, (2, 100))
    labels = torch.full_like(ids, -100)
    labels[:, :15] = ids[:, :15]  # exactly MASK_RATE · N labelled positions per sequence
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:  # attention as visible matmuls
        scaling.training_loss(name, model, ids, labels).backward()
    assert counter.get_total_flops() == scaling.flops_per_step(name, shape, 2, 100)


def test_scaling_smoke(tmp_path, capsys):
    out = tmp_path / "scaling.json"
    args = ["--preset", "micro", "--lengths", "128,256", "--repeats", "1", "--no_memory", "--vocab_size", "500"]
    assert scaling.main([*args, "--json", str(out), "--plot", str(tmp_path / "scaling.png")]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["N"] for r in rows] == [128, 256]
    for name in scaling.CONCEPT_MODELS:
        assert all(r[f"{name}_speedup_vs_bert_sparse"] > 0 and r[f"{name}_gflops"] > 0 for r in rows)
        assert all(r[f"{name}_of_bound"] == r[f"{name}_speedup_vs_bert_sparse"] / r[f"{name}_flop_bound"] for r in rows)
    assert all(r["concept_kv_gflops"] < r["concept_gflops"] for r in rows)  # keys/values once, not per layer
    verdicts = json.loads(out.read_text())["verdicts"]
    assert {(v["model"], v["N"]) for v in verdicts} == {(m, n) for m in scaling.CONCEPT_MODELS for n in (128, 256)}
    assert (tmp_path / "scaling.png").stat().st_size > 0
    assert "| N |" in capsys.readouterr().out


def test_decode_memory_smoke(tmp_path):
    out = tmp_path / "decode.json"
    args = ["--preset", "micro", "--vocab_sizes", "2000", "--batch_size", "2", "--seq_len", "64", "--repeats", "1"]
    assert decode_memory.main([*args, "--json", str(out)]) == 0  # also asserts sparse loss == dense loss
    [row] = json.loads(out.read_text())["rows"]
    assert row["vocab"] == 2000 and row["masked_positions"] > 0
    assert row["sparse_peak_gb"] >= 0 and row["dense_peak_gb"] > 0


def test_shape_memory_smoke(tmp_path, capsys):
    out = tmp_path / "shapes.json"
    argv = ["--batch_size", "2", "--shapes", "5", "--low", "9", "--high", "30", "--multiples", "0,16"]
    assert shape_memory.main([*argv, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["mixer"], r["pad_to_multiple_of"]) for r in rows] == [("none", None), ("conv", None), ("none", 16),
                                                                       ("conv", 16)]  # fmt: skip
    rounded = len(set(shape_memory.lengths_of(5, 9, 30, 16)))  # 9 to 30 tokens: 16 or 32
    assert [r["shapes"] for r in rows] == [5, 5, rounded, rounded] and rounded <= 2
    assert all(r["max_gb"] >= r["after_all_gb"] for r in rows)
    assert "| mixer | pad_to_multiple_of |" in capsys.readouterr().out


def test_bounds_table_lists_every_preset_with_its_flop_ratio(capsys):
    assert scaling.main(["--bounds", "--lengths", "512,8192"]) == 0
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("| ")]
    rows = {tuple(cell.strip() for cell in line.split("|")[1:3]): line for line in lines}
    assert set(rows) - {("preset", "token_kv_sharing")} == {(p, s) for p in PRESETS for s in ("none", "all")}
    shape = {**PRESETS["small"], "vocab_size": 30522}
    for name, sharing in scaling.TOKEN_KV_SHARING.items():
        ratio = scaling.flops_per_step("bert_sparse", shape, 1, 8192) / scaling.flops_per_step(name, shape, 1, 8192)
        assert f"{ratio:.2f}x" in rows[("small", sharing)]


def test_profile_prints_the_profiler_table_and_rejects_unknown_models(capsys):
    args = ["--preset", "micro", "--vocab_size", "500", "--lengths", "128"]
    assert scaling.main([*args, "--profile", "concept", "128"]) == 0
    assert "aten::" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown model 'gpt'; choose one of concept, concept_kv, bert, bert_sparse"):
        scaling.main([*args, "--profile", "gpt", "128"])


def test_growth_is_timed_on_one_model_at_both_lengths():
    args = scaling.parse_args(["--preset", "micro", "--vocab_size", "500", "--repeats", "3"])
    shape = scaling.shapes("micro", 500, 8192)
    growth = scaling.concept_growth(scaling.build("concept", shape), shape, args)
    assert growth > 1.5  # 8x the tokens cannot cost about the same


@pytest.mark.loop
def test_gpu_check_dry_runs_every_part_and_marks_gpu_numbers_unavailable(tmp_path, capsys):
    from benchmarks import gpu_check

    assert gpu_check.main(["--dry", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert list(summary["parts"]) == list(gpu_check.PARTS) and summary["cuda"] is False
    assert sum(gpu_check.TIME_LIMITS_S.values()) == summary["budget_s"] == 600  # ten minutes on the GPU
    for part in gpu_check.PARTS:
        entry = summary["parts"][part]
        assert entry["status"] == "ok", f"{part}: {entry.get('error')}\n{entry.get('output_tail', '')[-1500:]}"
        assert entry["gpu_numbers"].startswith("unavailable") and entry["host_rss_peak_gb"] > 0.05, (part, entry)
    parts = summary["parts"]
    # each loop's real step on the CPU: no sync in a micro-batch, one read per optimizer step (tests/test_host_syncs.py)
    assert (summary["host_syncs_per_micro_batch"], summary["host_syncs_per_optimizer_step"]) == (0, 1)
    assert parts["probe"]["result"]["math"] is True and parts["probe"]["result"]["dtype"] == "fp32"
    assert parts["loop"]["result"]["tokens_per_s"] > 0 and "mfu" not in parts["loop"]["result"]  # no peak on a CPU
    assert parts["loop"]["result"]["rank_peak_rss_gb"] > 0
    [short, long] = parts["bert"]["result"]["rows"]  # the Concept Encoder and BERT of its shape, one run
    assert (short["N"], long["N"]) == (64, 128) and short["concept_speedup_vs_bert_sparse"] > 0
    assert (
        parts["compile"]["result"]["recompiles_after_warmup"] == 0 and parts["compile"]["result"]["graph_breaks"] == 0
    )
    [run] = parts["zero"]["result"]["runs"]  # several, each written as it finishes: tests/test_gpu_check.py
    assert (run["config"], run["preset"], run["status"]) == ("zero3_offload", "micro", "ok"), run
    assert run["tokens_per_s"] > 0 and run["rss_gb"] > 0 and run["host_rss_peak_gb"] >= run["rss_gb"], run
    assert parts["zero"]["result"]["largest_that_completes"]["zero3_offload"]["preset"] == "micro"
    # the run is launch/zero_compare.py, as a user runs it: its csv, markdown and plot (once a test of its own,
    # test_zero_compare_writes_csv_markdown_and_plot, with two more runs)
    [csv_path] = (tmp_path / "zero" / "zero3_offload-micro").glob("zero_compare_*.csv")
    [row] = list(csv.DictReader(csv_path.open()))
    assert row["config"] == "zero3_offload" and row["status"] == "ok", row
    zero_markdown = csv_path.with_suffix(".md").read_text()
    assert zero_markdown.count("| zero") == 1 and "GPU columns are unavailable" in zero_markdown, zero_markdown
    assert csv_path.with_suffix(".png").stat().st_size > 10_000, "zero_compare's plot"
    markdown = (tmp_path / "summary.md").read_text()
    assert "GPU numbers are unavailable" in markdown and markdown.count("| ok |") == len(gpu_check.PARTS)
    assert markdown in capsys.readouterr().out


def test_gpu_check_peak_lookup_and_a_failing_or_unrunnable_part_does_not_stop_the_rest(tmp_path, monkeypatch):
    from benchmarks import gpu_check, gpu_parts

    assert gpu_check.peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert gpu_check.peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert gpu_check.peak_tflops("NVIDIA GeForce RTX 3080") == 59.5
    assert gpu_check.peak_tflops("Some Future GPU") is None
    broken = lambda settings, work, peak: ([sys.executable, "-c", "raise SystemExit('no kernel for you')"], None)  # noqa: E731
    monkeypatch.setitem(gpu_parts.BUILDERS, "compile", broken)
    monkeypatch.setitem(gpu_parts.PART_NEEDS, "loop", ("accelerate", "no_such_package_xyz"))  # a bare GPU image
    assert gpu_check.main(["--dry", "--out", str(tmp_path), "--parts", "compile,probe,loop"]) == 0
    parts = json.loads((tmp_path / "summary.json").read_text())["parts"]
    assert parts["compile"]["status"] == "failed" and parts["compile"]["error"] == "exit 1: no kernel for you"
    assert parts["loop"]["status"] == "cannot run" and parts["loop"]["error"].startswith(
        "needs no_such_package_xyz, which this Python"
    )
    assert "`make gpu-kit`" in parts["loop"]["error"]
    assert parts["probe"]["status"] == "ok" and parts["bert"]["status"] == parts["zero"]["status"] == "skipped"
