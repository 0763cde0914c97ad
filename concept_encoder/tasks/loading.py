"""Downstream tasks as three splits: `train` (fitted), `dev` (carved from train, selects the step) and
`validation` (reported, never selected on), each with `text_a` [, `text_b`] and `label` columns."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import pyarrow.compute as pc
from datasets import Dataset, Sequence, Value, load_dataset

from ..constants import check_table_covers
from ..data.base import DataSourceError, ensure_hub
from ..data.sources import SPLIT_SEED, unreadable_file_message  # SPLIT_SEED: the data layer's fixed hold-out seed
from .arguments import (
    EMBEDDED_TASKS,
    GLUE_TASKS,
    MODULES_PACKAGE,
    MODULES_SPLICED,
    NEEDLE_PREFIX,
    TaskArguments,
    is_listops,
)
from .embedded import PACKAGES, embedded_pairs, embedded_sentences
from .labels import check_present, class_name, class_names, infer_task_type, read_delimited, regression_values
from .listops import length_group, listops_splits, parse_listops
from .long_documents import modules_package_table, modules_spliced_table, needle_splits
from .recall import is_recall, parse_recall, pretraining_texts, recall_splits

logger = logging.getLogger(__name__)

LOCAL_BUILDERS = {
    ".csv": ("csv", {}),
    ".tsv": ("csv", {"delimiter": "\t"}),
    ".jsonl": ("json", {}),
    ".json": ("json", {}),
}

# GLUE: (text columns, validation split, number of labels (1 = regression), metrics with the main one first)
GLUE = {
    "cola": (("sentence",), "validation", 2, ("matthews", "accuracy")),
    "sst2": (("sentence",), "validation", 2, ("accuracy",)),
    "mrpc": (("sentence1", "sentence2"), "validation", 2, ("f1", "accuracy")),
    "qqp": (("question1", "question2"), "validation", 2, ("f1", "accuracy")),
    "stsb": (("sentence1", "sentence2"), "validation", 1, ("pearson", "spearman")),
    "mnli": (("premise", "hypothesis"), "validation_matched", 3, ("accuracy",)),
    "qnli": (("question", "sentence"), "validation", 2, ("accuracy",)),
    "rte": (("sentence1", "sentence2"), "validation", 2, ("accuracy",)),
}
check_table_covers(GLUE, GLUE_TASKS, "GLUE")
DEFAULT_METRICS = {
    "single_label_classification": ("accuracy", "macro_f1"),
    "regression": ("pearson", "spearman", "mse"),
    "multi_label_classification": ("micro_f1", "subset_accuracy"),
}


@dataclass
class TaskData:
    name: str
    task_type: str
    num_labels: int
    label_names: list[str] | None
    metric_names: tuple[str, ...]  # the first one selects the step and leads the report
    train: Dataset
    dev: Dataset
    validation: Dataset
    symbolic: bool = False  # every whitespace-separated token is a word (ListOps): TF-IDF counts single symbols
    whole_input: bool = False  # the label needs every token (generated tasks): never truncated, refused instead

    @property
    def pair(self) -> bool:
        return "text_b" in self.train.column_names

    @property
    def validation_positions(self) -> list[float] | None:
        """Where each validation example's needle starts (fraction of its words; `needle:N` only), else None."""
        return list(self.validation["needle_position"]) if "needle_position" in self.validation.column_names else None

    def validation_groups(self) -> dict[str, list[str]]:
        """Breakdowns of the validation split the report shows accuracy by: name → each example's group
        (ListOps: `depth`, the operators' nesting, and `length`, the symbols in quarters of the length bounds)."""
        columns = self.validation.column_names
        return {name: [str(v) for v in self.validation[name]] for name in ("depth", "length_range") if name in columns}

    def sizes(self) -> dict[str, int]:
        return {"train": len(self.train), "dev": len(self.dev), "validation": len(self.validation)}


