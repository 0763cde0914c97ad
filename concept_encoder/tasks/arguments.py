"""`TaskArguments`: which downstream task, and how its examples and splits are made (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .listops import parse_listops
from .recall import is_recall, parse_recall

TASK_TYPES = ("auto", "single_label_classification", "regression", "multi_label_classification")
EMBEDDED_TASKS = ("embedded", "embedded_pairs")
NEEDLE_PREFIX = "needle:"
MODULES_PACKAGE = "modules_package"
MODULES_SPLICED = "modules_spliced"
LONG_TASKS = (f"{NEEDLE_PREFIX}<words>", MODULES_PACKAGE, MODULES_SPLICED)  # tasks/long_documents.py
LISTOPS_TASKS = ("listops", "listops:<max_length>[:<train examples>]")  # tasks/listops.py (LRA ListOps, generated)
RECALL_TASKS = ("recall:<K>[:<keys>:<values>[:<train examples>]]",)  # tasks/recall.py (associative recall)
MIN_NEEDLE_WORDS = 16


def needle_words(task: str) -> int:
    """N of `needle:N`; ValueError naming the form when it is not a whole number >= MIN_NEEDLE_WORDS."""
    value = task[len(NEEDLE_PREFIX) :]
    if not value.isdigit() or int(value) < MIN_NEEDLE_WORDS:
        raise ValueError(
            f"task={task!r}: give the haystack's length in words, a whole number >= {MIN_NEEDLE_WORDS}, e.g. "
            "needle:2048 (about 4k tokens with the default tokenizer)"
        )
    return int(value)


def is_listops(task: str) -> bool:
    return task == "listops" or task.startswith("listops:")


GLUE_TASKS = ("cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte")


@dataclass
class TaskArguments:
    """The task: `embedded`, `embedded_pairs`, the long-document tasks `needle:<words>`, `modules_package` and
    `modules_spliced`, LRA's ListOps (`listops`, `listops:<max_length>[:<train>]`, generated), associative recall
    (`recall:<K>[:<keys>:<values>[:<train>]]`, generated), `glue:<name>` or a local .csv/.tsv/.jsonl file or folder."""

    task: str = field(
        default="embedded",
        metadata={
            "help": f"{EMBEDDED_TASKS}, long documents {LONG_TASKS}, {LISTOPS_TASKS}, {RECALL_TASKS}, glue:<{'|'.join(GLUE_TASKS)}>, or a local "
            ".csv/.tsv/.jsonl file or folder"
        },
    )
    long_corpus: str = field(
        default="modules",
        metadata={
            "help": "the long-document tasks' text: modules (installed packages) or modules:<site-packages folder>"
        },
    )
    text_fields: str = field(default="text", metadata={"help": "local files: text column(s), `a` or `a,b` for pairs"})
    label_field: str = field(default="label", metadata={"help": "local files: the label column"})
    task_type: str = field(default="auto", metadata={"help": f"one of {TASK_TYPES} (auto: inferred from the labels)"})
    max_seq_length: int = field(default=128, metadata={"help": "tokens per example (pairs encoded jointly)"})
    dev_fraction: float = field(
        default=0.1, metadata={"help": "share of the training split held out (fixed seed) to select the step on"}
    )
    validation_fraction: float = field(
        default=0.2, metadata={"help": "tasks without a validation split: share of the examples reported on"}
    )

    def __post_init__(self):
        if self.task_type not in TASK_TYPES:
            raise ValueError(f"task_type={self.task_type!r} is unknown; choose one of {TASK_TYPES}")
        if self.task.startswith("glue:") and self.task[5:] not in GLUE_TASKS:
            raise ValueError(f"task={self.task!r}: GLUE tasks are {['glue:' + t for t in GLUE_TASKS]}")
        for name in ("dev_fraction", "validation_fraction"):
            if not 0 < getattr(self, name) < 0.5:
                raise ValueError(f"{name}={getattr(self, name)} must be in (0, 0.5)")
        if self.max_seq_length < 4:
            raise ValueError(f"max_seq_length={self.max_seq_length} must be at least 4")
        if self.task.startswith(NEEDLE_PREFIX):
            needle_words(self.task)  # raises naming the form
        if is_listops(self.task):
            parse_listops(self.task)  # raises naming the forms
        if is_recall(self.task):
            parse_recall(self.task)  # raises naming the forms or the bad setting
        if self.long_corpus != "modules" and not self.long_corpus.startswith("modules:"):
            raise ValueError(f"long_corpus={self.long_corpus!r}: use modules or modules:<site-packages folder>")
        if len(self.text_field_names) not in (1, 2):
            raise ValueError(f"text_fields={self.text_fields!r}: give one column, or two for sentence pairs (a,b)")

    @property
    def text_field_names(self) -> list[str]:
        return [name.strip() for name in self.text_fields.split(",") if name.strip()]
