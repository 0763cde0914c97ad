"""`make recall` (decide/recall.py): the capacity map on a tiny grid writes every cell, main cells get their seeds
and the others one, a second invocation reuses every cell, and bad plans are refused before any run."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from loop_runs import TwoAtATime, in_process  # noqa: F401 (fixture)

from concept_encoder.data.tokenizer import load_tokenizer
from concept_encoder.decide import experiments, recall
from concept_encoder.training.runtime import usable_cores

TINY = ["--pairs", "2,3", "--concepts", "4", "--main_concepts", "4", "--main_pairs", "2", "--seeds", "2",
        "--train", "200", "--finetune_args", "--max_steps 2 --learning_rates 1e-3 --eval_steps 1 "
        "--per_device_train_batch_size 8 --per_device_eval_batch_size 50 --report_to none --progress_bar false"]  # fmt: skip


@pytest.mark.loop
def test_the_map_on_a_tiny_grid_writes_every_cell_and_reuses_them(in_process, capsys, monkeypatch):
    assert recall.main([*TINY, "--report_only"]) == 1  # nothing finished: nothing to report, nothing run
    assert "no cell of map 'recall'" in capsys.readouterr().err and in_process == []
    assert not Path("Cache/recall/recall-K2").exists()
    assert recall.main([*TINY, "--archive", "kept"]) == 0  # each finished point copied to kept/ too
    kept = sorted(p.relative_to("kept") for p in Path("kept").rglob("*") if p.is_file())
    assert kept == [
        Path(f"recall-K{k}/{name}")
        for k in (2, 3)
        for name in ("points/C4-conv.json", "points/C4-none.json", "points/bert.json", "request.json")
    ]
    assert all(Path("kept", p).read_bytes() == Path("Cache/recall", p).read_bytes() for p in kept)
    [report] = Path("Cache/reports").glob("recall_*.json")
    assert {p.suffix for p in report.parent.glob(f"{report.stem}.*")} == {".md", ".json", ".png"}
    data = json.loads(report.read_text())
    first = [(r["pairs"], r["key"], r["seeds"], r["accuracy"]) for r in data["rows"]]  # what kept/ restores
    cells = [(r["pairs"], r["key"]) for r in data["rows"]]
    assert cells == [(k, c) for k in (2, 3) for c in ("C4-none", "C4-conv", "bert")]
    for row in data["rows"]:
        assert len(row["seeds"]) == (2 if row["pairs"] == 2 else 1) and row["main"] == (row["pairs"] == 2)
        assert 0 <= row["accuracy"] <= 1 and row["cell_seconds"] >= 0 and row["runs"] == len(row["seeds"])
        assert row["no_binding_line"] == data["lines"][str(row["pairs"])]
    mixed = json.loads(Path("Cache/recall/recall-K2/models/C4-conv/config.json").read_text())
    plain = json.loads(Path("Cache/recall/recall-K2/models/C4-none/config.json").read_text())
    assert (mixed["local_mixer"], plain["local_mixer"], mixed["concept_num"]) == ("conv", "none", 4)
    assert json.loads(Path("Cache/recall/recall-K3/models/bert/config.json").read_text())["model_type"] == "bert"
    tasks = {c[c.index("--task") + 1] for c in in_process}
    assert tasks == {"recall:2:64:16:200", "recall:3:64:16:200"}
    assert all("--from_scratch" in c and c[c.index("--pooling") + 1] == "mean" for c in in_process)
    markdown = report.with_suffix(".md").read_text()
    assert "| no-binding line |" in markdown and "K=3" in markdown and "## Goals" in markdown
    for k in (2, 3):  # TF-IDF + linear beside the map: each K's fit, as its points hold it
        base = json.loads(Path(f"Cache/recall/recall-K{k}/points/bert.json").read_text())["baselines"]
        assert data["tfidf"][str(k)] == base[f"recall:{k}:64:16:200"]["tfidf"]["validation"]["accuracy"]
    tfidf_row = next(line for line in markdown.splitlines() if line.startswith("| TF-IDF"))
    assert (
        tfidf_row
        == "| TF-IDF (word 1-2 grams) + linear | "
        + " | ".join(f"{100 * data['tfidf'][k]:.2f}" for k in ("2", "3"))
        + " |"
    )
    assert any("BERT solves" in g for g in data["goals"]) and any("C=4, mixer conv: " in g for g in data["goals"])
    launched = len(in_process)
    capsys.readouterr()
    so_far = [*TINY, "--report_only"]
    so_far[so_far.index("--pairs") + 1] = "2,3,4"
    so_far[so_far.index("--concepts") + 1] = "4,5"  # a width not run yet: its row shows, empty
    so_far[so_far.index("--seeds") + 1] = "3"  # K=2's main cells were measured with 2 seeds: not this request's
    request = Path("Cache/recall/recall-K2/request.json").read_bytes()
    assert recall.main(so_far) == 0 and len(in_process) == launched  # the finished cells reported, nothing run
    assert (
        not Path("Cache/recall/recall-K4").exists()
        and Path("Cache/recall/recall-K2/request.json").read_bytes() == request
    )
    [partial] = sorted(Path("Cache/reports").glob("recall_*.json"), key=lambda p: p.stat().st_mtime_ns)[-1:]
    data = json.loads(partial.read_text())
    assert [(r["pairs"], r["key"]) for r in data["rows"]] == [(3, c) for c in ("C4-none", "C4-conv", "bert")]
    every = ["C=4, none", "C=4, conv", "C=5, none", "C=5, conv", "BERT"]
    assert data["cells"] == 15 and data["not_measured"] == {"2": every, "3": ["C=5, none", "C=5, conv"], "4": every}
    markdown = partial.with_suffix(".md").read_text()
    assert (
        "| K=2 | K=3 | K=4 |" in markdown
        and "| C=4, none | - | " in markdown
        and "| C=5, conv | - | - | - |" in markdown
    )
    assert ("**The map so far: 3 of 15 cells.** Not measured yet: K=2: every cell; K=3: C=5, none, C=5, conv; "
            "K=4: every cell.") in markdown  # fmt: skip
    assert recall.main(TINY) == 0  # every cell measured: reused, nothing launched
    assert len(in_process) == launched and capsys.readouterr().out.count("finished earlier, reused") == 6
    runs = set(Path("Cache/finetune").iterdir())
    seeds = TINY.index("--seeds") + 1
    assert recall.main([*TINY[:seeds], "3", *TINY[seeds + 1 :]]) == 0  # more seeds: the main cells' new seed only
    out = capsys.readouterr().out
    assert (
        out.count("finished earlier, reused") == 3 and out.count("(fine-tuning arguments: then ['--seeds', '2',") == 3
    )
    assert len(in_process) == launched + 3
    assert sorted(p.name[-6:] for p in set(Path("Cache/finetune").iterdir()) - runs) == ["seed44"] * 3
    [report] = sorted(Path("Cache/reports").glob("recall_*.json"), key=lambda p: p.stat().st_mtime_ns)[-1:]
    assert [len(r["seeds"]) for r in json.loads(report.read_text())["rows"]] == [3, 3, 3, 1, 1, 1]
    request = Path("Cache/recall/recall-K2/request.json")  # as the driver recorded it before points checked seeds
    request.write_text(json.dumps({**json.loads(request.read_text()), "cells": ["C4-none", "C4-conv", "bert"]}))
    wider = [*TINY[:seeds], "3", *TINY[seeds + 1 :]]
    wider[wider.index("--concepts") + 1] = "4,5"  # the map grows by a width under its name: only its cells run
    assert recall.main(wider) == 0
    assert capsys.readouterr().out.count("finished earlier, reused") == 6 and len(in_process) == launched + 3 + 4
    assert "cells" not in json.loads(request.read_text())
    measured = [(r["pairs"], r["key"], r["accuracy"]) for r in json.loads(sorted(Path("Cache/reports").glob(
        "recall_*.json"), key=lambda p: p.stat().st_mtime_ns)[-1].read_text())["rows"]]  # fmt: skip
    for points in Path("Cache/recall").glob("recall-K*/points"):
        shutil.rmtree(points)  # every cell measured again, --jobs 2: the launches' reports are rewritten as they were
    monkeypatch.setenv("CPU_THREADS", "")  # recorded, so that whatever the test leaves is undone
    monkeypatch.delenv("CPU_THREADS")
    launches = TwoAtATime(experiments.run_command)
    monkeypatch.setattr(experiments, "run_command", launches)
    assert recall.main([*wider, "--jobs", "2"]) == 0
    assert "--jobs 2: cells measured 2 at a time" in capsys.readouterr().out
    assert len(launches.most) == 10 and max(launches.most) == 2  # two cells at once, never more
    assert set(launches.threads) == {str(max(1, usable_cores() // 2))}  # the cores split between the two launches
    [report] = sorted(Path("Cache/reports").glob("recall_*.json"), key=lambda p: p.stat().st_mtime_ns)[-1:]
    assert [(r["pairs"], r["key"], r["accuracy"]) for r in json.loads(report.read_text())["rows"]] == measured
    shutil.rmtree("Cache/recall")  # a fresh machine: the map's points only in the archive
    launched = len(in_process)
    assert recall.main([*TINY, "--archive", "kept", "--report_only"]) == 0 and len(in_process) == launched
    assert capsys.readouterr().out.count("restored from kept/recall-K") == 2
    [report] = sorted(Path("Cache/reports").glob("recall_*.json"), key=lambda p: p.stat().st_mtime_ns)[-1:]
    assert [(r["pairs"], r["key"], r["seeds"], r["accuracy"]) for r in json.loads(report.read_text())["rows"]] == first


def test_bad_plans_are_refused_before_any_run(in_process, capsys):
    for extra, message in (
        (["--pairs", "4,4"], "distinct"),
        (["--pairs", "4,x"], "--pairs '4,x': give distinct comma-separated whole numbers"),
        (["--mixers", "attention"], "unknown"),
        (["--architectures", "gpt"], "--architectures 'gpt': ['gpt'] unknown; choose from ('concept', 'bert')"),
        (["--preset", "huge"], "unknown"),
        (["--finetune_args", "--seeds 2"], "set by the recall driver"),
        (["--pairs", "8", "--values", "1"], "values"),
        (["--pairs", "8", "--train", "10"], "--train: 10 is below 100"),
        (["--pairs", "8", "--keys", "0"], "--keys: 0 is below 1"),
        (["--pairs", "8", "--", "--preset", "tiny"], "the recall driver pretrains nothing"),
        (["--pairs", "8", "--finetune_args", "--max_seq_length 20"], "['--max_seq_length'] are set by the recall"),
        (["--pairs", "8", "--finetune_args", "--task recall:4"], "['--task'] are set by the recall driver"),
        (["--pairs", "8", "--finetune_args", "--max_steps '3"], '--finetune_args "--max_steps \'3": No closing'),
        (["--concepts", "16,64", "--main_concepts", "61"], "--main_concepts: [61] not in --concepts 16,64"),
        (["--pairs", "4,8", "--main_pairs", "8,16"], "--main_pairs: [16] not in --pairs 4,8"),
        (["--placements", "first,last"], "--placements 'first,last': ['last'] unknown; choose from ('first', 'every')"),
        (["--mixers", "none", "--placements", "every"], "but --mixers is none; add conv to --mixers"),
    ):
        with pytest.raises(SystemExit):
            recall.main(extra)
        assert message in capsys.readouterr().err
    assert in_process == []  # nothing launched


def test_a_refused_k_leaves_no_request_recorded_for_the_others(in_process, capsys):
    earlier = Path("Cache/recall/recall-K3")
    earlier.mkdir(parents=True)
    (earlier / "request.json").write_text(json.dumps({"task": "recall:3:64:16:200", "preset": "tiny"}))
    with pytest.raises(SystemExit):
        recall.main(TINY)  # K=3 was measured under another preset: refused
    err = capsys.readouterr().err
    assert "map recall-K3 (" in err and "preset: the map's 'tiny', this invocation's 'micro'" in err
    assert not Path("Cache/recall/recall-K2").exists() and in_process == []  # K=2 checked first, recorded nothing


def test_the_main_cells_default_to_those_the_map_plans_and_long_examples_size_the_runs():
    args = recall.build_parser().parse_args(["--pairs", "64,2,8", "--concepts", "16,32"])  # run K ascending
    recall.check_arguments(args)
    assert (args.main_pair_list, args.main_concept_list) == ([8], [16])  # the defaults this map plans
    assert [(c.pairs, c.concept_num, c.seeds) for c in recall.cells(args) if c.mixer == "conv"] == [
        (2, 16, 1), (2, 32, 1), (8, 16, 3), (8, 32, 1), (64, 16, 1), (64, 32, 1)]  # fmt: skip
    # the placement axis: the mixer once and before every layer, one cell each; no mixer has no placement
    args = recall.build_parser().parse_args(["--pairs", "8", "--concepts", "64", "--placements", "first,every"])
    recall.check_arguments(args)
    assert [(c.key, c.label, c.seeds) for c in recall.cells(args) if c.architecture == "concept"] == [
        ("C64-none", "Concept Encoder C=64", 3), ("C64-conv", "Concept Encoder C=64, local mixer", 3),
        ("C64-conv-every", "Concept Encoder C=64, local mixer before every layer", 3)]  # fmt: skip
    assert recall.sized_argv(["--max_steps", "9"], 62) == ["--max_steps", "9"]  # 128 tokens: the default holds it
    assert recall.sized_argv(["--max_steps", "9"], 63) == ["--max_steps", "9", "--max_seq_length", "130"]
    # the default training size, named or not, is one task (one request, one set of points)
    args = recall.build_parser().parse_args(["--train", "20000"])
    assert (
        recall.task_name(4, args) == "recall:4"
        and recall.task_name(4, recall.build_parser().parse_args([])) == "recall:4"
    )


def test_goals_name_where_the_map_falls_short():
    def row(pairs, concepts, mixer, accuracy, architecture="concept"):
        return {"pairs": pairs, "concept_num": concepts, "mixer": mixer, "accuracy": accuracy, "no_binding_line": 0.25,
                "architecture": architecture, "learning_rate": 1e-3, "still_improving": False}  # fmt: skip

    rows = [row(4, 64, "conv", 0.99), row(8, 64, "conv", 0.97), row(16, 64, "conv", 0.60), row(32, 64, "conv", 0.40),
            row(8, 64, "none", 0.30), row(8, None, "none", 0.99, "bert"), row(16, None, "none", 0.20, "bert"),
            row(8, 16, "conv", 0.30)]  # fmt: skip
    goals = recall.goal_lines(rows)
    assert goals[0].endswith("missed (K=16 60.00%, K=32 40.00%)")
    assert goals[1].endswith("C=64 K=8")  # 30% is above the 25% line by more than 2 points
    assert "BERT solves (>= 95%): K=8; not solved: K=16 20.00% at lr 0.001 (not rising, its rate inside" in goals[2]
    edge = {"still_improving": True, "rate_edge": "highest"}
    assert recall.why_unsolved(edge) == ("still improving: a longer schedule may solve it; its rate the grid's "
                                         "highest: a rate beyond it may")  # fmt: skip
    # a mean under the goal can hide seeds that solve it: the line names them, and each seed's accuracy
    split = {"accuracy": 0.743, "accuracy_seeds": [1.0, 0.6155, 0.613], "still_improving": False, "rate_edge": "lowest"}
    assert recall.why_unsolved(split) == ("solved at 1 of 3 seeds: 100.00%, 61.55%, 61.30%; its rate the grid's "
                                          "lowest: a rate beyond it may")  # fmt: skip
    assert recall.why_unsolved({**split, "accuracy_seeds": [0.9, 0.6], "rate_edge": None}).startswith(
        "no seed solves it, not rising"
    )
    # and so do the goal's miss and the capacity line: one seed of three past it is not the goal met
    some = {**row(32, 64, "conv", 0.66), "accuracy_seeds": [0.99, 0.5, 0.49]}
    assert recall.goal_lines([some])[0].endswith(
        "missed (K=32 66.00% (solved at 1 of 3 seeds: 99.00%, 50.00%, 49.00%))"
    )
    assert "- C=64, mixer conv: below 95% from the smallest K measured (K=32) (solved at 1 of 3 seeds: 99.00%, " \
        "50.00%, 49.00%)" in recall.goal_lines([some])  # fmt: skip
    assert "- C=64, mixer conv: holds 95% up to K=8 (0.12 pairs per concept), below it from K=16" in goals
    assert "- C=16, mixer conv: below 95% from the smallest K measured (K=8)" in goals
    held = recall.goal_lines([row(4, 64, "conv", 0.99), row(16, 64, "conv", 1.0)])  # K=32 not run: not met yet
    assert held[0].endswith("up to K=32: not yet decided (held at K=4, 16; K=32 not measured)")
    met = recall.goal_lines([row(16, 64, "conv", 1.0), row(32, 64, "conv", 0.96)])[0]
    assert met.endswith("up to K=32: met (held at K=16, 32)")  # which K, since a map may plan only some
    # the mixer before every layer is read for the goal beside the one before the first layer, when the map has it
    every = {**row(32, 64, "conv", 0.99), "placement": "every"}
    placed = recall.goal_lines([row(32, 64, "conv", 0.40), every])
    assert placed[0].endswith("missed (K=32 40.00%)") and placed[1] == (
        "- the mixer before every layer at C=64 holds >= 95% up to K=32: met (held at K=32)"
    )
    assert "- C=64, mixer conv every: holds 95% up to K=32 (0.50 pairs per concept), at every K measured" in placed
    waiting = recall.goal_lines([every], {"16": ["C=64, conv every"]})
    assert waiting[1].endswith("before every layer at C=64 holds >= 95% up to K=32: not yet decided (held at "
                               "K=32; K=16 not measured)")  # fmt: skip
    assert not any("every" in g for g in recall.goal_lines([row(32, 64, "conv", 0.40)]))
    # a curriculum's rows are read apart from the same model's rows from scratch, BERT's and the plain ones too
    grown = [{**row(k, 64, "conv", 0.99), "start": 4} for k in (8, 16, 32)]
    grown += [{**row(8, None, "none", 0.99, "bert"), "start": 4}, {**row(8, 64, "none", 0.30), "start": 4}]
    curriculum = recall.goal_lines([row(4, 64, "conv", 0.99), row(32, 64, "conv", 0.40), *grown])
    assert curriculum[0].endswith("missed (K=32 40.00%)") and curriculum[1] == (
        "- the mixer, each seed from its own K=4 model, at C=64 holds >= 95% up to K=32: met (held at K=8, 16, 32)"
    )
    assert "- C=64, mixer conv from K=4: holds 95% up to K=32 (0.50 pairs per concept), at every K measured" in (
        curriculum
    )
    assert curriculum[2].endswith("2 points: C=64 K=8 from K=4") and "K=8 from K=4" in curriculum[3]
    # a report of the map so far: a K missing between measured ones leaves the goal and the capacity open
    so_far = recall.goal_lines([row(4, 64, "conv", 0.99), row(32, 64, "conv", 0.96), row(8, 16, "conv", 0.99)],
                               {"8": ["C=64, conv"], "4": ["C=16, conv"]})  # fmt: skip
    assert so_far[0].endswith("up to K=32: not yet decided (held at K=4, 32; K=8 not measured)")
    assert (
        "- C=64, mixer conv: holds 95% up to K=4 (0.06 pairs per concept), K=8 not measured yet (held at K=32)"
        in so_far
    )
    assert "- C=16, mixer conv: K=4, its smallest K, not measured yet (held at K=8)" in so_far
    # a dip past the break is named; a model with no cell finished yet has its line; BERT and the plain models
    # name the Ks still missing, and a map without them has no such line
    dip = recall.goal_lines([row(4, 16, "conv", 0.99), row(8, 16, "conv", 0.84), row(16, 16, "conv", 0.97)],
                            {"4": ["C=32, conv", "BERT", "C=16, none"], "8": ["BERT"]})  # fmt: skip
    assert (
        "- C=16, mixer conv: holds 95% up to K=4 (0.25 pairs per concept), below it from K=8 (held again at K=16)"
        in dip
    )
    assert "- C=32, mixer conv: K=4, its smallest K, not measured yet" in dip
    assert "- BERT solves (>= 95%): not measured yet (K=4, 8)" in dip
    assert "- without the mixer, above the no-binding line by more than 2 points: not measured yet (K=4)" in dip
    partly = recall.goal_lines(
        [row(4, None, "none", 0.5, "bert"), row(4, 16, "none", 0.3)], {"8": ["C=16, none", "BERT"]}
    )
    assert partly[1].endswith("2 points: C=16 K=4; K=8 not measured yet")
    assert partly[2].endswith("; not solved: K=4 50.00% at lr 0.001 (not rising, its rate inside the grid: not "
                              "learned at this shape and budget); K=8 not measured yet")  # fmt: skip
    assert not any("without the mixer" in g or "BERT" in g for g in recall.goal_lines([row(4, 16, "conv", 0.99)]))


def test_a_cells_wall_clock_counts_the_grids_other_rates():
    cell = recall.Cell(pairs=4, architecture="concept", concept_num=16, mixer="conv", seeds=2, main=True, keys=64)
    runs = [{"method": "fine-tune", "learning_rate": 3e-3, "seconds": s, "rate_grid_seconds": {"0.001": 7.0}}
            for s in (10.0, 11.0)]  # fmt: skip
    row = {"method": "fine-tune", "seeds": [42, 43], "accuracy_mean": 1.0, "accuracy_std": 0.0,
           "learning_rate": 3e-3, "rate_grid": {"0.001": 0.3, "0.003": 1.0}, "best_steps": [5, 6], "seconds": 21.0,
           "grid_seconds": 7.0}  # fmt: skip
    out = recall.cell_row({"rows": [row], "runs": runs}, cell, 0.34)
    assert (out["cell_seconds"], out["runs"], out["rate_edge"]) == (28.0, 3, "highest")
    # a point kept before the grid's time was recorded: the seeds' runs only
    older_row = {key: value for key, value in row.items() if key != "grid_seconds"}
    older_runs = [{key: value for key, value in run.items() if key != "rate_grid_seconds"} for run in runs]
    older = recall.cell_row({"rows": [older_row], "runs": older_runs}, cell, 0.34)
    assert (older["cell_seconds"], older["runs"]) == (21.0, 2)


def test_a_points_thread_count_is_the_one_every_run_recorded():
    assert recall.recorded_threads([{"cpu_threads": 2}, {"cpu_threads": 2}]) == 2
    for runs in ([{"cpu_threads": 2}, {"cpu_threads": 1}],  # counts differ between runs
                 [{"cpu_threads": [2, 1]}, {"cpu_threads": [2, 1]}],  # within a run: resumed under another count
                 [{"cpu_threads": 2}, {}], [{}], []):  # fmt: skip
        assert recall.recorded_threads(runs) is None, runs


def test_an_archive_restores_only_whole_points_of_this_request(in_process, capsys, tmp_path):
    from concept_encoder.decide.experiments import PointFolder

    archive, local = tmp_path / "kept" / "recall-K2", PointFolder(tmp_path / "Cache/recall/recall-K2", "", [], 1)
    (archive / "points").mkdir(parents=True)
    (archive / "request.json").write_text(json.dumps({"task": "recall:2:64:16:200", "preset": "tiny"}))
    with pytest.raises(SystemExit):
        recall.main([*TINY, "--archive", "kept"])  # kept under another preset: its points are not this map's
    err = capsys.readouterr().err
    assert "archived map recall-K2 (" in err and "choose another --name or --archive" in err
    assert in_process == [] and not local.folder.exists()  # refused before anything ran or was copied
    Path("a_file").write_text("")
    with pytest.raises(SystemExit):
        recall.main([*TINY, "--archive", "a_file"])  # nothing can be kept there: refused before any run
    assert "--archive " in (err := capsys.readouterr().err) and "a_file is a file, not a folder" in err
    assert in_process == [] and not local.folder.exists()
    point = {"key": "C4-none", "rows": [], "baselines": {}}
    (archive / "points/C4-none.json").write_text(json.dumps(point))
    (archive / "points/bert.json").write_text("{not json")  # a damaged copy: never restored
    assert local.restore_from(archive) == ["C4-none"]
    assert json.loads(local.point_file("C4-none").read_text()) == point and not local.point_file("bert").exists()
    assert (local.folder / "request.json").read_bytes() == (archive / "request.json").read_bytes()
    local.point_file("C4-none").write_text(json.dumps({**point, "runs": ["this machine's"]}))
    assert local.restore_from(archive) == []  # a whole point here is kept, not overwritten by the archive's
    local.keep_in(archive, "C4-none")
    assert json.loads((archive / "points/C4-none.json").read_text())["runs"] == ["this machine's"]


def test_a_cell_with_the_mixer_before_every_layer_builds_that_model(tmp_path):
    tokenizer = load_tokenizer("recall:64:16")
    built = {}
    for placement in ("first", "every"):
        cell = recall.Cell(4, "concept", 16, "conv", seeds=1, main=True, keys=64, placement=placement)
        folder = recall.model_folder(tmp_path, cell, "micro", 12, tokenizer)
        built[folder.name] = json.loads((folder / "config.json").read_text())["local_mixer_placement"]
    assert built == {"C16-conv": "first", "C16-conv-every": "every"}


def test_a_point_keeps_its_model_config_and_one_without_it_or_its_model_is_a_clear_error(tmp_path):
    """A restored point's model folder may be on another machine: the point keeps the config the reports read."""
    from concept_encoder.decide.experiments import point_config

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 8}))
    assert point_config({"key": "a", "model": str(model), "model_config": {"hidden_size": 4}}) == {"hidden_size": 4}
    assert point_config({"key": "a", "model": str(model)}) == {"hidden_size": 8}  # written before points kept it
    with pytest.raises(ValueError, match="point a keeps no model config and its model .* is gone"):
        point_config({"key": "a", "model": str(tmp_path / "elsewhere"), "model_config": None})


