"""The learning-curve driver (`python -m concept_encoder curve`) on `micro` with two tiny budgets: the
snapshots it pretrains, the points it measures, reuse on a rerun, a rebuilt point, gates, bad plans."""

import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
from loop_runs import COMMON, fresh_accelerate, launch_in_process, sigterm_after, workdir  # noqa: F401 (fixtures: a module work folder, accelerate reset)
from safetensors.torch import load_file

import loops.mlm as mlm
from concept_encoder.decide import curve, experiments

PRETRAIN = [*COMMON, "--output_dir", "runs", "--save_steps", "2"]  # 8 x 64 = 512 tokens per step
FINETUNE = ("--max_steps 2 --eval_steps 1 --learning_rates 1e-3 --seeds 1 --max_seq_length 32 "
            "--per_device_eval_batch_size 128 --report_to none --progress_bar false --output_dir ft")  # fmt: skip


@pytest.fixture(autouse=True)
def task():
    """A small task whose class a cue word decides (the curve measures it at each point in seconds)."""
    rng = random.Random(0)
    words = "the a concept token model of in and to is".split()
    rows = [" ".join(rng.choices(words, k=8)) + f" {cue}," + cue for cue in ("red", "green", "blue") * 40]
    Path("colors.csv").write_text("text,label\n" + "\n".join(rows) + "\n")


@pytest.fixture
def launches(monkeypatch):
    """The loops run in this process instead of `accelerate launch` (seconds saved per run); every command kept."""
    commands = []
    monkeypatch.setattr(experiments, "run_command", launch_in_process(commands))
    return commands


def scripts(commands) -> list[str]:
    return [Path(next(c for c in command if c.endswith(".py"))).name for command in commands]


def test_budget_parsing_and_labels():
    assert experiments.parse_budgets("2M, 0.5M,8e6,300k") == [300_000, 500_000, 2_000_000, 8_000_000]
    assert [experiments.token_label(t) for t in (1024, 2_000_000, 999)] == ["1.024k", "2M", "999"]
    with pytest.raises(ValueError, match="'2 tokens' is not a token count such as 500k"):
        experiments.parse_budgets("1M,2 tokens")
    with pytest.raises(ValueError, match="a budget is given twice"):
        experiments.parse_budgets("1M,1000k")
    with pytest.raises(ValueError, match=r"'1e30' is beyond 1e\+14 tokens, a run that cannot finish"):
        experiments.parse_budgets("1M,1e30")


