"""The research loop's verdicts: decision gates in the loop, run comparison (an unfinished run, a cut metrics
line), reports that never collide, one-axis ablations."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from accelerate.state import AcceleratorState
from loop_runs import COMMON, ROOT, finished_run, fresh_accelerate, records, run, sigterm_after, workdir  # noqa: F401 (fixtures)

import loops.mlm as mlm
from concept_encoder.decide import ablate
from concept_encoder.decide.compare import compare
from concept_encoder.training.args import parse_args
from concept_encoder.training.gates import Gate, GateMonitor, parse_gate


@pytest.mark.parametrize(
    ("text", "gate"),
    [
        ("health/effective_rank_fraction>=0.25@500", Gate("health/effective_rank_fraction", ">=", 0.25, 500)),
        (" eval_loss < 6 ", Gate("eval_loss", "<", 6.0, 0)),
        ("eval_accuracy>1e-2@ 7", Gate("eval_accuracy", ">", 0.01, 7)),
        ("eval_loss<=-.5", Gate("eval_loss", "<=", -0.5, 0)),
    ],
)
def test_gate_syntax(text, gate):
    assert parse_gate(text) == gate


@pytest.mark.parametrize("text", ["eval_loss", "eval_loss=>6", "eval_loss<", "eval_loss<6@x", "<6", "eval_loss==6"])
def test_bad_gate_syntax_is_an_error_naming_the_form(text):
    with pytest.raises(ValueError, match=r"is not `metric<op>threshold\[@step\]`"):
        parse_args(["--gate", text])


def test_gates_repeat_come_from_yaml_and_unknown_metrics_are_refused(tmp_path):
    _, _, train = parse_args(["--gate", "eval_loss<6", "--max_steps", "9", "--gate", "eval_accuracy>0.1@4"])
    assert train.gate == ["eval_loss<6", "eval_accuracy>0.1@4"] and train.max_steps == 9
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"gate": ["health/effective_rank_fraction>=0.25@500"], "gate_action": "warn"}))
    _, _, train = parse_args(["--config", str(config)])
    assert [g.text for g in train.gates] == ["health/effective_rank_fraction>=0.25@500"] and train.gate_action == "warn"
    with pytest.raises(ValueError, match="evaluates no metric 'eval_los'.*gateable metrics: eval_loss"):
        parse_args(["--gate", "eval_los<6"])
    with pytest.raises(ValueError, match="evaluates no metric 'health/effective_rank'"):
        parse_args(["--architecture", "bert", "--gate", "health/effective_rank>5"])  # BERT has no concepts
    assert (
        parse_args(["--objective", "diffusion", "--gate", "eval_loss_t0.50<9"])[2].gates[0].metric == "eval_loss_t0.50"
    )
    with pytest.raises(ValueError, match="gate_action='halt'"):
        parse_args(["--gate_action", "halt"])
    out = subprocess.run([sys.executable, str(ROOT / "launch/check_plan.py"), "--profile", "cpu", "--gate", "eval_los<6"],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 2 and "evaluates no metric 'eval_los'" in out.stderr + out.stdout


def test_monitor_checks_from_the_gates_step_and_keeps_the_first_failure():
    monitor = GateMonitor([parse_gate("eval_loss<5@4"), parse_gate("eval_accuracy>0.1")])
    assert monitor.check(2, {"eval_loss": 9.0, "eval_accuracy": 0.2}) == []  # eval_loss not due before step 4
    assert monitor.summary()[0]["passed"] is None
    failed = monitor.check(4, {"eval_loss": 6.0, "eval_accuracy": 0.3})
    assert failed == [{"gate": "eval_loss<5@4", "value": 6.0, "step": 4, "passed": False}]
    monitor.check(6, {"eval_loss": 4.0, "eval_accuracy": 0.05})
    assert monitor.summary() == [
        {"gate": "eval_loss<5@4", "value": 6.0, "step": 4, "passed": False},  # its first failure stays
        {"gate": "eval_accuracy>0.1", "value": 0.05, "step": 6, "passed": False},
    ]


GATED = ["--max_steps", "6", "--eval_steps", "2", "--save_steps", "2"]


@pytest.mark.loop
def test_warn_logs_and_goes_on_stop_ends_with_checkpoint_final_model_and_exit_3(capsys):
    assert run("--run_name", "warned", *GATED, "--gate", "eval_loss<0@4", "--gate", "eval_loss<100",
               "--gate_action", "warn") == 0  # fmt: skip
    summary = json.loads(Path("runs/warned/summary.json").read_text())
    assert summary["steps"] == 6 and summary["stopped_by_gate"] is False
    evals = {r["step"]: r["eval_loss"] for r in records("warned", "eval")}
    assert summary["gates"] == [
        {"gate": "eval_loss<0@4", "value": evals[4], "step": 4, "passed": False},  # first checked at step 4, not 2
        {"gate": "eval_loss<100", "value": evals[6], "step": 6, "passed": True},
    ]
    logged = capsys.readouterr().out
    assert "gate failed: eval_loss<0@4 failed" in logged and "going on" in logged

    assert run("--run_name", "stopped", *GATED, "--gate", "eval_loss<0@4") == 3
    run_dir = Path("runs/stopped")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["stopped_by_gate"] is True and summary["gates"][0]["step"] == 4
    assert (run_dir / "checkpoints/step_0000004/train_state.json").exists()
    assert (run_dir / "final/model.safetensors").exists() and (run_dir / "final/README.md").exists()


@pytest.mark.loop
def test_resume_keeps_the_gates(monkeypatch, capsys):
    real = mlm.train_step
    calls = {"n": 0}

    def signal_after_three(*args, **kwargs):
        out = real(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    gated = [*GATED, "--max_steps", "8", "--gate", "eval_loss<100", "--gate", "eval_loss<0@6"]
    monkeypatch.setattr(mlm, "train_step", signal_after_three)
    assert run("--run_name", "resumed_gates", *gated) == 128 + signal.SIGTERM  # preempted after step 3, checkpointed
    monkeypatch.setattr(mlm, "train_step", real)
    state = json.loads(Path("runs/resumed_gates/checkpoints/step_0000003/train_state.json").read_text())
    assert state["gates"][0] == {**state["gates"][0], "step": 2, "passed": True}  # checked before the signal
    assert run("--run_name", "resumed_gates", *gated, "--resume_from_checkpoint", "auto") == 3
    summary = json.loads(Path("runs/resumed_gates/summary.json").read_text())
    assert summary["steps"] == 6 and [g["passed"] for g in summary["gates"]] == [True, False]
    metrics = Path("runs/resumed_gates/metrics.jsonl").read_text()
    capsys.readouterr()
    assert run("--run_name", "resumed_gates", *gated, "--resume_from_checkpoint", "auto") == 3  # stays rejected
    logged = capsys.readouterr().out
    assert "stopped by a gate" in logged and "--gate_action warn" in logged
    assert Path("runs/resumed_gates/metrics.jsonl").read_text() == metrics  # nothing trained, nothing written


@pytest.mark.loop
def test_compare_names_exactly_the_varied_argument(tmp_path):
    names = []
    for rate in ("1e-3", "2e-3", "4e-3"):
        names.append(f"lr{rate}")
        run("--run_name", names[-1], "--max_steps", "3", "--eval_steps", "3", "--learning_rate", rate)
    rows = [
        {"model": n, "task": "embedded", "metrics": ["accuracy"], "accuracy_mean": 0.1 * i} for i, n in enumerate(names)
    ]
    (tmp_path / "finetune_20260101-000000.json").write_text(json.dumps({"rows": rows}))  # a report naming them
    result = compare([Path("runs") / n for n in names], report_dir=tmp_path)
    assert result["metrics"]["finetune/embedded/accuracy"] == [0.0, 0.1, 0.2]
    assert list(result["differs"]) == ["training_args.learning_rate"]
    assert result["differs"]["training_args.learning_rate"] == [1e-3, 2e-3, 4e-3]
    summaries = [json.loads((Path("runs") / n / "summary.json").read_text()) for n in names]
    assert result["metrics"]["eval_loss"] == [s["eval_loss"] for s in summaries]
    delta = summaries[2]["eval_loss"] - summaries[0]["eval_loss"]
    assert f"({'+' if delta >= 0 else ''}{delta:.3g})" in Path(result["markdown"]).read_text()
    assert Path(result["png"]).stat().st_size > 10_000
    with pytest.raises(ValueError, match=f"{tmp_path} is not a run folder"):
        compare([Path("runs") / names[0], tmp_path], report_dir=tmp_path)


@pytest.mark.loop
def test_ablate_runs_each_value_names_the_winner_and_skips_finished_runs(capsys, monkeypatch):
    commands = []

    def in_process(command):  # the loop in this process instead of `accelerate launch` (seconds saved per run)
        commands.append(command)
        AcceleratorState._reset_state(reset_partial_state=True)
        code = mlm.main(command[command.index(str(ROOT / "loops" / "mlm.py")) + 1 :])
        return 1 if code else 0  # as `accelerate launch` reports it: a gate's 3 arrives as 1

    monkeypatch.setattr(ablate, "run_loop", in_process)
    loop = [*COMMON, "--output_dir", "runs", "--max_steps", "2", "--eval_steps", "2"]
    argv = ["--vary", "learning_rate=1e-4,5e-3", "--decide", "eval_loss", "--name", "abl", "--", *loop]
    assert ablate.main(argv) == 0
    out = capsys.readouterr().out
    losses = {lr: json.loads(Path(f"runs/abl-learning_rate{lr}/summary.json").read_text())["eval_loss"]
              for lr in ("1e-4", "5e-3")}  # fmt: skip
    best = min(losses, key=losses.get)
    assert f"winner by eval_loss (lower is better): abl-learning_rate{best}" in out
    assert "| training_args.learning_rate |" in out
    assert [c[c.index("--run_name") + 1] for c in commands] == ["abl-learning_rate1e-4", "abl-learning_rate5e-3"]
    assert all(c[:3] == [sys.executable, "-m", "accelerate.commands.launch"] for c in commands)
    assert ablate.main(argv) == 0
    again = capsys.readouterr().out
    assert again.count("finished earlier, skipped") == 2 and f"abl-learning_rate{best}" in again
    rejected = ["--vary", "learning_rate=1e-4,5e-3", "--decide", "eval_loss", "--name", "rej", "--", *loop,
                "--gate", "eval_loss<0"]  # fmt: skip
    assert ablate.main(rejected) == 0
    assert (
        "no winner: a gate rejected every run (rej-learning_rate1e-4, rej-learning_rate5e-3)" in capsys.readouterr().out
    )
    with pytest.raises(SystemExit) as refused:
        ablate.main(["--vary", "a=1,2", "--vary", "b=1,2", "--decide", "eval_loss", "--", *loop])
    assert refused.value.code == 2 and "one thing at a time" in capsys.readouterr().err
    with pytest.raises(SystemExit) as misspelt:  # refused before any run starts
        ablate.main(["--vary", "learning_rate=1e-4,5e-3", "--decide", "eval_los", "--name", "typo", "--", *loop])
    assert (
        misspelt.value.code == 2 and "--decide eval_los: the loop evaluates no such metric" in capsys.readouterr().err
    )
    assert not list(Path("runs").glob("typo-*"))
    with pytest.raises(SystemExit) as idle:  # an axis that only names or displays the runs
        ablate.main(["--vary", "progress_bar=true,false", "--decide", "eval_loss", "--name", "idle", "--", *loop])
    assert idle.value.code == 2 and "its values change no setting of the experiment" in capsys.readouterr().err
    changed = [a if a != "2" else "3" for a in argv]  # the same ablation, other --max_steps: not reused silently
    with pytest.raises(SystemExit) as stale:
        ablate.main(changed)
    assert stale.value.code == 2
    assert "abl-learning_rate1e-4 was run with other settings (training_args.max_steps: the run has 2, this " \
           "invocation 3" in capsys.readouterr().err  # fmt: skip

    def interrupted(command):
        raise KeyboardInterrupt

    monkeypatch.setattr(ablate, "run_loop", interrupted)
    fresh = ["--vary", "learning_rate=1e-4,5e-3", "--decide", "eval_loss", "--name", "ctrlc", "--", *loop]
    assert ablate.main(fresh) == 130
    assert capsys.readouterr().err.strip().startswith("interrupted: rerun the same command to continue")

    def terminated(command):  # SIGTERM to the tool while it waits on a launch
        from concept_encoder.common.entry import Terminated

        raise Terminated

    monkeypatch.setattr(ablate, "run_loop", terminated)
    assert ablate.main(fresh) == 143
    assert capsys.readouterr().err.strip().startswith("interrupted: rerun the same command to continue")
    monkeypatch.setattr(ablate, "run_loop", in_process)
    sigterm_after(monkeypatch, calls=1)  # the loop checkpoints at step 1 and exits 143, which the launcher says as 1
    signalled = ["--vary", "learning_rate=1e-4,5e-3", "--decide", "eval_loss", "--name", "sig", "--", *loop]
    assert ablate.main(signalled) == 1  # no comparison of a run that has not ended
    assert ("sig-learning_rate1e-4 was stopped by a signal at step 1 (checkpointed); rerun the same command"
            in capsys.readouterr().err)  # fmt: skip
    assert json.loads(Path("runs/sig-learning_rate1e-4/summary.json").read_text())["preempted"]
    assert not Path("runs/sig-learning_rate5e-3").exists()  # the second value was not started


@pytest.mark.loop
def test_ablate_checks_each_final_model_on_held_out_text_and_decides_by_it(capsys, monkeypatch, tmp_path):
    def in_process(command):
        AcceleratorState._reset_state(reset_partial_state=True)
        code = mlm.main(command[command.index(str(ROOT / "loops" / "mlm.py")) + 1 :])
        return 1 if code else 0

    checks = []
    real_check = ablate.heldout_check
    monkeypatch.setattr(ablate, "run_loop", in_process)
    monkeypatch.setattr(
        ablate, "heldout_check", lambda run_dir, spec: checks.append(run_dir.name) or real_check(run_dir, spec)
    )
    text = tmp_path / "river.txt"  # English of another domain than the pretraining corpus
    text.write_text("\n\n".join(f"The river {i} runs past the old mill and the farm by the hill." for i in range(60)))
    loop = [*COMMON, "--output_dir", "runs", "--max_steps", "2", "--eval_steps", "2"]
    metric = "heldout/river/accuracy_over_unigram"
    argv = [
        "--vary",
        "learning_rate=1e-4,5e-3",
        "--heldout",
        str(text),
        "--decide",
        metric,
        "--name",
        "held",
        "--",
        *loop,
    ]
    assert ablate.main(argv) == 0
    out = capsys.readouterr().out
    ratios = {}
    for lr in ("1e-4", "5e-3"):
        record = json.loads(Path(f"runs/held-learning_rate{lr}/heldout-river.json").read_text())
        assert record["text"] == str(text) and record["masked_tokens"] > 0
        assert record["accuracy_over_unigram"] == pytest.approx(
            record["masked_token_accuracy"] / record["unigram_baseline_accuracy"]
        )
        ratios[lr] = record["accuracy_over_unigram"]
    assert f"| {metric} |" in out
    winner = re.search(rf"winner by {metric} \(higher is better\): held-learning_rate(\S+) ", out).group(1)
    assert ratios[winner] == max(ratios.values())  # (two steps may leave both at the same ratio)

    loser = "1e-4" if winner == "5e-3" else "5e-3"  # make the other run the clear winner by its saved check
    path = Path(f"runs/held-learning_rate{loser}/heldout-river.json")
    path.write_text(json.dumps({**json.loads(path.read_text()), "accuracy_over_unigram": ratios[winner] + 1.0}))
    saved = {p: p.stat().st_mtime_ns for p in Path("runs").glob("held-*/heldout-river.json")}
    assert ablate.main(argv) == 0  # the same text: checks reused, not rerun, and the decision follows them
    assert {p: p.stat().st_mtime_ns for p in saved} == saved
    assert f"winner by {metric} (higher is better): held-learning_rate{loser} " in capsys.readouterr().out
    text.write_text(text.read_text() + "\n\nA new paragraph about the mill pond and the geese on it.\n")
    assert ablate.main(argv) == 0  # the text changed: checked again
    assert all(p.stat().st_mtime_ns != t for p, t in saved.items())
    capsys.readouterr()

    for bad, message in [  # refused before any run or check starts
        ([*argv[:3], str(tmp_path / "missing.txt"), *argv[4:]], "--heldout '.*missing.txt': no such file"),
        ([a for a in argv if a not in ("--heldout", str(text))], f"--decide {metric}: the loop evaluates no such"),
    ]:
        before = len(checks)
        with pytest.raises(SystemExit) as refused:
            ablate.main(bad)
        assert refused.value.code == 2
        assert re.search(message, capsys.readouterr().err) and len(checks) == before


@pytest.mark.loop
def test_compare_shows_an_unfinished_run_and_a_cut_metrics_line_is_named_not_fatal(finished_run, tmp_path, monkeypatch):
    from concept_encoder.common import metrics_log
    from concept_encoder.decide.compare import compare

    warnings = []
    monkeypatch.setattr(metrics_log.logger, "warning", lambda text, *args: warnings.append(text % args))
    going = tmp_path / "going"
    going.mkdir()
    shutil.copy(finished_run / "config.json", going / "config.json")
    lines = (finished_run / "metrics.jsonl").read_text().splitlines()
    (going / "metrics.jsonl").write_text("\n".join(lines[:-1]) + '\n{"kind": "train", "step": 6, "lo')  # cut short
    result = compare([finished_run, going], report_dir=tmp_path / "reports")
    last_step = max(json.loads(line)["step"] for line in lines[:-1])
    assert f"going (running / unfinished, step {last_step})" in result["text"]
    assert result["metrics"]["eval_loss"][1] == [json.loads(x) for x in lines[:-1] if '"eval"' in x][-1]["eval_loss"]
    assert warnings == [f"{going / 'metrics.jsonl'} line {len(lines)} is not a metrics record (cut short?): skipped"]
    stopped = tmp_path / "stopped"  # a signal stopped it: the summary is written, marked preempted
    shutil.copytree(finished_run, stopped)
    summary = json.loads((stopped / "summary.json").read_text())
    (stopped / "summary.json").write_text(json.dumps({**summary, "preempted": True, "steps": 3}))
    assert "stopped (running / unfinished, step 3)" in compare([finished_run, stopped], report_dir=tmp_path)["text"]
    (stopped / "summary.json").write_text(
        json.dumps({**summary, "steps": 3, "max_time": {"stopped_by_max_time": True}})
    )
    assert "stopped (stopped by --max_time at step 3)" in compare([finished_run, stopped], report_dir=tmp_path)["text"]
    metrics_log.MetricsWriter(going / "metrics.jsonl").drop_after(3)  # what a resume does: the cut line goes too
    assert [r["step"] for r in metrics_log.read_metrics(going / "metrics.jsonl")] == [
        json.loads(x)["step"] for x in lines[:-1] if json.loads(x)["step"] <= 3
    ]


@pytest.mark.loop
def test_reports_of_invocations_started_in_the_same_second_never_collide(finished_run, tmp_path):
    from concept_encoder.common.report_files import claim_report_folder
    from concept_encoder.decide.compare import compare
    from concept_encoder.finetuning.report import write_report

    first, second = (compare([finished_run], report_dir=tmp_path) for _ in range(2))
    assert first["markdown"] != second["markdown"]  # e.g. compare_<time>.md and compare_<time>_02.md
    for result in (first, second):  # each report whole, with its own plot
        assert (
            Path(result["png"]).is_file() and f"]({Path(result['png']).name})" in Path(result["markdown"]).read_text()
        )
    run_result = {"model": "m", "method": "fine-tune", "task": "t", "seed": 1, "validation": {"accuracy": 0.5},
                  "seconds": 1, "learning_rate": 1e-3, "best_step": 2}  # fmt: skip
    reports = [write_report([run_result], {}, tmp_path, "title")["json"] for _ in range(3)]
    assert len(set(reports)) == 3 and all(json.loads(p.read_text())["runs"] == [run_result] for p in reports)
    assert sorted(reports) == reports  # claimed order is name order: the newest report sorts last
    folders = [claim_report_folder(tmp_path, "zero_compare") for _ in range(3)]
    assert len(set(folders)) == 3 and all(f.is_dir() and not any(f.iterdir()) for f in folders)
    assert sorted(folders) == folders


def test_a_run_whose_deciding_metric_is_not_finite_never_wins():
    runs = [("a", Path("a")), ("b", Path("b")), ("c", Path("c"))]
    result = {"metrics": {"eval_loss": [float("nan"), 5.0, float("-inf")], "health/x": [0.9, None, 0.5]}}
    assert ablate.choose_winner(result, runs, "eval_loss", "lower", rejected=set()) == ("b", 5.0)
    assert ablate.choose_winner(result, runs, "eval_loss", "higher", rejected=set()) == ("b", 5.0)
    assert ablate.choose_winner(result, runs, "health/x", "higher", rejected={"a"}) == ("c", 0.5)
    assert ablate.choose_winner(result, runs, "eval_loss", "lower", rejected={"b"}) is None


def test_distinct_values_always_get_distinct_run_names():
    values = ["orthogonality,uniformity", "orthogonality;uniformity", "orthogonality uniformity", "0.1", "1e-3"]
    names = [ablate.run_name_for("abl", "concept_losses", v) for v in values]
    assert len(set(names)) == len(values)
    assert names[3:] == ["abl-concept_losses0.1", "abl-concept_losses1e-3"]  # nothing folded: the value itself
    assert all(re.fullmatch(r"[\w.-]+", name) for name in names)


def test_a_run_folder_whose_files_are_not_json_objects_is_one_clear_error(tmp_path):
    for name, text, message in (("list", "[1]", "config.json holds a JSON list, not an object"),
                                ("garbage", "{not json", "config.json is not JSON")):  # fmt: skip
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(text)
        (folder / "metrics.jsonl").write_text('{"step": 1, "kind": "train", "loss": 1.0}\n')
        with pytest.raises(ValueError, match=message):
            compare([folder])


def test_a_failed_resume_is_not_read_as_the_signal_stop_an_earlier_launch_recorded(tmp_path):
    """A run stopped by a signal keeps its summary.json (preempted) until it writes the next; a resume that then
    fails is a failure, not that stop again."""
    import time

    from concept_encoder.training.runs import unfinished_launch

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    summary = run_dir / "summary.json"
    summary.write_text(json.dumps({"steps": 5, "preempted": True}))
    earlier = time.time() - 60
    os.utime(summary, (earlier, earlier))  # the earlier launch's
    assert unfinished_launch(run_dir, 1, started=time.time()) == "failed (exit code 1)"
    assert unfinished_launch(run_dir, 1, started=earlier - 1) == "was stopped by a signal at step 5 (checkpointed)"
    assert unfinished_launch(run_dir, 0, started=time.time()) == "ended with exit code 0 but without its final model"