def load_task(args: TaskArguments) -> TaskData:
    """Build the task's splits; every problem with the data is a `DataSourceError` naming it."""
    if args.task in EMBEDDED_TASKS:
        if args.task == "embedded":
            texts, labels, names = embedded_sentences()
            table, label_names = (
                Dataset.from_dict({"text_a": texts, "label": labels, "id": list(range(len(texts)))}),
                names,
            )
        else:
            firsts, seconds, same = embedded_pairs()
            table = Dataset.from_dict(
                {"text_a": firsts, "text_b": seconds, "label": same, "id": list(range(len(same)))}
            )
            label_names = ["different package", "same package"]
        train, validation = carve(table, args.validation_fraction)
        return finish(args, args.task, "single_label_classification", label_names, None, train, validation)
    if args.task.startswith(NEEDLE_PREFIX):
        train, validation, names = needle_splits(
            args.task, args.long_corpus, lambda t: carve(t, args.validation_fraction)
        )
        return finish(args, args.task, "single_label_classification", names, None, train, validation)
    if args.task in (MODULES_PACKAGE, MODULES_SPLICED):
        build = modules_package_table if args.task == MODULES_PACKAGE else modules_spliced_table
        table, names = build(args.long_corpus)
        train, validation = carve(table, args.validation_fraction)
        return finish(args, args.task, "single_label_classification", names, None, train, validation)
    if is_listops(args.task):
        return listops_task(args.task)
    if is_recall(args.task):
        return recall_task(args.task)
    if args.task.startswith("glue:"):
        name = args.task[5:]
        columns, validation_split, num_labels, metrics = GLUE[name]
        ensure_hub("dataset", f"nyu-mll/glue:{name}")
        try:
            raw = load_dataset("nyu-mll/glue", name)
        except Exception as error:  # datasets raises many types; the message says what to do
            raise DataSourceError(f"cannot load {args.task}: {type(error).__name__}: {error}") from error
        task_type = "regression" if num_labels == 1 else "single_label_classification"
        train, validation = (standard_columns(raw[s], columns, "label", args.task) for s in ("train", validation_split))
        names = None if num_labels == 1 else raw["train"].features["label"].names
        return finish(args, args.task, task_type, names, metrics, train, validation)
    return load_local(args)


def listops_task(name: str, cache_dir: str = "Cache") -> TaskData:
    """LRA ListOps (`tasks/listops.py`): ten classes, the tree's value; accuracy reported by depth and length."""
    settings = parse_listops(name)
    extra = lambda r: {"depth": r["depth"], "length_range": length_group(r["length"], settings)}  # noqa: E731
    return generated_task(name, listops_splits(name, cache_dir), [str(value) for value in range(10)], extra)


def recall_task(name: str, cache_dir: str = "Cache") -> TaskData:
    """Associative recall (`tasks/recall.py`): one class a value, the query key's."""
    return generated_task(name, recall_splits(name, cache_dir), parse_recall(name).label_names())


def generated_task(name: str, splits: dict[str, list[dict]], labels: list[str], extra=lambda row: {}) -> TaskData:
    """A generated task's own train, dev and test splits (the test split is this project's `validation`, reported
    once at the step chosen on dev) as a symbolic classification task; `extra(row)` adds the columns the report
    breaks accuracy down by."""
    tables, start = {}, 0
    for split, rows in splits.items():  # ids: the row's place in the generated stream
        ids, start = list(range(start, start + len(rows))), start + len(rows)
        columns = {"text_a": [r["text"] for r in rows], "label": [r["label"] for r in rows], "id": ids}
        for row in rows:
            for column, cell in extra(row).items():
                columns.setdefault(column, []).append(cell)
        tables[split] = Dataset.from_dict(columns)
    return TaskData(name, "single_label_classification", len(labels), labels,
                    DEFAULT_METRICS["single_label_classification"], tables["train"], tables["dev"], tables["test"],
                    symbolic=True, whole_input=True)  # fmt: skip


def held_out_texts(task: TaskData) -> set[str]:
    """Every text of the task's dev and validation splits (both texts of a pair)."""
    columns = ("text_a", "text_b") if task.pair else ("text_a",)
    return {text for split in (task.dev, task.validation) for column in columns for text in split[column]}


def training_texts(name: str) -> list[str]:
    """The texts of task `name`'s training split, as unlabelled documents: what `--dataset task:<name>` pretrains on
    (task-adaptive pretraining). The splits are the ones fine-tuning makes with its default fractions (dev and
    validation carved off first); a pair's two texts are two documents; a text that also stands in the dev or
    validation split (a sentence in two pairs) is left out, so no text a model is selected or scored on is read."""
    if is_recall(name):
        return list(dict.fromkeys(pretraining_texts(name)))  # the masked form (`--masking query_values`)
    task = load_task(TaskArguments(task=name))
    columns = ("text_a", "text_b") if task.pair else ("text_a",)
    held = held_out_texts(task)
    texts = [text for column in columns for text in task.train[column] if text not in held]
    return list(dict.fromkeys(texts))  # each text once, in the split's order