@pytest.mark.loop
def test_curve_pretrains_once_measures_each_point_and_reuses_finished_ones(launches, capsys):
    argv = ["--tokens", "1024,2048", "--architectures", "concept", "--name", "c", "--task", "colors.csv",
            "--finetune_args", FINETUNE,
            "--", *PRETRAIN]  # fmt: skip
    assert curve.main(argv) == 0
    assert scripts(launches) == ["mlm.py", "finetune.py", "finetune.py", "finetune.py"]  # 2 points and the twin
    pretraining = launches[0]
    assert pretraining[pretraining.index("--snapshot_steps") + 1] == "2,4"
    assert pretraining[pretraining.index("--max_steps") + 1] == "4"
    run = Path("runs/c-concept")
    final, last = load_file(run / "final" / "model.safetensors"), load_file(run / "snapshots/step-4/model.safetensors")
    assert final.keys() == last.keys() and all(torch.equal(final[k], last[k]) for k in final)
    early = load_file(run / "snapshots/step-2/model.safetensors")
    assert not all(torch.equal(early[k], last[k]) for k in early)
    points = {p.stem: json.loads(p.read_text()) for p in Path("Cache/curves/c/points").glob("*.json")}
    assert sorted(points) == ["concept-1.024k", "concept-2.048k", "concept-twin"]
    assert points["concept-1.024k"]["step"] == 2 and points["concept-1.024k"]["eval_loss"] > 0
    assert points["concept-1.024k"]["unigram_ratio"] >= 0  # accuracy over the unigram baseline at that step
    assert {row["method"] for row in points["concept-twin"]["rows"]} == {
        "fine-tune", "probe: concepts mean", "probe: embeddings mean"}  # fmt: skip
    table = Path("Cache/curves/c/curve.md").read_text()
    assert "| concept | 1,024 | 2 |" in table and "| concept | 2,048 | 4 |" in table
    assert "| concept twin |" in table and "TF-IDF + linear (colors.csv)" in table
    assert Path("Cache/curves/c/curve.png").stat().st_size > 10_000
    saved = json.loads(Path("Cache/curves/c/curve.json").read_text())
    assert [e["tokens"] for e in saved["curves"]["concept / fine-tune"]] == [1024, 2048]

    launches.clear()
    capsys.readouterr()
    assert curve.main(argv) == 0  # everything finished: nothing runs again
    assert launches == [] and capsys.readouterr().out.count("finished earlier, reused") == 3
    Path("Cache/curves/c/points/concept-2.048k.json").unlink()  # one point lost: only it is measured again
    assert curve.main(argv) == 0
    assert scripts(launches) == ["finetune.py"] and "snapshots/step-4" in " ".join(launches[0])
    again = json.loads(Path("Cache/curves/c/points/concept-2.048k.json").read_text())

    def scores(rows):  # everything but the wall-clock seconds
        return [{k: v for k, v in row.items() if k != "seconds"} for row in rows]

    assert scores(again["rows"]) == scores(points["concept-2.048k"]["rows"])  # probes refitted equal, run reused
    assert again["rows"][0]["model"] == "c-concept-step-4"

    # pretraining cut after step 2 (its later checkpoint, snapshot and final model lost): the rerun resumes it
    for lost in ("final", "snapshots/step-4", "checkpoints/step_0000004"):
        shutil.rmtree(run / lost)
    (run / "summary.json").unlink()
    Path("Cache/curves/c/points/concept-2.048k.json").unlink()
    launches.clear()
    assert curve.main(argv) == 0
    assert scripts(launches) == ["mlm.py", "finetune.py"]
    resumed = load_file(run / "snapshots/step-4/model.safetensors")
    assert all(torch.equal(resumed[k], last[k]) for k in last)  # exact resume: the same step-4 weights

    # a fresh machine: the points kept in --archive are restored, nothing is pretrained or fine-tuned again
    launches.clear()
    assert curve.main(["--archive", "kept", *argv]) == 0 and launches == []  # every point copied there
    assert sorted(p.stem for p in Path("kept/c/points").glob("*.json")) == sorted(points)
    table = Path("Cache/curves/c/curve.md").read_text()
    shutil.move("Cache/curves/c", "away-points")
    shutil.move("runs/c-concept", "away-run")
    capsys.readouterr()
    assert curve.main(["--archive", "kept", *argv]) == 0 and launches == []
    assert "concept-1.024k, concept-2.048k, concept-twin restored from" in capsys.readouterr().out
    assert Path("Cache/curves/c/curve.md").read_text() == table
    shutil.rmtree("Cache/curves/c")
    shutil.move("away-points", "Cache/curves/c")
    shutil.move("away-run", "runs/c-concept")

    # reused only for the same request: other pretraining arguments, or a budget past the finished run, are refused
    launches.clear()
    capsys.readouterr()
    longer = [*argv[:1], "1024,2048,4096", *argv[2:]]
    for changed, message in (([*argv, "--learning_rate", "1e-3"], r"was measured under other settings \(pretrain_args"),
                             (longer, "needs step 8, but pretraining run .*c-concept finished at step 4")):  # fmt: skip
        with pytest.raises(SystemExit) as refused:
            curve.main(changed)
        assert refused.value.code == 2 and re.search(message, capsys.readouterr().err)
    assert launches == []


GROWABLE = ["--lr_scheduler_type", "constant", "--warmup_steps", "1", "--save_steps", "3"]  # no step-4 checkpoint


