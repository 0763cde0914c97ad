"""Labels of a local task file as written: missing ones named, classes kept distinct, ids contiguous.

CSV/TSV files are read with the standard library's `csv` module, every cell as the string written
(pandas, under `datasets`' csv builder, would infer types: `01` and `1` would become one class, `NA`
a null). Then:
- a missing label (empty cell, JSON null, NaN) is an error naming the rows;
- the task type, when `auto`: lists → multi-label; numbers of which one is not integral → regression;
  anything else → single-label classes;
- regression labels must be finite numbers (NaN/inf refused, rows named);
- classes are the values as written (`"01"` and `"1"` stay two classes), sorted numerically when they
  are all integers (so `-1, 1` or `10, 20` work: ids are contiguous), else as text; the names go to
  the model's `id2label`; classes that appear only in validation are warned about with their counts.
"""

from __future__ import annotations

import csv
import logging
import math
from collections import Counter
from pathlib import Path

from datasets import Dataset

from ..data.base import DataSourceError

logger = logging.getLogger(__name__)


FORMAT_NAMES = {",": "CSV", "\t": "TSV"}
# csv's default field bound is 131,072 characters; a long-document task holds whole documents in one cell
csv.field_size_limit(2**31 - 1)


def read_delimited(path: Path, delimiter: str) -> Dataset:
    """A CSV/TSV file as a Dataset of strings exactly as written (header row = column names); a byte-order mark
    (what spreadsheet programs write as "CSV UTF-8") is dropped."""
    with open(path, newline="", encoding="utf-8-sig") as handle:
        reader = csv.reader(handle, delimiter=delimiter)
        try:
            rows = list(reader)
        except csv.Error as error:  # a broken quote, a NUL byte
            raise DataSourceError(f"{path} line {reader.line_num} is not {FORMAT_NAMES[delimiter]} ({error}); fix "
                                  "that line, or quote its fields") from error  # fmt: skip
    if not rows:
        raise DataSourceError(f"{path} is empty; a task file needs a header row and examples")
    header, body = rows[0], rows[1:]
    if not body:
        raise DataSourceError(f"{path} has a header row and no examples; add one row per example")
    twice = sorted(name for name, count in Counter(header).items() if count > 1)
    if twice:
        raise DataSourceError(
            f"{path}: column(s) {twice} are named twice in the header; give every column its own name"
        )
    short = [i + 2 for i, row in enumerate(body) if len(row) != len(header)]
    if short:
        raise DataSourceError(
            f"{path}: line(s) {short[:5]} have a different number of fields than the header ({len(header)}); "
            "quote fields that contain the delimiter"
        )
    return Dataset.from_dict({name: [row[i] for row in body] for i, name in enumerate(header)})


def is_missing(value) -> bool:
    return value is None or (isinstance(value, str) and not value.strip()) or (
        isinstance(value, float) and math.isnan(value))  # fmt: skip


def as_number(value) -> float | None:
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int | float):
        return float(value)
    try:
        return float(str(value).strip())
    except ValueError:
        return None


def check_present(labels: list, where: str) -> None:
    missing = [row for row, value in enumerate(labels) if is_missing(value)]
    if missing:
        raise DataSourceError(
            f"{where}: {len(missing)} row(s) have no label (rows {missing[:10]}{', ...' if len(missing) > 10 else ''}, "
            "counting from 0 after the header); fill or drop them"
        )


def infer_task_type(labels: list, where: str = "the task's labels") -> str:
    """Lists: multi-label; numbers of which one is not integral: regression; else single-label classes. Numbers
    with a fraction beside cells that are not numbers are a regression column with bad cells: an error naming them
    (read as classes they would make one class per score)."""
    if any(isinstance(x, list) for x in labels):
        return "multi_label_classification"
    numbers = [as_number(x) for x in labels]
    fractional = [n for n in numbers if n is not None and (not math.isfinite(n) or not n.is_integer())]
    if fractional and all(n is not None for n in numbers):
        return "regression"
    if fractional:
        rows = [row for row, n in enumerate(numbers) if n is None]
        raise DataSourceError(
            f"{where}: scores such as {fractional[0]:g} beside cells that are not numbers (rows {rows[:10]}, e.g. "
            f"{labels[rows[0]]!r}); fix those cells, or pass --task_type single_label_classification"
        )
    return "single_label_classification"


def class_name(value) -> str:
    """A class as written: a string unchanged, a JSON number as its text."""
    return value if isinstance(value, str) else str(value)


def class_names(train_labels: list, validation_labels: list, where: str) -> list[str]:
    """Every class of both splits, as written, in id order (numeric when all are integers); warns about
    classes that only validation holds (the classifier never sees an example of them)."""
    seen = Counter(map(class_name, train_labels))
    only_validation = Counter(c for c in map(class_name, validation_labels) if c not in seen)
    if only_validation:
        logger.warning(
            "%s: classes only in the validation split (never trained on; their examples count as errors): %s",
            where, dict(sorted(only_validation.items())),
        )  # fmt: skip
    names = set(seen) | set(only_validation)
    integers = all(n.strip().lstrip("+-").isdigit() for n in names)
    return sorted(names, key=lambda n: (int(n), n) if integers else (0, n))


def regression_values(labels: list, where: str) -> list[float]:
    values = [as_number(x) for x in labels]
    bad = [row for row, v in enumerate(values) if v is None or not math.isfinite(v)]
    if bad:
        raise DataSourceError(
            f"{where}: regression labels must be finite numbers; rows {bad[:10]} are not (e.g. "
            f"{labels[bad[0]]!r}); fix them, or pass --task_type single_label_classification"
        )
    return values