def load_local(args: TaskArguments) -> TaskData:
    path = Path(args.task).expanduser()
    if not path.exists():
        raise DataSourceError(
            f"--task {args.task!r}: no such file or folder; use {EMBEDDED_TASKS[0]} (offline), glue:<name> "
            "(needs the Hub) or a local .csv/.tsv/.jsonl file or folder with train and validation files"
        )
    files = {"train": path} if path.is_file() else split_files(path)
    builder, kwargs = LOCAL_BUILDERS.get(files["train"].suffix.lower(), (None, None))
    if builder is None:
        raise DataSourceError(f"{files['train']}: unsupported file type; use one of {sorted(LOCAL_BUILDERS)}")
    if empty := [str(f) for f in files.values() if f.stat().st_size == 0]:
        raise DataSourceError(f"{', '.join(empty)} is empty; a task file needs examples")
    if problem := unreadable_file_message([str(f) for f in files.values()], builder):  # not UTF-8, a bad JSON line
        raise DataSourceError(problem)
    if builder == "csv":  # every cell as written (see labels.py): no type inference on labels
        tables = {k: read_delimited(v, kwargs.get("delimiter", ",")) for k, v in files.items()}
    else:
        try:
            tables = load_dataset(builder, data_files={k: str(v) for k, v in files.items()}, **kwargs)
        except Exception as error:  # datasets wraps what pyarrow refuses (mixed types in a column, ...)
            cause = error.__cause__ or error
            raise DataSourceError(f"{path}: not a table of examples datasets can read ({str(cause)[:200]})") from error
    splits = {k: standard_columns(tables[k], args.text_field_names, args.label_field, str(files[k])) for k in tables}
    for k, split in splits.items():  # row numbers in these messages are the file's rows
        check_present(split["label"], f"{files[k]} column {args.label_field!r}")
    labels = f"{files['train']} column {args.label_field!r}"
    task_type = args.task_type if args.task_type != "auto" else infer_task_type(splits["train"]["label"], labels)
    if task_type == "multi_label_classification":
        check_label_lists(splits, files, args.label_field)
    if task_type == "regression":
        splits = {k: relabel(split, regression_values(split["label"], str(files[k]))) for k, split in splits.items()}
    train, validation = splits["train"], splits.get("validation")
    if validation is None:
        train, validation = carve(train, args.validation_fraction)
    warn_overlap(train, validation, path.name)
    names = None
    if task_type == "single_label_classification":
        names = class_names(train["label"], validation["label"], path.name)
        index = {name: i for i, name in enumerate(names)}
        train, validation = (relabel(s, [index[class_name(x)] for x in s["label"]]) for s in (train, validation))
    return finish(args, path.name, task_type, names, None, train, validation)


def check_label_lists(splits: dict[str, Dataset], files: dict[str, Path], label_field: str) -> None:
    """Multi-label rows must all be lists of one length (a multi-hot vector per row): rows named otherwise."""
    width = None
    for name, split in splits.items():
        for row, value in enumerate(split["label"]):
            if not isinstance(value, list) or not all(v in (0, 1) and not isinstance(v, str) for v in value):
                raise DataSourceError(
                    f"{files[name]} column {label_field!r}: row {row} is {value!r}, not a list of 0/1"
                )
            width = len(value) if width is None else width
            if len(value) != width:
                raise DataSourceError(
                    f"{files[name]} column {label_field!r}: row {row} has {len(value)} labels where the first row has "
                    f"{width}; every row needs one 0/1 per class"
                )


def warn_overlap(train: Dataset, validation: Dataset, where: str) -> None:
    """Warn, with the count, when validation rows repeat training rows (the same texts): their score is memory."""
    columns = [c for c in ("text_a", "text_b") if c in train.column_names]
    seen = set(zip(*(train[c] for c in columns), strict=True))
    repeated = sum(key in seen for key in zip(*(validation[c] for c in columns), strict=True))
    if repeated:
        logger.warning(
            "%s: %d of %d validation row(s) repeat a training row's text: their score measures memory, not "
            "generalisation; drop them from one split", where, repeated, len(validation),
        )  # fmt: skip


def relabel(split: Dataset, labels: list) -> Dataset:
    """`split` with its `label` column replaced (a new column: mapping onto a string column keeps its type)."""
    return split.remove_columns("label").add_column("label", labels)


def split_files(folder: Path) -> dict[str, Path]:
    found = {}
    for split, stems in (("train", ("train",)), ("validation", ("validation", "valid", "dev", "test"))):
        for stem in stems:
            matches = [p for p in sorted(folder.iterdir()) if p.stem == stem and p.suffix.lower() in LOCAL_BUILDERS]
            if matches:
                found[split] = matches[0]
                break
    if "train" not in found:
        raise DataSourceError(f"{folder} holds no train.csv/.tsv/.jsonl; name the training file train.<ext>")
    root = folder.resolve()
    if outside := [str(p) for p in found.values() if not p.resolve().is_relative_to(root)]:
        raise DataSourceError(
            f"{', '.join(outside)} lead(s) outside {folder} through a link: a task folder is read only inside "
            "itself; copy the file into the folder"
        )
    return found


