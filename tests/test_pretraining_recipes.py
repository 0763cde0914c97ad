"""Pretraining that pays at small budgets: `--dataset` mixtures with a task's training texts (task-adaptive
pretraining, `task:<name>`) and `--recipe budget`."""

import json
import math
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from loop_runs import fresh_accelerate, records, run, workdir  # noqa: F401 (fixtures)

import loops.finetune as finetune
from concept_encoder.common.dataclass_args import to_argv
from concept_encoder.data.base import DataSourceError
from concept_encoder.data.mixture import repetition
from concept_encoder.data.sources import load_raw_dataset, texts_digest
from concept_encoder.decide.ablate import parse_vary
from concept_encoder.decide.experiments import plan_architecture
from concept_encoder.tasks.arguments import TaskArguments
from concept_encoder.tasks.leakage import (
    held_out_texts,
    planned_overlap,
    pretraining_overlap,
    record_task_texts,
    task_text_record,
)
from concept_encoder.tasks.loading import load_task, training_texts
from concept_encoder.training.args import FINETUNE_ARGUMENT_CLASSES, parse_args
from concept_encoder.training.optim import build_scheduler


@pytest.mark.parametrize("task", ["embedded", "embedded_pairs"])
def test_task_sources_never_read_dev_or_validation_texts(task):
    data = load_task(TaskArguments(task=task))
    columns = ["text_a", "text_b"] if data.pair else ["text_a"]
    held = {text for split in (data.dev, data.validation) for c in columns for text in split[c]}
    trained = {text for c in columns for text in data.train[c]}
    texts = training_texts(task)
    assert texts and len(texts) == len(set(texts)) and set(texts) <= trained and not set(texts) & held
    if data.pair:  # a sentence can stand in a training pair and a dev pair: such a sentence is left out
        assert trained & held and set(texts) == trained - held
    raw = load_raw_dataset(f"embedded,task:{task}*3", task_texts=training_texts)
    read = set(raw["train"]["text"]) | set(raw["validation"]["text"])
    assert set(texts) <= read and not read & held


def test_weights_repeat_training_documents_seeded_and_shuffled_and_validation_is_read_once():
    texts = [f"document {i}: " + "words of it " * 10 for i in range(40)]
    raw = load_raw_dataset("task:own*2.5", task_texts=lambda name: texts)
    train, validation = raw["train"]["text"], raw["validation"]["text"]
    assert len(validation) == 2 and not set(validation) & set(train)  # 5% of 40 held out, each once
    counts = Counter(train)
    assert len(counts) == 38 and sorted(Counter(counts.values()).items()) == [(2, 19), (3, 19)]  # 2x, half 3x
    assert load_raw_dataset("task:own*2.5", task_texts=lambda name: texts)["train"]["text"] == train  # seeded
    listed = [sorted(counts)[i] for i in repetition(38, 2.5, 0)]
    assert train != listed  # shuffled: a block does not hold one document's copies side by side
    assert repetition(4, 0.5, 1) == repetition(4, 0.5, 1) and len(repetition(4, 0.5, 1)) == 2


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("embedded,,docstrings", "an empty source in the mixture"),
        ("embedded*0", "'embedded*0' has weight '0'; a weight is a positive number"),
        ("embedded*x", "has weight 'x'"),
        ("embedded*inf", "has weight 'inf'"),
        ("embedded,docstrings*2,embedded", "['embedded'] given twice"),
        ("embedded,task:", "task: needs a task's name"),
        ("embedded,task:nope", "task:nope is no task"),
        ("task:needle:abc", "give the haystack's length in words"),
    ],
)
def test_a_malformed_mixture_is_refused_at_parse_time(spec, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("*", r"\*")):
        parse_args(["--dataset", spec])


def test_a_mixture_is_not_streamed_and_task_texts_need_a_reader_that_knows_tasks():
    with pytest.raises(ValueError, match="is a mixture, read whole: leave out --streaming"):
        parse_args(["--dataset", "embedded,task:embedded", "--streaming"])
    with pytest.raises(DataSourceError, match="task:<name> sources are read by the pretraining loop"):
        load_raw_dataset("embedded,task:embedded")  # the data layer alone (python -m concept_encoder data)
    with pytest.raises(DataSourceError, match="weight 0.01 of task:own keeps none of its 9 training"):
        load_raw_dataset("task:own*0.01", task_texts=lambda name: [f"text {i}" for i in range(10)])


def test_the_curve_and_the_ablation_take_a_mixture():
    plan, _ = plan_architecture("concept", [20_000], ["--dataset", "docstrings,task:embedded*8", "--preset", "micro"],
                                "c", 1)  # fmt: skip
    assert plan.loop_args[1].dataset == "docstrings,task:embedded*8"
    assert parse_vary(["dataset=docstrings|docstrings,task:embedded*8"]) == (
        "dataset", ["docstrings", "docstrings,task:embedded*8"],
    )  # fmt: skip
    assert parse_vary(["mlm_probability=0.15,0.25"]) == ("mlm_probability", ["0.15", "0.25"])


