"""The recipes driver (`python -m concept_encoder recipes`) on `micro` with a tiny teacher: every arm pretrained
as it says, each beside its twin (shared where the tokenizers are one), the report, reuse, bad plans."""

import json
from pathlib import Path

import pytest
from accelerate.state import AcceleratorState, GradientState
from loop_runs import launch_in_process, tiny_teacher

from concept_encoder.decide import experiments, recipes

PRETRAIN = ["--preset", "micro", "--tokenizer", "train:wordpiece:1000", "--report_to", "none", "--progress_bar",
            "false", "--per_device_train_batch_size", "4", "--max_seq_length", "32", "--logging_steps", "1",
            "--eval_steps", "0", "--save_steps", "0", "--max_eval_batches", "1", "--output_dir", "runs"]  # fmt: skip
FINETUNE = ("--max_steps 2 --eval_steps 1 --learning_rates 1e-3 --seeds 1 --per_device_train_batch_size 8 "
            "--per_device_eval_batch_size 64 --report_to none --progress_bar false")  # fmt: skip


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """The embedded task cut to 10 sentences a package, a tiny teacher, the loops run in this process."""
    from concept_encoder.data import stdlib_sentences

    monkeypatch.setattr(stdlib_sentences, "PER_PACKAGE", 10)
    monkeypatch.chdir(tmp_path)
    teacher = tiny_teacher(tmp_path / "teacher")
    commands = []
    monkeypatch.setattr(experiments, "run_command", launch_in_process(commands))
    yield teacher, commands
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


ARMS = "default,tapt,budget,distill-init"  # distill alone: distill-init without the init (arm_arguments, below)


def argv(teacher, *extra):
    return ["--tokens", "256", "--tasks", "embedded", "--architectures", "concept", "--corpus", "embedded",
            "--arms", ARMS, "--teacher", str(teacher), "--finetune_args", FINETUNE, *extra, "--", *PRETRAIN]  # fmt: skip


@pytest.mark.loop
def test_every_arm_is_pretrained_as_named_and_stands_beside_its_twin(workspace, capsys):
    teacher, commands = workspace
    assert recipes.main(argv(teacher)) == 0
    [report] = Path("Cache/reports").glob("recipes_*.json")
    assert {p.suffix for p in report.parent.glob(f"{report.stem}.*")} == {".md", ".json", ".png"}
    rows = json.loads(report.read_text())["rows"]
    assert [r["arm"] for r in rows] == ARMS.split(",") and all(r["task"] == "embedded" for r in rows)
    for r in rows:
        assert 0 <= r["accuracy_mean"] <= 1 and len(r["accuracy_seeds"]) == 1 and "accuracy_mean" in r["twin"]
        assert r["gain"] == pytest.approx(r["accuracy_mean"] - r["twin"]["accuracy_mean"])
    settings = {r["arm"]: json.loads((Path(r["model"]).parents[1] / "config.json").read_text()) for r in rows}
    assert settings["tapt"]["data_args"]["dataset"] == "embedded,task:embedded*8"
    assert settings["budget"]["training_args"]["recipe"] == "budget"
    assert settings["distill-init"]["training_args"]["teacher"] == str(teacher)
    assert settings["distill-init"]["training_args"]["teacher_embedding_init"] is True
    assert settings["distill-init"]["data_args"]["tokenizer"] == str(teacher)
    # default and budget read the corpus' tokenizer: one twin; tapt and distill-init have their own
    twins = sorted(p.stem for p in Path("Cache/recipes/recipes/tasks/embedded/points").glob("concept-twin-*.json"))
    assert len(twins) == 3 and len({r["twin"]["accuracy_seeds"][0] for r in rows}) <= 3
    assert any("goal (+2 points, > 2 SE on every task)" in line for line in json.loads(report.read_text())["goals"])
    assert recipes.arm_arguments("distill-init", "c", "t", 8, "T")[:-3] == recipes.arm_arguments(
        "distill", "c", "t", 8, "T"
    )
    launched = len(commands)
    assert recipes.main(argv(teacher)) == 0 and len(commands) == launched  # a rerun reuses every run and point


@pytest.mark.parametrize(
    ("extra", "loop_extra", "message"),
    [
        (["--arms", "default,fancy"], [], "--arms 'default,fancy': ['fancy'] unknown; choose from"),
        (["--tokens", "256,512"], [], "give one budget"),
        (["--teacher", "nowhere"], [], "make reference fetches the default teacher"),
        ([], ["--recipe", "budget"], "['--recipe'] are set per arm by the recipes driver"),
        (
            ["--arms", "tapt", "--finetune_args", "--seeds 1 --dev_fraction 0.2"],
            [],  # dev would hold read text
            "pretraining on --dataset 'embedded,task:embedded*8' reads the training texts of task embedded",
        ),
    ],
)
def test_bad_plans_are_refused_before_any_run(tmp_path, monkeypatch, capsys, extra, loop_extra, message):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(experiments, "run_command", lambda command: pytest.fail("a run started"))
    with pytest.raises(SystemExit) as ended:
        recipes.main([*argv(tmp_path, *extra), *loop_extra])
    assert ended.value.code == 2 and message in capsys.readouterr().err


def test_a_goal_read_before_every_planned_task_is_measured_is_not_yet_decided():
    def row(task, gain, se, arm="mlm"):
        return {"task": task, "architecture": "concept", "arm": arm, "gain": gain, "gain_se": se, "probes": {},
                "accuracy_mean": 0.9, "tfidf": 0.8}  # fmt: skip

    planned = ["embedded", "embedded_pairs"]
    assert recipes.goal_lines([row("embedded", 0.05, 3.0)], planned)[0].endswith(
        "goal (+2 points, > 2 SE on every task) not yet decided (embedded_pairs not measured yet)"
    )
    assert recipes.goal_lines([row("embedded", 0.01, 3.0)], planned)[0].endswith("missed")  # missed where measured
    both = [row("embedded", 0.05, 3.0), row("embedded_pairs", 0.03, 2.5)]
    assert recipes.goal_lines(both, planned)[0].endswith("met")
    distilled = [row("embedded", 0.05, 3.0, "distill")]
    assert any("against the goal 0.828" in g for g in recipes.goal_lines(distilled, planned))
    assert not any("0.828" in g for g in recipes.goal_lines(distilled, planned, default_teacher=False))