CURRICULUM = ["--pairs", "2,3", "--concepts", "4", "--mixers", "conv", "--main_concepts", "4", "--main_pairs", "2,3",
              "--seeds", "2", "--train", "200", "--starts", "2", "--finetune_args", TINY[-1]]  # fmt: skip


@pytest.mark.loop
def test_a_curriculum_starts_each_seed_from_its_own_model_at_the_smaller_k(in_process, capsys):
    """`--starts 2`: the cells at K = 3 fine-tune each seed from the K = 2 cell's model of that seed (not from
    scratch), their own rows, panel and goal line; a start whose models are gone (restored from an archive) has its
    runs at the chosen rate made again first, and its curriculum starts from them only if they reproduce its point."""
    assert recall.main(CURRICULUM) == 0
    [report] = Path("Cache/reports").glob("recall_*.json")
    data = json.loads(report.read_text())
    assert [(r["pairs"], r["key"], r["start"]) for r in data["rows"]] == [
        (2, "C4-conv", None), (2, "bert", None), (3, "C4-conv-from2", 2), (3, "bert-from2", 2)]  # fmt: skip
    later = [c for c in in_process if "--from_scratch" not in c]
    assert len(later) == 2 and len(in_process) == 4  # the K = 3 cells alone load weights
    for key in ("C4-conv", "bert"):
        start = json.loads(Path(f"Cache/recall/recall-K2/points/{key}.json").read_text())
        finals = {run["seed"]: str(Path(run["run_dir"]) / "final") for run in start["runs"]}
        point = json.loads(Path(f"Cache/recall/recall-K3/points/{key}-from2.json").read_text())
        assert point["model"].replace("{seed}", "42") == finals[42]  # one path, a model per seed
        loaded = {run["seed"]: run["settings"]["model"] for run in point["runs"]}
        assert loaded == finals and len(finals) == 2  # seed 42 from seed 42's model, seed 43 from 43's
    markdown = report.with_suffix(".md").read_text()
    assert "| C=4, conv from K=2 | - | " in markdown and "| BERT from K=2 | - | " in markdown
    assert "(rows `from K=2`: each seed from its K=2 cell's model)" in markdown
    assert any(g.startswith("- C=4, mixer conv from K=2: ") for g in data["goals"])  # its own capacity line
    assert report.with_suffix(".png").is_file()
    # a start's model gone (a point restored from an archive keeps results, not models): its runs at the rate chosen
    # there are made again first, and must reproduce the point, else its curriculum does not start
    Path("Cache/recall/recall-K3/points/C4-conv-from2.json").unlink()
    start_file = Path("Cache/recall/recall-K2/points/C4-conv.json")
    original = start_file.read_text()
    start = json.loads(original)
    shutil.rmtree(Path(next(r["run_dir"] for r in start["runs"] if r["seed"] == 43)) / "final")
    [row] = [r for r in start["rows"] if r["method"] == "fine-tune"]
    row["accuracy_seeds"] = [round(1 - a, 6) for a in row["accuracy_seeds"]]  # a point these runs cannot reproduce
    threads = {run.pop("cpu_threads") for run in start["runs"]}  # each run records its CPU threads
    assert threads == {torch.get_num_threads()}
    start_file.write_text(json.dumps(start))  # as a point from before runs recorded them
    launched = len(in_process)
    assert recall.main(CURRICULUM) == 1
    out, err = capsys.readouterr()
    assert "its 2 run(s) at the rate chosen there" in out  # named before any run
    assert "error: K=2's cell C4-conv made again here does not reproduce its restored point" in err
    assert "Its runs recorded no thread count" in err and "rerun with CPU_THREADS=<the count they ran with>" in err
    [remake] = in_process[launched:]  # the start's runs again, at its chosen rate alone; the K = 3 cell not started
    (count,) = threads
    assert remake[:2] == ["env", f"CPU_THREADS={count}"]  # this machine's count, pinned for that launch alone
    assert remake[remake.index("--run_name") + 1] == f"recall-K2-C4-conv-models-t{count}"  # named for its count
    last_rates = max(i for i, arg in enumerate(remake) if arg == "--learning_rates")  # the last one given wins
    assert remake[last_rates + 1] == f"{row['learning_rate']:g}"
    # what did not reproduce is set aside, not reused and not archived
    assert not Path("Cache/recall/recall-K2/points/C4-conv-models.json").exists()
    assert len(list(Path("Cache/recall/recall-K2/set_aside").glob("C4-conv-models-*.json"))) == 1
    start["runs"][0]["cpu_threads"] = [count, count + 1]  # a run resumed under another count records both
    start_file.write_text(json.dumps(start))
    assert recall.main(CURRICULUM) == 1
    assert f"Its runs ran under different thread counts ([{count}, {count + 1}]), which no one count" in (
        capsys.readouterr().err)  # fmt: skip
    assert len(in_process) == launched + 2 and in_process[-1][:2] == ["env", f"CPU_THREADS={count}"]
    launched += 1  # that remake set aside as well
    start_file.write_text(original)  # recorded threads: the remake runs with them, and its runs are reused
    assert recall.main(CURRICULUM) == 0  # the made-again models reproduce the point
    assert in_process[launched + 1][:2] == ["env", f"CPU_THREADS={count}"]
    assert len(in_process) == launched + 3  # the remake (its finished runs reused) and the K = 3 cell
    again = json.loads(Path("Cache/recall/recall-K2/points/C4-conv-models.json").read_text())
    assert {run["cpu_threads"] for run in again["runs"]} == {count}
    finals = {run["seed"]: str(Path(run["run_dir"]) / "final") for run in again["runs"]}
    point = json.loads(Path("Cache/recall/recall-K3/points/C4-conv-from2.json").read_text())
    assert {run["seed"]: run["settings"]["model"] for run in point["runs"]} == finals and len(finals) == 2
    assert all(Path(folder).is_dir() for folder in finals.values())
    for folder in [*finals.values(), *(str(Path(r["run_dir"]) / "final") for r in start["runs"])]:
        shutil.rmtree(folder, ignore_errors=True)  # a finished curriculum on a fresh machine: no models needed
    assert recall.main(CURRICULUM) == 0 and len(in_process) == launched + 3


