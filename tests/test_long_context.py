"""The long-context driver (`python -m concept_encoder long_context`) on `micro` with two tiny lengths, on a
generated site-packages tree: every row it promises, its report files, reuse on a rerun, bad plans."""

import json
from pathlib import Path

import pytest
from accelerate.state import AcceleratorState, GradientState
from loop_runs import launch_in_process
from test_docstrings import write_distribution
from test_long_tasks import long_module

from concept_encoder.decide import experiments, long_context

PRETRAIN = ["--preset", "micro", "--tokenizer", "train:wordpiece:1000", "--report_to", "none", "--progress_bar",
            "false", "--per_device_train_batch_size", "4", "--logging_steps", "1", "--eval_steps", "0",
            "--save_steps", "0", "--max_eval_batches", "1", "--output_dir", "runs"]  # fmt: skip
FINETUNE = ("--max_steps 2 --eval_steps 1 --learning_rates 1e-3 --seeds 1 --per_device_train_batch_size 8 "
            "--per_device_eval_batch_size 64 --report_to none --progress_bar false")  # fmt: skip


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A tree of 36 long modules in three packages, the embedded task cut to 20 sentences a package (180 needles),
    the working folder `tmp_path`, the loops run in this process."""
    from concept_encoder.data import modules, stdlib_sentences

    monkeypatch.setattr(modules, "MIN_DOCUMENT_WORDS", 30)
    monkeypatch.setattr(stdlib_sentences, "PER_PACKAGE", 20)
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "site-packages"
    for k, name in enumerate(("alpha", "beta", "gamma")):
        write_distribution(root, name, "1.0", {f"{name}/m{i}.py": long_module(100 * k + i) for i in range(12)})
    commands = []
    monkeypatch.setattr(experiments, "run_command", launch_in_process(commands))
    yield root, commands
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def argv(root, *extra):
    return ["--lengths", "48,64", "--window", "32", "--tokens", "1536", "--full_attention_max", "48",
            "--finetune_args", f"{FINETUNE} --long_corpus modules:{root}", *extra,
            "--", *PRETRAIN, "--dataset", f"modules:{root}"]  # fmt: skip


@pytest.mark.loop
def test_the_driver_writes_every_row_and_reuses_them(site, capsys):
    root, commands = site
    assert long_context.main(argv(root)) == 0
    [report] = Path("Cache/reports").glob("long-context_*.json")
    assert {p.suffix for p in report.parent.glob(f"{report.stem}.*")} == {".md", ".json", ".png"}
    rows = json.loads(report.read_text())["rows"]
    keys = [(r["key"], r["pretrained"]) for r in rows]
    for length in (48, 64):
        for key in (f"concept-L{length}", f"bert-trunc-L{length}", f"bert-chunks-L{length}"):
            assert (key, True) in keys and (key, False) in keys  # each beside its from-scratch twin
    assert ("bert-full-L48", True) in keys and not any(k.startswith("bert-full-L64") for k, _ in keys)  # capped
    assert sum(k.startswith("concept-clock") for k, _ in keys) <= 2
    assert [k for k, _ in keys].count("tfidf-whole") == 2 and [k for k, _ in keys].count("tfidf-first") == 2
    for row in rows:
        assert {
            "model",
            "max_seq_length",
            "accuracy_mean",
            "accuracy_std",
            "train_seconds",
            "tokens_per_second",
        } <= set(row)
        assert 0 <= row["accuracy_mean"] <= 1 and row["accuracy_by_position"]  # the needle: accuracy by position
    by_key = {(r["key"], r["pretrained"]): r for r in rows}
    trunc, chunks = by_key[("bert-trunc-L64", True)], by_key[("bert-chunks-L64", True)]
    assert (trunc["max_seq_length"], chunks["max_seq_length"], chunks["chunk_length"]) == (32, 64, 32)
    assert chunks["flops_per_example"] == pytest.approx(2 * trunc["flops_per_example"])  # two windows of 32
    concept = by_key[("concept-L64", True)]
    for key in ("concept-L48", "bert-trunc-L48", "concept-L64", "bert-trunc-L64"):  # the share each reads cut
        assert 0 <= by_key[(key, True)]["validation_cut"] <= 1
    assert trunc["validation_cut"] >= concept["validation_cut"]  # 32 tokens of the same examples: more cut
    assert (
        trunc["validation_cut"] > 0
        and f"| 32 ({trunc['validation_cut']:.0%} cut) |" in report.with_suffix(".md").read_text()
    )  # BERT on its window is named as cut, wherever the reading is shorter than the example
    equal = [c for c in commands if str(experiments.MLM_SCRIPT) in c and "-clock-" not in str(c)]
    for command in equal:  # equal budgets
        steps, length = (int(command[command.index(flag) + 1]) for flag in ("--max_steps", "--max_seq_length"))
        assert steps * 4 * length == 1536
    assert 0 < concept["pretrain_tokens"] <= 1536 and 0 < trunc["pretrain_tokens"] <= 1536  # short last blocks
    assert concept["tokens_per_second"] > 0 and concept["parameters"] > 0
    assert by_key[("concept-L64", False)]["pretrain_seconds"] is None
    pretrainings = [c for c in commands if str(experiments.MLM_SCRIPT) in c]
    planned = sorted(int(c[c.index("--max_seq_length") + 1]) for c in pretrainings if "-clock-" not in str(c))
    assert planned == [32, 48, 48, 64] and all("--document_blocks" in c for c in pretrainings)  # W, L, L, full ≤ 48
    chunked = [c for c in commands if "--chunk_length" in c]
    assert chunked and all(c[c.index("--max_seq_length") + 1] in ("48", "64") for c in chunked)
    tuned = Path("Cache/long_context/long-context/finetune/runs")  # in the driver's folder, named by its --name
    assert sum(1 for _ in tuned.glob("long-context-*-seed42")) == len([r for r in rows if r["pretrained"] is not None])
    first = len(commands)
    capsys.readouterr()
    assert long_context.main(argv(root)) == 0  # everything measured: reused, nothing launched
    assert len(commands) == first and "finished earlier, reused" in capsys.readouterr().out
    assert len(list(Path("Cache/reports").glob("long-context_*.json"))) == 2


def test_bad_plans_are_refused_before_any_run(site, capsys):
    root, commands = site
    for extra, message in (
        (["--lengths", "32"], "every length must be above --window 32"),
        (["--tokens", "1k,2k"], "give one budget"),
        (["--words_per_token", "2"], "must be in \\(0, 1\\]"),
        (["--rows", "concept,bert"], "--rows 'concept,bert': \\['bert'\\] unknown; choose from"),
        (["--wall_clock", "off"], "--wall_clock: 'off' is not true or false"),
        (["--full_attention_max", "-1"], "--full_attention_max: -1 is below 0"),
    ):
        with pytest.raises(SystemExit):
            long_context.main([*argv(root)[: argv(root).index("--")], *extra, "--", *PRETRAIN])
        assert pytest.importorskip("re").search(message, capsys.readouterr().err)
    with pytest.raises(SystemExit):
        long_context.main([*argv(root), "--max_seq_length", "64"])
    assert "['--max_seq_length'] are set by the long-context driver" in capsys.readouterr().err
    assert commands == []


def test_a_task_read_at_several_lengths_gets_a_goal_line_per_length():
    from types import SimpleNamespace

    def row(key, accuracy, pretrained=True):
        return {"task": "modules_spliced", "key": key, "pretrained": pretrained, "accuracy_mean": accuracy,
                "accuracy_std": 0.01, "train_seconds": 10.0, "max_seq_length": int(key.rsplit("L", 1)[1])}  # fmt: skip

    rows = [row("concept-L2048", 0.60), row("concept-L2048", 0.50, False), row("bert-trunc-L2048", 0.55),
            row("concept-L4096", 0.52), row("bert-trunc-L4096", 0.55)]  # fmt: skip
    args = SimpleNamespace(task="modules_spliced", window=512, rows="concept,trunc", full_attention_max=2048)
    lines = long_context.goal_lines(rows, args)
    assert [line.split(":")[0] for line in lines] == [
        "`modules_spliced` at 2048 tokens",
        "`modules_spliced` at 4096 tokens",
    ]
    assert "+5.0 points (goal +3: met)" in lines[0] and "-3.0 points (goal +3: missed)" in lines[1]  # each its own
    assert long_context.goal_lines(rows[:3], args)[0].startswith(
        "`modules_spliced`: Concept Encoder 0.600"
    )  # one length
