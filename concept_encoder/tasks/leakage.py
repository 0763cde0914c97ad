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

from ..data.mixture import is_mixture, parse_mixture
from ..data.sources import TaskTexts, texts_digest
from .loading import TaskData, held_out_texts, training_texts
from .recall import is_recall, recall_pairs

CONFIG_KEY = "pretraining_task_texts"
logger = logging.getLogger("concept_encoder")


def task_text_record(dataset: str, task_texts: TaskTexts = training_texts) -> dict[str, str]:
    """{task name: digest of the training texts read} for each `task:<name>` part of `dataset` ({} for none)."""
    if not is_mixture(dataset):
        return {}
    return {p.task: texts_digest(task_texts(p.task)) for p in parse_mixture(dataset) if p.task is not None}


def record_task_texts(config, dataset: str, task_texts: TaskTexts = training_texts) -> None:
    """Add `task_text_record(dataset)` to a model's `config` (saved with it) when the dataset has task texts,
    beside what a model it continues from had read."""
    if record := task_text_record(dataset, task_texts):
        setattr(config, CONFIG_KEY, {**(getattr(config, CONFIG_KEY, None) or {}), **record})


def shared_held_out(record: dict[str, str], task: TaskData, task_texts: TaskTexts) -> tuple[str, list[str]] | None:
    """(name, texts) of the first recorded task whose training texts stand in `task`'s dev or validation split.
    When a task's texts no longer digest as recorded (another Python's docstrings, an edited file), the texts
    read in pretraining are unknown: a warning says so and today's texts are checked."""
    held = held_out_texts(task)
    for name, digest in record.items():
        texts = task_texts(name)
        if digest is not None and texts_digest(texts) != digest:
            logger.warning("the training texts of task %s differ from those pretraining read (digest %s, now %s): "
                           "the held-out check reads today's", name, digest, texts_digest(texts))  # fmt: skip
        # recall: an example is its pairs (pretraining reads them with other queries answered, `answered`)
        same = recall_pairs if is_recall(task.name) or is_recall(name) else (lambda text: text)
        read = {same(text) for text in texts}
        if shared := sorted(text for text in held if same(text) in read):
            return name, shared
    return None


def overlap_message(subject: str, name: str, shared: list[str], task: TaskData) -> str:
    if name == task.name:
        how = ("fine-tune with the default --dev_fraction and --validation_fraction, which carve the splits "
               "task-text pretraining leaves out")  # fmt: skip
    else:
        how = f"pretrain on task:{task.name} instead, whose held-out splits are left out"
    return (
        f"{subject} the training texts of task {name} (task:{name}), and {len(shared)} of them stand in the dev or "
        f"validation split of {task.name} as carved here (e.g. {shared[0][:60]!r}): the model would be selected "
        f"and scored on text it has read; {how} (a --from_scratch twin reads nothing and is not checked)"
    )


def pretraining_overlap(model: str, config, task: TaskData, task_texts: TaskTexts = training_texts) -> str | None:
    """Why `model` (its `config`) may not be fine-tuned or probed on `task`: the task texts it was pretrained on
    include some of the task's dev or validation texts; None when they include none (or it read no task text)."""
    found = shared_held_out(getattr(config, CONFIG_KEY, None) or {}, task, task_texts)
    return found and overlap_message(f"{model} was pretrained on", *found, task)


def planned_overlap(dataset: str, task: TaskData, task_texts: TaskTexts = training_texts) -> str | None:
    """The same, for a pretraining on `dataset` not yet run (a driver checks it before hours of pretraining)."""
    if not is_mixture(dataset):
        return None
    record = {p.task: None for p in parse_mixture(dataset) if p.task is not None}
    found = shared_held_out(record, task, task_texts)
    return found and overlap_message(f"pretraining on --dataset {dataset!r} reads", *found, task)