@pytest.mark.loop
def test_a_budget_added_later_extends_the_pretraining_run_as_if_planned_that_long(launches, capsys):
    argv = ["--tokens", "1024,2048", "--architectures", "concept", "--name", "grow", "--twins", "false",
            "--task", "colors.csv", "--finetune_args", FINETUNE, "--", *PRETRAIN, *GROWABLE]  # fmt: skip
    assert curve.main(argv) == 0
    before = {p.name: p.read_text() for p in Path("Cache/curves/grow/points").glob("*.json")}
    launches.clear()
    capsys.readouterr()
    assert curve.main(["--tokens", "1024,2048,4096", *argv[2:]]) == 0
    out = capsys.readouterr().out
    assert scripts(launches) == ["mlm.py", "finetune.py"]  # the run extended, only the new point measured
    assert "extending grow-concept from step 4 to 8" in out and out.count("finished earlier, reused") == 2
    assert {
        p.name: p.read_text() for p in Path("Cache/curves/grow/points").glob("*.json") if p.name in before
    } == before
    assert "| concept | 4,096 | 8 |" in Path("Cache/curves/grow/curve.md").read_text()
    # the same run planned to step 8 from the start: the extended one (resumed at its step-3 checkpoint) equals it
    assert (
        mlm.main([*PRETRAIN, *GROWABLE, "--architecture", "concept", "--run_name", "straight", "--max_steps", "8"]) == 0
    )
    grown, straight = (
        load_file(Path("runs") / name / "final" / "model.safetensors") for name in ("grow-concept", "straight")
    )
    assert grown.keys() == straight.keys() and all(torch.equal(grown[k], straight[k]) for k in grown)
    damaged = Path("Cache/curves/grow/points/concept-4.096k.json")  # a point file edited by hand: named, measured again
    damaged.write_text(json.dumps({**json.loads(damaged.read_text()), "tokens": "lots"}))
    launches.clear()
    capsys.readouterr()
    assert curve.main(["--tokens", "1024,2048,4096", *argv[2:]]) == 0
    assert scripts(launches) == ["finetune.py"] and json.loads(damaged.read_text())["tokens"] == 4096
    assert "concept-4.096k.json holds tokens or a step that are not whole numbers: measuring" in capsys.readouterr().err
    with pytest.raises(SystemExit) as passed:  # a budget between steps the run has passed: no model of it is kept
        curve.main(["--tokens", "1024,2048,3072,4096", *argv[2:]])
    assert passed.value.code == 2 and "3.072k is step 6, which pretraining run" in capsys.readouterr().err


@pytest.mark.parametrize(
    "loop, message",
    [
        (["--lr_scheduler_type", "linear", "--save_steps", "2"], "under a linear learning-rate schedule that decays"),
        (["--lr_scheduler_type", "constant", "--warmup_ratio", "0.3", "--save_steps", "2"],
         r"its warm-up \(1 steps, --warmup_ratio of the run's length\) would be 3 steps"),
        (["--lr_scheduler_type", "constant", "--warmup_steps", "1"], "kept no checkpoint to continue from"),
        (["--lr_scheduler_type", "constant", "--warmup_steps", "1", "--save_steps", "2"], None),  # it can grow
    ],
)  # fmt: skip
def test_a_budget_past_a_run_that_cannot_grow_is_refused_with_the_reason(tmp_path, loop, message):
    plan, run = experiments.plan_architecture("concept", [1024, 2048, 5120], [*PRETRAIN, *loop], "p", 1)
    run_dir = tmp_path / "p-concept"
    (run_dir / "final").mkdir(parents=True)
    (run_dir / "summary.json").write_text(json.dumps({"steps": 4}))
    if "--save_steps" in loop:  # a checkpoint the extension would resume from
        (run_dir / "checkpoints" / "step_0000004").mkdir(parents=True)
        (run_dir / "checkpoints" / "step_0000004" / "train_state.json").write_text("{}")
    problem = experiments.extension_problem(plan, run_dir, 4)
    if message is None:
        assert problem is None
        return
    assert problem.startswith(f"--tokens: 5.12k needs step 10, but pretraining run {run_dir} finished at step 4")
    assert re.search(message, problem)


@pytest.mark.loop
def test_a_gate_that_stops_pretraining_ends_the_curve_there(launches, capsys):
    argv = ["--tokens", "1024,2048", "--architectures", "concept", "--name", "g", "--twins", "false", "--task", "colors.csv",
            "--finetune_args", FINETUNE, "--", *PRETRAIN, "--gate", "eval_loss<0@1"]  # fmt: skip
    assert curve.main(argv) == 0
    assert scripts(launches) == ["mlm.py", "finetune.py"]
    out = capsys.readouterr().out
    assert "concept-2.048k: no snapshot at step 4: pretraining stopped by a gate at step 2 (eval_loss<0@1" in out
    assert "- concept: pretraining stopped by a gate at step 2" in Path("Cache/curves/g/curve.md").read_text()