def test_a_curriculum_cell_waits_for_its_start_and_fails_with_it(monkeypatch):
    """Under --jobs a curriculum cell may start while the cell it starts from still runs: it waits for that point,
    and when the start fails it fails too (never waits for ever)."""
    import threading
    from concurrent.futures import Future

    class Folder:  # a PointFolder's measuring, recorded
        def __init__(self, fail=False):
            self.measured, self.fail = [], fail

        def reused_or_measured(self, key, model, extra, info, what):
            if self.fail and "from" not in key:
                raise RuntimeError("the start failed")
            self.measured.append((key, model))
            return {"key": key}

        def finished(self, key, extra):
            return None  # nothing measured before

    monkeypatch.setattr(recall, "start_models", lambda point, cell: f"{point['key']}-seed{{seed}}")
    start = recall.Cell(2, "concept", 4, "conv", seeds=2, main=True, keys=64)
    later = recall.Cell(3, "concept", 4, "conv", seeds=2, main=True, keys=64, start=2)
    assert later.start_cell == start and later.key == "C4-conv-from2" and later.label.endswith("from its K=2 model")
    for fail in (False, True):
        folder, started, outcome = Folder(fail), {(2, "C4-conv"): Future()}, []
        followers = {(2, "C4-conv"): later}

        def wait(folder=folder, started=started, outcome=outcome, followers=followers):
            try:
                outcome.append(recall.measure_cell(folder, later, None, "K=3", started, followers))
            except RuntimeError as error:
                outcome.append(error)

        waiting = threading.Thread(target=wait)
        waiting.start()
        waiting.join(0.3)
        assert waiting.is_alive() and folder.measured == []  # nothing measured before its start's point
        if fail:
            with pytest.raises(RuntimeError, match="the start failed"):
                recall.measure_cell(folder, start, Path("m"), "K=2", started, followers)
        else:
            recall.measure_cell(folder, start, Path("m"), "K=2", started, followers)
        waiting.join(5)
        assert not waiting.is_alive()
        if fail:
            assert folder.measured == [] and str(outcome[0]) == "the start failed"
        else:
            assert folder.measured == [("C4-conv", "m"), ("C4-conv-from2", "C4-conv-seed{seed}")]
            assert outcome == [((3, "C4-conv-from2"), {"key": "C4-conv-from2"})]


