"""Pretraining on several sources at once: `--dataset docstrings,task:embedded*8` (torch- and datasets-free).

A mixture is a comma-separated list of sources, each optionally followed by `*<weight>`: how many times its
training documents enter one epoch (8: every document eight times; 0.5: a seeded half of them). `task:<name>` is
the training split of a fine-tuning task (`embedded`, `embedded_pairs`, a local task file, ...) as unlabelled
text: task-adaptive pretraining (Gururangan et al. 2020), which pays where generic text at a small budget does
not. Dev and validation texts of the task are never read (`tasks.loading.training_texts`).

The loading lives in `sources.load_raw_dataset`; this module only reads the spec, so the plan check and the
argument checks can refuse a malformed one before anything loads.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

TASK_SOURCE = "task:"
WEIGHT_MARK = "*"


@dataclass(frozen=True)
class Part:
    """One source of a mixture: its spec (as `--dataset` would take it alone), its weight, and whether it is a
    task's training text (`task` holds the task's name then)."""

    spec: str
    weight: float = 1.0

    @property
    def task(self) -> str | None:
        return self.spec[len(TASK_SOURCE) :] if self.spec.startswith(TASK_SOURCE) else None


def is_mixture(spec: str) -> bool:
    """Whether `spec` needs the mixture reader: several sources, a weight, or a task's text. A local path that
    exists is read as itself, whatever characters its name holds."""
    if Path(spec).expanduser().exists():
        return False
    return "," in spec or WEIGHT_MARK in spec or spec.startswith(TASK_SOURCE)


def parse_mixture(spec: str) -> list[Part]:
    """`"docstrings,task:embedded*8"` → [Part("docstrings", 1.0), Part("task:embedded", 8.0)]; ValueError naming
    what is wrong (an empty part, a weight that is no positive number, a source given twice, a task with no name)."""
    parts = []
    for raw in spec.split(","):
        text = raw.strip()
        source, mark, weight_text = text.rpartition(WEIGHT_MARK) if WEIGHT_MARK in text else (text, "", "")
        if not source.strip():
            raise ValueError(
                f"dataset={spec!r}: an empty source in the mixture; write sources separated by commas, each "
                f"optionally weighted, e.g. docstrings,{TASK_SOURCE}embedded*8"
            )
        weight = 1.0
        if mark:
            try:
                weight = float(weight_text)
            except ValueError:
                weight = float("nan")
            if not weight > 0 or weight == float("inf"):
                raise ValueError(
                    f"dataset={spec!r}: {text!r} has weight {weight_text!r}; a weight is a positive number, how "
                    f"many times the source's training documents enter an epoch (e.g. {source.strip()}*4, or *0.5)"
                )
        part = Part(source.strip(), weight)
        if part.task is not None and not part.task.strip():
            raise ValueError(f"dataset={spec!r}: {TASK_SOURCE} needs a task's name, e.g. {TASK_SOURCE}embedded")
        parts.append(part)
    specs = [p.spec for p in parts]
    if repeated := sorted({s for s in specs if specs.count(s) > 1}):
        raise ValueError(f"dataset={spec!r}: {repeated} given twice; give each source once, with a weight")
    return parts


def repetition(count: int, weight: float, seed: int) -> list[int]:
    """Indices into `count` documents for `weight`: every index int(weight) times, then a seeded sample (without
    repetition) of the fractional part; in the order they are listed (the pipeline shuffles the mixture)."""
    whole, fraction = int(weight), weight - int(weight)
    extra = random.Random(seed).sample(range(count), round(fraction * count)) if fraction else []
    return [i for _ in range(whole) for i in range(count)] + sorted(extra)