@pytest.mark.parametrize(
    "extra, loop, message",
    [
        (["--tokens", "1000,1100"], [], "budgets give steps \\[2, 2\\]; choose budgets at least one step apart"),
        (["--tokens", "1024,2048"], ["--max_steps", "9"], "\\['--max_steps'\\] are set by the curve driver"),
        (["--tokens", "1024,2048", "--finetune_args", "--task glue:sst2"], [], "--finetune_args: \\['--task'\\]"),
        (
            ["--tokens", "1024,2048", "--architectures", "gpt"],
            [],
            "--architectures 'gpt': \\['gpt'\\] unknown; choose from",
        ),
        (
            ["--tokens", "1024,2048", "--architectures", "concept,concept"],
            [],
            "--architectures 'concept,concept': give distinct comma-separated values",
        ),
        (["--tokens", "1024,2048", "--twins", "maybe"], [], "--twins: 'maybe' is not true or false"),
        (
            ["--tokens", "1024,2048", "--reference", "nowhere"],
            [],
            "--reference: nowhere is not a folder; pass a folder written by save_pretrained",
        ),
        (["--tokens", "1024,2048", "--curves_dir", "colors.csv/curves"], [], "colors.csv is a file, not a folder"),
        (["--tokens", "1024,2048", "--task", "nothing.csv"], [], "--task 'nothing.csv': no such file or folder"),
    ],
)
def test_bad_plans_are_refused_before_anything_runs(launches, capsys, extra, loop, message):
    with pytest.raises(SystemExit) as refused:
        curve.main([*extra, "--name", "bad", "--", *PRETRAIN, *loop])
    assert refused.value.code == 2
    assert re.search(message, capsys.readouterr().err)
    assert launches == [] and not Path("runs/bad-concept").exists()


def errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("error:")]


def test_a_busy_curve_and_a_failed_run_end_in_one_line(monkeypatch, capsys):
    from filelock import FileLock

    argv = ["--tokens", "1024,2048", "--name", "busy", "--task", "colors.csv", "--finetune_args", FINETUNE,
            "--", *PRETRAIN]  # fmt: skip
    folder = Path("Cache/curves/busy")
    folder.mkdir(parents=True)
    with FileLock(folder / ".lock"):  # another invocation measures it
        assert curve.main(argv) == 1
    err = capsys.readouterr().err
    [error] = errors(err)
    assert "curve busy is being measured by another process" in error and "Traceback" not in err
    monkeypatch.setattr(experiments, "run_command", lambda command: 1)  # the pretraining run fails
    assert curve.main(argv) == 1
    err = capsys.readouterr().err
    [error] = errors(err)  # one line, beside the task loader's progress bars
    assert error.startswith("error: pretraining busy-concept failed (exit code 1)") and "Traceback" not in err
    monkeypatch.setattr(experiments, "run_command", launch_in_process([]))
    sigterm_after(monkeypatch, calls=1)  # the loop checkpoints at step 1 and exits 143, which the launcher says as 1
    assert curve.main(argv) == 1
    [error] = errors(capsys.readouterr().err)  # no point measured on a run that has not ended
    assert error.startswith("error: pretraining busy-concept was stopped by a signal at step 1 (checkpointed); rerun")


def test_a_folder_that_is_not_a_curve_is_refused_before_anything_runs(launches, capsys):
    folder = Path("Cache/curves/mine")
    folder.mkdir(parents=True)
    (folder / "thesis.tex").write_text("mine")
    with pytest.raises(SystemExit) as refused:
        curve.main(["--tokens", "1024,2048", "--name", "mine", "--", *PRETRAIN])
    assert refused.value.code == 2 and "holds files a curve does not write (thesis.tex)" in capsys.readouterr().err
    assert sorted(p.name for p in folder.iterdir()) == ["thesis.tex"] and launches == []