def test_a_curriculum_is_refused_where_it_cannot_start(in_process, capsys):
    for extra, message in (
        (["--pairs", "4,8", "--starts", "2"], "--starts 2: the curriculum starts from the cells at K=2"),
        (["--pairs", "4,8", "--starts", "8"], "--starts 8: the curriculum starts from the cells at K=8"),
        (["--pairs", "4,8", "--starts", "4,8"], "give scratch and/or one K of --pairs"),
        (["--pairs", "4,8", "--starts", "first"], "give scratch and/or one K of --pairs"),
        (["--pairs", "4,128", "--starts", "4"], "K=128 draws its keys from 128 symbols, K=4 from 64"),
        (["--pairs", "4,8", "--main_pairs", "8", "--starts", "4"], "K=4 is not a main K (--sweep_seeds 1); add 4"),
    ):
        with pytest.raises(SystemExit):
            recall.main(extra)
        assert message in capsys.readouterr().err
    assert in_process == []
    args = recall.build_parser().parse_args(["--pairs", "4,8,16", "--concepts", "64", "--starts", "scratch,4"])
    recall.check_arguments(args)
    assert [c.key for c in recall.cells(args) if c.pairs == 8] == [
        "C64-none", "C64-conv", "bert", "C64-none-from4", "C64-conv-from4", "bert-from4"]  # fmt: skip
    args = recall.build_parser().parse_args(["--pairs", "4,8", "--concepts", "64", "--starts", "4", "--keys", "128"])
    recall.check_arguments(args)
    assert [c.key for c in recall.cells(args)] == ["C64-none", "C64-conv", "bert", "C64-none-from4",
                                                   "C64-conv-from4", "bert-from4"]  # fmt: skip


