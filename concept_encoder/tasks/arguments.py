"""`TaskArguments`: which downstream task, and how its examples and splits are made (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field

TASK_TYPES = ("auto", "single_label_classification", "regression", "multi_label_classification")
EMBEDDED_TASKS = ("embedded", "embedded_pairs")
GLUE_TASKS = ("cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte")


@dataclass
class TaskArguments:
    """The task: `embedded`, `embedded_pairs`, `glue:<name>` or a local .csv/.tsv/.jsonl file or folder."""

    task: str = field(
        default="embedded",
        metadata={
            "help": f"{EMBEDDED_TASKS}, glue:<{'|'.join(GLUE_TASKS)}>, or a local .csv/.tsv/.jsonl file or folder"
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
        if len(self.text_field_names) not in (1, 2):
            raise ValueError(f"text_fields={self.text_fields!r}: give one column, or two for sentence pairs (a,b)")

    @property
    def text_field_names(self) -> list[str]:
        return [name.strip() for name in self.text_fields.split(",") if name.strip()]