def test_ctrl_c_in_a_curve_is_one_line_and_leaves_it_free_for_the_next_invocation(monkeypatch, capsys):
    from filelock import FileLock

    from concept_encoder.common.entry import run_tool

    def interrupted(command):
        raise KeyboardInterrupt

    monkeypatch.setattr(experiments, "run_command", interrupted)  # Ctrl-C during the pretraining run
    argv = ["--tokens", "1024,2048", "--name", "ctrlc", "--task", "colors.csv", "--finetune_args", FINETUNE,
            "--", *PRETRAIN]  # fmt: skip
    assert run_tool(curve.main, "python -m concept_encoder curve", argv) == 130
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.strip().endswith("python -m concept_encoder curve: interrupted (what "
                                                           "finished is kept: rerun the same command to continue)")  # fmt: skip
    FileLock("Cache/curves/ctrlc/.lock").acquire(timeout=0)  # released: the same command can continue


def test_a_reference_folder_that_now_holds_other_weights_is_not_reused(tmp_path, capsys):
    reference = tmp_path / "ref"
    reference.mkdir()
    (reference / "config.json").write_text("{}")
    (reference / "model.safetensors").write_bytes(b"weights one")
    argv = ["--tokens", "1024,2048", "--name", "ref", "--reference", str(reference), "--", *PRETRAIN]
    args = curve.build_parser().parse_args(argv[: argv.index("--")])
    folder = tmp_path / "curve"
    plans = [experiments.plan_architecture("concept", [1024, 2048], PRETRAIN, "ref", 1)]
    experiments.check_reuse(folder, curve.curve_request(args, PRETRAIN, []), plans)  # records the request
    (reference / "model.safetensors").write_bytes(b"weights two")  # the same path, another model
    with pytest.raises(ValueError, match="was measured under other settings \\(reference_sha256: the curve's '"):
        experiments.check_reuse(folder, curve.curve_request(args, PRETRAIN, []), plans)


def test_a_request_file_that_is_not_a_request_is_refused_and_retired_keys_are_not_compared(tmp_path):
    folder = tmp_path / "point"
    request = {"task": "recall:4", "preset": "micro"}
    experiments.check_reuse(folder, request, [])  # records the request
    (folder / "request.json").write_text(json.dumps({**request, "cells": ["C16-none"]}))  # an older driver's record
    with pytest.raises(ValueError, match="was measured under other settings \\(cells: the curve's \\['C16-none'\\]"):
        experiments.check_reuse(folder, request, [])
    experiments.check_reuse(folder, request, [], retired=("cells",))  # no longer decides: dropped from the record
    assert json.loads((folder / "request.json").read_text()) == request
    for damaged in ("[1, 2]", "{not json"):
        (folder / "request.json").write_text(damaged)
        with pytest.raises(ValueError, match="request.json does not hold a request \\(a JSON object\\): the folder"):
            experiments.check_reuse(folder, request, [])
        assert (folder / "request.json").read_text() == damaged  # nothing rewritten


@pytest.mark.loop
def test_a_run_of_the_curves_name_made_otherwise_is_not_taken_for_the_curves(launches, capsys):
    assert mlm.main([*PRETRAIN, "--run_name", "other-concept", "--max_steps", "2", "--snapshot_steps", "2",
                     "--learning_rate", "0.01"]) == 0  # someone's own run that happens to bear the name  # fmt: skip
    launches.clear()
    with pytest.raises(SystemExit) as refused:
        curve.main(["--tokens", "1024", "--architectures", "concept", "--name", "other", "--twins", "false",
                    "--task", "colors.csv", "--finetune_args", FINETUNE, "--", *PRETRAIN])  # fmt: skip
    err = capsys.readouterr().err
    assert refused.value.code == 2 and launches == []
    assert "other-concept was run under other settings (args.learning_rate: the run has 0.01, this curve 0.0005" in err


WSD = ["--lr_scheduler_type", "wsd", "--decay_steps", "2", "--warmup_steps", "1"]