def test_cells_that_would_wait_for_their_start_are_measured_last(monkeypatch):
    """Jobs run in order: a curriculum cell whose start is still to measure goes after every other (under --jobs it
    would hold a worker while it waits), and never before its start."""
    args = recall.build_parser().parse_args(["--pairs", "4,8,16", "--concepts", "16,64", "--mixers", "conv",
                                             "--architectures", "concept", "--starts", "4"])  # fmt: skip
    recall.check_arguments(args)

    class Folder:
        def __init__(self, done):
            self.measured = done

        def done(self, key):
            return key in self.measured

        def finished(self, key, extra):
            return {"key": key} if key in self.measured else None

    here = {"C16-conv"}  # the starts whose models are on this machine
    monkeypatch.setattr(recall, "models_here", lambda point, cell: point["key"] in here)
    folders = {4: Folder({"C16-conv"}), 8: Folder(set()), 16: Folder(set())}  # C=16's start measured, C=64's not
    order = [(c.pairs, c.key) for c in recall.job_order(recall.cells(args), folders)]
    assert order == [(4, "C16-conv"), (4, "C64-conv"), (8, "C16-conv-from4"), (16, "C16-conv-from4"),
                     (8, "C64-conv-from4"), (16, "C64-conv-from4")]  # fmt: skip
    here.clear()  # C=16's start restored from an archive without its models: its cells wait for them too
    order = [(c.pairs, c.key) for c in recall.job_order(recall.cells(args), folders)]
    assert order == [(4, "C16-conv"), (4, "C64-conv"), (8, "C16-conv-from4"), (8, "C64-conv-from4"),
                     (16, "C16-conv-from4"), (16, "C64-conv-from4")]  # fmt: skip
    assert [(c.pairs, c.key) for c in recall.cells(args)] == [
        (4, "C16-conv"), (4, "C64-conv"), (8, "C16-conv-from4"), (8, "C64-conv-from4"), (16, "C16-conv-from4"),
        (16, "C64-conv-from4")]  # the map's own order: the report's  # fmt: skip
