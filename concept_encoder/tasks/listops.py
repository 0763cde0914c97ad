"""ListOps (Long Range Arena, Tay et al. 2020): nested list operations over digits, the label the tree's value.

    [MAX 2 9 [MIN 4 7 ] 0 ]   → 9

Our own generator, written from the published rules (nothing copied from LRA's code):

- a node above depth `MAX_DEPTH` is an operator with probability `OPERATOR_PROBABILITY`, else a digit 0-9
  (the root is depth 1; a node at depth `MAX_DEPTH` is always a digit);
- an operator takes 2..`MAX_ARGUMENTS` arguments, uniformly; MIN, MAX, MED (the median; an even count takes the
  mean of the two middle values, truncated) or SM (the sum mod 10), uniformly;
- a tree's length counts each digit as 1 and each operator as 2 (its opening symbol and `]`): exactly its number
  of symbols, so it is the token count before `[CLS]`/`[SEP]`;
- trees are kept while `min_length < length < max_length` (500 and 2000 for `listops`), each distinct tree
  once; the first `train` of them form the training split, the next `dev` the dev split, then `test`, so no
  tree stands in two splits.

`listops:<max_length>` is a shorter variant (bounds `max_length // 4` and `max_length`, same split sizes):
smoke tests and curricula. `listops:<max_length>:<train>` also shrinks the splits (dev and test each
`max(50, train // 48)`, LRA's ratio). The splits are generated once per setting into
`Cache/tasks/listops/<key>/` (the key is a digest of the generator's version, seed and settings, which
`meta.json` records with each split's digest) and read from there afterwards.

The vocabulary is fixed (`data/listops_vocab.py`): a `tokenizers` WordLevel over the 15 symbols plus the
specials, saved like any tokenizer; `--tokenizer listops` names it.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from pathlib import Path

from ..data.listops_vocab import CLOSE, DIGITS, OPERATORS, SYMBOLS
from .generated import cached_splits, consecutive_splits, rule_accuracies, settings_digest

GENERATOR_VERSION = 1
SEED = 0
MAX_DEPTH = 10
MAX_ARGUMENTS = 10
OPERATOR_PROBABILITY = 0.25
PREFIX = "listops"
FULL = {"min_length": 500, "max_length": 2000, "train": 96_000, "dev": 2_000, "test": 2_000}
MIN_MAX_LENGTH = 16  # below this, a tree of two digits and one operator (length 4) is almost all there is


def apply(operator: str, values: list[int]) -> int:
    """The value of `operator` (one of `OPERATORS`) over its argument values."""
    if operator == "[MIN":
        return min(values)
    if operator == "[MAX":
        return max(values)
    if operator == "[SM":
        return sum(values) % 10
    ordered = sorted(values)
    middle = len(ordered) // 2
    if len(ordered) % 2:
        return ordered[middle]
    return (ordered[middle - 1] + ordered[middle]) // 2  # the mean of the two middle values, truncated


class TooLong(Exception):
    """A tree under construction reached the length bound: it is dropped (its distribution is unchanged, since
    a finished tree of that length would be dropped too)."""


def generate_tree(rng: random.Random, max_length: int) -> tuple[list[str], int]:
    """One tree drawn by the rules above as (symbols, value); `TooLong` once its length reaches `max_length`."""
    symbols: list[str] = []

    def node(depth: int) -> int:
        if depth < MAX_DEPTH and rng.random() < OPERATOR_PROBABILITY:
            count = rng.randint(2, MAX_ARGUMENTS)
            operator = rng.choice(OPERATORS)
            symbols.append(operator)
            values = [node(depth + 1) for _ in range(count)]
            symbols.append(CLOSE)
            if len(symbols) >= max_length:
                raise TooLong
            return apply(operator, values)
        digit = rng.randrange(10)
        symbols.append(DIGITS[digit])
        if len(symbols) >= max_length:
            raise TooLong
        return digit

    value = node(1)
    return symbols, value


@dataclass(frozen=True)
class ListOpsSettings:
    """What a generated set depends on (with the generator's version): its key in the cache."""

    min_length: int
    max_length: int
    train: int
    dev: int
    test: int
    seed: int = SEED

    def key(self) -> str:
        digest = settings_digest(self, GENERATOR_VERSION)
        return f"{self.min_length}-{self.max_length}-{self.train}-v{GENERATOR_VERSION}-s{self.seed}-{digest}"


def parse_listops(task: str) -> ListOpsSettings:
    """`listops`, `listops:<max_length>` or `listops:<max_length>:<train>` → its settings; ValueError naming the
    forms otherwise."""
    parts = task.split(":")
    if parts[0] != PREFIX or len(parts) > 3 or not all(p.isdigit() for p in parts[1:]):
        raise ValueError(
            f"task={task!r}: use listops (LRA's 500-2000 symbols), listops:<max_length> (e.g. listops:500) or "
            "listops:<max_length>:<train examples> (e.g. listops:100:2000)"
        )
    if len(parts) == 1:
        return ListOpsSettings(**FULL)
    max_length = int(parts[1])
    if max_length < MIN_MAX_LENGTH:
        raise ValueError(f"task={task!r}: the maximum length must be at least {MIN_MAX_LENGTH} symbols")
    train = int(parts[2]) if len(parts) == 3 else FULL["train"]
    held = FULL["dev"] if len(parts) == 2 else max(50, train // 48)
    if train < 100:
        raise ValueError(f"task={task!r}: give at least 100 training examples")
    return ListOpsSettings(max_length // 4, max_length, train, held, held)


def generate_splits(settings: ListOpsSettings) -> dict[str, list[dict]]:
    """split → rows `{"text": "[MAX 2 9 ]", "label": 9, "length": 4, "depth": 2}`: distinct trees with
    `min_length < length < max_length`, drawn from `random.Random(settings.seed)`."""
    rng = random.Random(settings.seed)
    wanted = settings.train + settings.dev + settings.test
    seen: set[str] = set()
    rows: list[dict] = []
    while len(rows) < wanted:
        try:
            symbols, value = generate_tree(rng, settings.max_length)
        except TooLong:
            continue
        if len(symbols) <= settings.min_length:
            continue
        text = " ".join(symbols)
        if text in seen:
            continue
        seen.add(text)
        rows.append({"text": text, "label": value, "length": len(symbols), "depth": tree_depth(symbols)})
    return consecutive_splits(rows, {"train": settings.train, "dev": settings.dev, "test": settings.test})


def tree_depth(symbols: list[str]) -> int:
    """Nesting depth of operators (a lone digit: 0)."""
    depth = deepest = 0
    for symbol in symbols:
        if symbol in OPERATORS:
            depth += 1
            deepest = max(deepest, depth)
        elif symbol == CLOSE:
            depth -= 1
    return deepest


def root_operator_rule(splits: dict[str, list[dict]]) -> dict:
    """A sceptic's baseline: predict, from the root operator alone, the value most frequent under it in the training
    split (MIN → 0, MAX → 9, ...). A model that learned only this reads nothing below the root; its dev and test
    accuracy is the line a ListOps model must cross to show it evaluates trees."""
    counts: dict[str, dict[int, int]] = {}
    for row in splits["train"]:
        root = counts.setdefault(row["text"].split()[0], {})
        root[row["label"]] = root.get(row["label"], 0) + 1
    rule = {root: max(values, key=lambda v: (values[v], -v)) for root, values in counts.items()}
    return {"rule": rule, **rule_accuracies(lambda r: rule.get(r["text"].split()[0]), splits)}


def length_group(length: int, settings: ListOpsSettings, parts: int = 4) -> str:
    """The quarter of the length bounds `length` falls in, as `"500-875"` (the report's accuracy by length)."""
    span = settings.max_length - settings.min_length
    index = min(parts - 1, (length - settings.min_length) * parts // span)
    low = settings.min_length + index * span // parts
    return f"{low}-{settings.min_length + (index + 1) * span // parts}"


def listops_splits(task: str, cache_dir: str | Path = "Cache") -> dict[str, list[dict]]:
    """The splits of `task` (see `parse_listops`), generated into `<cache_dir>/tasks/listops/<key>/` the first time
    and read from there afterwards (`generated.cached_splits`)."""
    settings = parse_listops(task)
    meta = {"generator_version": GENERATOR_VERSION, **asdict(settings)}
    return cached_splits(PREFIX, settings.key(), task, meta, lambda: generate_splits(settings), cache_dir)


__all__ = ["FULL", "SYMBOLS", "ListOpsSettings", "apply", "generate_splits", "listops_splits", "parse_listops",
           "root_operator_rule"]  # fmt: skip
