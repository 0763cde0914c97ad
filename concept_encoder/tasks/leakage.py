"""Pretraining on a task's text and scoring on its held-out splits: the guard between the two.

`--dataset ...,task:<name>` pretrains on the texts of a task's training split as fine-tuning carves it with its
default fractions (`loading.training_texts`). Fine-tuning with other fractions (`--dev_fraction 0.2` carves a
larger dev split, part of it texts pretraining read), or on another task made of the same sentences
(`embedded_pairs` pairs `embedded`'s), would select and score a model on text it was pretrained on. So a
pretraining run records in its model's config which task texts it read (`pretraining_task_texts`: task name →
digest of the texts), and fine-tuning or probing that model refuses a task whose dev or validation split holds
any of them, before any training.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from ..data.mixture import is_mixture, parse_mixture
from ..data.sources import texts_digest
from .loading import TaskData, training_texts

CONFIG_KEY = "pretraining_task_texts"
logger = logging.getLogger("concept_encoder")

TaskTexts = Callable[[str], list[str]]


def task_text_record(dataset: str, task_texts: TaskTexts = training_texts) -> dict[str, str]:
    """{task name: digest of the training texts read} for each `task:<name>` part of `dataset` ({} for none)."""
    if not is_mixture(dataset):
        return {}
    return {p.task: texts_digest(task_texts(p.task)) for p in parse_mixture(dataset) if p.task is not None}


def record_task_texts(config, dataset: str, task_texts: TaskTexts = training_texts) -> None:
    """Write `task_text_record(dataset)` into a model's `config` (saved with it) when the dataset has task texts."""
    if record := task_text_record(dataset, task_texts):
        setattr(config, CONFIG_KEY, record)


def held_out_texts(task: TaskData) -> set[str]:
    """Every text of the task's dev and validation splits (both texts of a pair)."""
    columns = ("text_a", "text_b") if task.pair else ("text_a",)
    return {text for split in (task.dev, task.validation) for column in columns for text in split[column]}


def pretraining_overlap(model: str, config, task: TaskData, task_texts: TaskTexts = training_texts) -> str | None:
    """Why `model` (its `config`) may not be fine-tuned or probed on `task`: the task texts it was pretrained on
    include some of the task's dev or validation texts; None when they include none (or it read no task text).
    When a task's texts no longer digest as they did in pretraining (another Python's docstrings, an edited
    file), the texts read then are unknown: a warning says so and today's texts are checked."""
    record = getattr(config, CONFIG_KEY, None) or {}
    held = held_out_texts(task)
    for name, digest in record.items():
        texts = task_texts(name)
        if texts_digest(texts) != digest:
            logger.warning("%s: the training texts of task %s differ from those it was pretrained on (digest %s, "
                           "now %s): the held-out check reads today's", model, name, digest, texts_digest(texts))  # fmt: skip
        if shared := sorted(held.intersection(texts)):
            if name == task.name:
                how = ("fine-tune it with the default --dev_fraction and --validation_fraction, which carve the "
                       "splits its pretraining left out")  # fmt: skip
            else:
                how = f"pretrain on task:{task.name} instead, whose held-out splits are left out"
            return (
                f"{model} was pretrained on the training texts of task {name} (--dataset ...,task:{name}), and "
                f"{len(shared)} of them stand in the dev or validation split of {task.name} as carved now (e.g. "
                f"{shared[0][:60]!r}): it would be selected and scored on text it has read; {how} (its twin, "
                "--from_scratch, read nothing)"
            )
    return None