@pytest.mark.loop
def test_a_wsd_curve_branches_one_decay_per_budget_from_one_stable_run(launches, capsys):
    argv = ["--tokens", "2048,3072", "--architectures", "concept", "--name", "w", "--twins", "false",
            "--task", "colors.csv", "--finetune_args", FINETUNE, "--", *PRETRAIN, *WSD]  # fmt: skip
    assert curve.main(argv) == 0
    # the stable run to step 6 - 2, then per budget a decay of 2 steps from its checkpoint there, then the point
    assert scripts(launches) == ["mlm.py", "mlm.py", "finetune.py", "mlm.py", "finetune.py"]
    stable = json.loads(Path("runs/w-concept/config.json").read_text())["training_args"]
    assert (stable["lr_scheduler_type"], stable["max_steps"], stable["checkpoint_steps"]) == ("constant", 4, "2,4")
    assert launches[1][launches[1].index("--resume_from_checkpoint") + 1].endswith("w-concept/checkpoints/step_0000002")
    # a decay is the wsd run planned to its budget from the start (bitwise in one process, test_schedules_and_budgets;
    # here to float rounding: two runs of one process apart can differ in the last bits of a reduction)
    assert mlm.main([*PRETRAIN, *WSD, "--architecture", "concept", "--run_name", "straight4", "--max_steps", "4"]) == 0
    decayed, straight = (
        load_file(Path("runs") / n / "final" / "model.safetensors") for n in ("w-concept-decay4", "straight4")
    )
    assert decayed.keys() == straight.keys()
    for key in decayed:
        torch.testing.assert_close(decayed[key], straight[key], rtol=1e-5, atol=1e-6, msg=key)
    changed = load_file(Path("runs/w-concept/final/model.safetensors"))  # the stable run's own end: no decay
    assert any(not torch.allclose(changed[k], decayed[k], rtol=1e-5, atol=1e-6) for k in decayed)
    point = json.loads(Path("Cache/curves/w/points/concept-2.048k.json").read_text())
    assert point["step"] == 4 and point["model"].endswith("w-concept-decay4/final") and point["eval_loss"] is not None
    launches.clear()
    assert curve.main(["--tokens", "2048,3072,4096", *argv[2:]]) == 0  # a budget added: the stable run grows, one decay
    assert scripts(launches) == ["mlm.py", "mlm.py", "finetune.py"]
    assert "extending w-concept from step 4 to 6" in capsys.readouterr().out
    assert json.loads(Path("runs/w-concept-decay8/summary.json").read_text())["steps"] == 8
    with pytest.raises(SystemExit) as refused:  # a budget the warm-up and decay do not fit into
        curve.main(["--tokens", "1024,2048", *argv[2:]])
    assert refused.value.code == 2 and "budgets of steps [2] end before warm-up (1) plus --decay_steps (2)" in (
        capsys.readouterr().err
    )


def test_arguments_in_another_order_are_the_same_request(tmp_path):
    folder_request = {"task": "recall:4", "finetune_args": ["--max_steps", "9", "--learning_rates", "1e-3,3e-3"]}
    assert experiments.argv_settings(["--a", "1", "--b=2", "--a", "3", "x", "y"]) == {
        "--a": ["3", "x", "y"],
        "--b": ["2"],
    }
    assert experiments.same_arguments(["--b", "2", "--a", "1"], ["--a", "1", "--b=2"])
    assert not experiments.same_arguments(["--a", "1"], ["--a", "2"]) and not experiments.same_arguments("x", "x")
    experiments.check_reuse(tmp_path / "map", folder_request, [])  # records it
    reordered = {**folder_request, "finetune_args": ["--learning_rates", "1e-3,3e-3", "--max_steps", "9"]}
    experiments.check_reuse(tmp_path / "map", reordered, [])  # the same settings: reused
    with pytest.raises(ValueError, match="finetune_args: the curve's \\['--learning_rates'"):
        experiments.check_reuse(tmp_path / "map", {**folder_request, "finetune_args": ["--max_steps", "10"]}, [])


def test_a_generated_task_longer_than_max_seq_length_is_refused_before_any_pretraining(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="task recall:63:64:16:100 has examples of at least 130 tokens, longer "
                                         "than --max_seq_length 128, and is never truncated; pass --max_seq_length 130"):  # fmt: skip
        experiments.check_finetune_argv([], "recall:63:64:16:100")
    experiments.check_finetune_argv(["--max_seq_length", "130"], "recall:63:64:16:100")  # whole: accepted