def standard_columns(table: Dataset, text_fields, label_field: str, where: str) -> Dataset:
    """`text_a` [, `text_b`], `label` and `id` (the row's index in `table`, which follows it through every
    split: the baselines and the models are shown to see the same rows); a missing column or an empty
    text is an error naming it."""
    missing = [c for c in [*text_fields, label_field] if c not in table.column_names]
    if missing:
        raise DataSourceError(
            f"{where} has no column(s) {missing} (columns: {table.column_names}); "
            "pass --text_fields a[,b] and --label_field with existing columns"
        )
    for column in text_fields:
        for row, text in enumerate(table[column]):
            if not isinstance(text, str) or not text.strip():
                raise DataSourceError(f"{where}: row {row} has no text in column {column!r}; fill or drop that row")
    renamed = {old: new for old, new in zip(text_fields, ("text_a", "text_b"), strict=False)}
    table = table.select_columns([*text_fields, label_field]).rename_columns({**renamed, label_field: "label"})
    return table.add_column("id", list(range(len(table))))


def carve(table: Dataset, fraction: float) -> tuple[Dataset, Dataset]:
    """`table` split at random (fixed seed) into the rest and `fraction` of it; DataSourceError when a side would
    be empty."""
    held = len(table) * fraction
    if held < 1 or len(table) - held < 1:
        raise DataSourceError(
            f"{len(table)} example(s) are too few to hold out {fraction:g} of them (each side needs one); add "
            "examples, or give a validation file beside train (a folder with train.* and validation.*)"
        )
    parts = table.train_test_split(test_size=fraction, seed=SPLIT_SEED, shuffle=True)
    return parts["train"], parts["test"]


def finish(args, name, task_type, label_names, metrics, train: Dataset, validation: Dataset) -> TaskData:
    """Carve the dev split, count the labels, check the training set can teach anything."""
    train, dev = carve(train, args.dev_fraction)
    if task_type == "regression":
        num_labels = 1
        train, dev, validation = (s.cast_column("label", Value("float32")) for s in (train, dev, validation))
        for split_name, split in (("training", train), ("dev", dev), ("validation", validation)):
            if len(set(split["label"])) < 2:  # correlations of a constant are undefined, not 0
                raise DataSourceError(
                    f"task {name!r}: every score of the {split_name} split is {split['label'][0]:g}; a regression "
                    "is measured by correlations, which a constant target leaves undefined; check --label_field, "
                    "or give scores that vary"
                )
    elif task_type == "multi_label_classification":
        num_labels = len(train[0]["label"])
        multi_hot = Sequence(Value("float32"), length=num_labels)  # BCE-with-logits heads want float targets
        train, dev, validation = (s.cast_column("label", multi_hot) for s in (train, dev, validation))
    else:
        classes = set(train["label"])
        if len(classes) < 2:
            raise DataSourceError(
                f"task {name!r}: the training split has a single class ({classes.pop()!r}); a classifier cannot "
                "learn from it; check --label_field, or give examples of at least two classes"
            )
        num_labels = max(len(label_names or []), max(classes) + 1, max(validation["label"]) + 1)
    return TaskData(
        name, task_type, num_labels, label_names, metrics or DEFAULT_METRICS[task_type], train, dev, validation
    )


def encode_splits(task: TaskData, tokenizer, max_seq_length: int) -> dict[str, Dataset]:
    """Tokenised splits with `input_ids`, `attention_mask` (and `token_type_ids` where the tokenizer makes
    them), `labels` and the row `id`; a pair is encoded jointly, `[CLS] a [SEP] b [SEP]`, truncated to
    `max_seq_length`. A task whose label needs every token (`whole_input`: ListOps, recall) is never truncated: an
    example longer than `max_seq_length` is a ValueError naming the length that fits (truncation would cut a
    recall query or a ListOps tree's closing brackets, and the model would be scored on examples it cannot answer)."""

    def encode(batch):
        pair = (batch["text_a"], batch["text_b"]) if task.pair else (batch["text_a"],)
        if task.whole_input:
            return tokenizer(*pair, truncation=False)
        return tokenizer(*pair, truncation=True, max_length=max_seq_length)

    splits = {"train": task.train, "dev": task.dev, "validation": task.validation}
    encoded = {
        name: split.map(
            encode, batched=True, remove_columns=[c for c in split.column_names if c not in ("label", "id")]
        ).rename_column("label", "labels")
        for name, split in splits.items()
    }
    if task.whole_input and (longest := longest_example(encoded)) > max_seq_length:
        raise ValueError(
            f"task {task.name!r} has examples of up to {longest} tokens, longer than --max_seq_length "
            f"{max_seq_length}: its label needs the whole example, so it is not truncated; pass --max_seq_length "
            f"{longest} or more"
        )
    return encoded


def longest_example(splits: dict[str, Dataset]) -> int:
    """The most tokens any example of `splits` holds (read from the Arrow column: no row is decoded)."""
    return max(pc.max(pc.list_value_length(split.data.column("input_ids"))).as_py() or 0 for split in splits.values())


__all__ = ["GLUE", "PACKAGES", "TaskData", "encode_splits", "held_out_texts", "load_task", "training_texts"]