def test_the_budget_recipe_sets_its_values_where_nothing_else_does(tmp_path):
    model, data, train = parse_args(["--recipe", "budget", "--preset", "micro"])
    assert (train.learning_rate, train.lr_scheduler_type, train.warmup_ratio, data.mlm_probability) == (
        1e-3, "linear", 0.06, 0.25,
    )  # fmt: skip
    assert (
        model.hidden_dropout_prob == 0.0
        and parse_args(["--recipe", "budget", "--architecture", "bert"])[0].hidden_dropout_prob == 0.0
    )
    _, data, train = parse_args(["--recipe", "budget", "--learning_rate", "5e-4", "--mlm_probability", "0.15"])
    assert (train.learning_rate, data.mlm_probability) == (5e-4, 0.15)  # given, though equal to the plain defaults
    config = tmp_path / "run.yaml"
    config.write_text("recipe: budget\nlearning_rate: 0.002\n")
    _, data, train = parse_args(["--config", str(config)])
    assert (train.recipe, train.learning_rate, data.mlm_probability) == ("budget", 2e-3, 0.25)
    parsed = parse_args(["--recipe", "budget", "--learning_rate", "5e-4", "--architecture", "bert"])
    assert parse_args(to_argv(*parsed)) == parsed
    folder = parse_args(["--recipe", "budget", "--model_name_or_path", str(tmp_path)])[0]  # keeps its own dropout
    assert folder.hidden_dropout_prob is None
    with pytest.raises(ValueError, match="recipe='fast' is unknown; choose one of"):
        parse_args(["--recipe", "fast"])
    with pytest.raises(ValueError, match=r"does not support \['--recipe'\]"):
        parse_args(["--model_name_or_path", ".", "--recipe", "budget"], FINETUNE_ARGUMENT_CLASSES)


def test_the_budget_schedule_warms_up_to_its_peak_and_reaches_zero_at_the_last_step():
    _, _, train = parse_args(["--recipe", "budget", "--max_steps", "50"])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=train.learning_rate)
    scheduler = build_scheduler(optimizer, train)
    rates = []
    for _ in range(train.max_steps):
        optimizer.step()
        scheduler.step()
        rates.append(scheduler.get_last_lr()[0])
    assert train.num_warmup_steps == 3 and rates[2] == pytest.approx(1e-3) == max(rates)
    assert rates[-1] == 0.0 and all(r > 0 for r in rates[:-1])


def test_a_task_adaptive_budget_run_trains_on_the_mixture_and_ends_at_rate_zero():
    assert run("--run_name", "tapt", "--max_steps", "4", "--dataset", "embedded,task:embedded*2", "--recipe",
               "budget") == 0  # fmt: skip
    config = json.loads(Path("runs/tapt/config.json").read_text())
    assert config["data_args"]["dataset"] == "embedded,task:embedded*2"
    assert (config["training_args"]["recipe"], config["data_args"]["mlm_probability"]) == ("budget", 0.25)
    embedded, task = len(load_raw_dataset("embedded")["train"]), len(training_texts("embedded"))
    assert config["data_stats"]["train"]["documents"] == embedded + 2 * (task - math.ceil(0.05 * task))  # 5% held
    assert records("tapt", "train")[-1]["lr"] == 0.0
    final = Path("runs/tapt/final")  # the model says which task texts it read; fine-tuning checks them
    saved = json.loads((final / "config.json").read_text())["pretraining_task_texts"]
    assert saved == {"embedded": texts_digest(training_texts("embedded"))}
    common = ["--model_name_or_path", str(final), "--max_steps", "2", "--report_to", "none", "--output_dir", "ft"]
    with pytest.raises(ValueError, match=r"runs/tapt/final was pretrained on the training texts of task embedded .*"
                       r"stand in the dev or validation split of embedded .* default --dev_fraction"):  # fmt: skip
        finetune.main([*common, "--task", "embedded", "--dev_fraction", "0.2"])
    with pytest.raises(ValueError, match="split of embedded_pairs .* pretrain on task:embedded_pairs instead"):
        finetune.main([*common, "--task", "embedded_pairs"])
    assert not Path("ft").exists()  # refused before any run folder


def test_the_held_out_check_names_what_overlaps_and_passes_the_splits_pretraining_left_out(caplog):
    record = task_text_record("embedded,task:embedded*2")
    assert record == {"embedded": texts_digest(training_texts("embedded"))} and task_text_record("embedded") == {}
    config = SimpleNamespace(pretraining_task_texts={"earlier": "feedfacecafe"})  # a model continued from
    record_task_texts(config, "embedded,task:embedded*2")
    assert config.pretraining_task_texts == {"earlier": "feedfacecafe", **record}
    config = SimpleNamespace(pretraining_task_texts=record)
    assert pretraining_overlap("m", config, load_task(TaskArguments(task="embedded"))) is None
    assert pretraining_overlap("m", SimpleNamespace(), load_task(TaskArguments(task="embedded_pairs"))) is None
    for fractions in ({"dev_fraction": 0.2}, {"validation_fraction": 0.3}):  # other splits hold read texts
        task = load_task(TaskArguments(task="embedded", **fractions))
        shared = held_out_texts(task) & set(training_texts("embedded"))
        assert shared and f"{len(shared)} of them stand in" in pretraining_overlap("m", config, task)
    assert planned_overlap("embedded,task:embedded", task) and not planned_overlap("embedded", task)  # drivers
    own = ["a sentence only this task has", "another one"]  # a task's texts that changed since: a warning
    changed = SimpleNamespace(pretraining_task_texts={"own": "0123456789ab"})
    assert pretraining_overlap("m", changed, load_task(TaskArguments(task="embedded")), lambda name: own) is None
    assert "differ from those pretraining read (digest 0123456789ab" in caplog.text
