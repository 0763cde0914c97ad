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

import functools
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path

from ..data.listops_vocab import CLOSE, DIGITS, OPERATORS, SYMBOLS
from .generated import (
    MIN_ROW_BYTES,
    cached_splits,
    consecutive_splits,
    generation_problem,
    rule_accuracies,
    settings_digest,
)

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


def longest_tree(depth: int = 1) -> int:
    """The most symbols a tree rooted at `depth` can have: operators of `MAX_ARGUMENTS` arguments down to
    `MAX_DEPTH`, where every node is a digit (1,222,222,222 for the root)."""
    return 1 if depth >= MAX_DEPTH else 2 + MAX_ARGUMENTS * longest_tree(depth + 1)


SHORTEST_OPERATOR_TREE = 4  # `[MAX 2 9 ]`: one operator over two digits; a lone digit is the only shorter tree
LONGEST_TREE = longest_tree()
DISTRIBUTION_LIMIT = 1 << 14  # lengths at and beyond this are lumped: a tree this long is drawn ~1e-15 of the time
COUNT_LIMIT = 64  # beyond this length the distinct trees outnumber any split many times over
COUNT_CAP = 1e30  # counts are capped here: they only need to exceed a split's size


def reachable_lengths(low: int, high: int) -> bool:
    """Whether some tree has a length in `low..high`: 1 (a digit) or `SHORTEST_OPERATOR_TREE..LONGEST_TREE`."""
    return low <= 1 <= high or max(low, SHORTEST_OPERATOR_TREE) <= min(high, LONGEST_TREE)


def truncated_convolution(a, b, size: int, fft: bool):
    """`a * b` (the length distribution of two trees side by side) over lengths 0..`size`, everything longer lumped
    at `size` (still beyond any bound there); `fft` for long float vectors, direct for exact small counts."""
    import numpy as np

    if fft:
        n = 1 << (2 * size + 1).bit_length()
        full = np.fft.irfft(np.fft.rfft(a, n) * np.fft.rfft(b, n), n)[: 2 * size + 1].clip(min=0)
    else:
        full = np.convolve(a, b)
    head = full[: size + 1].copy()
    head[size] += full[size + 1 :].sum()
    return head


def length_weights(size: int, digit: float, leaf_digit: float, operator: float, fft: bool, cap: float = math.inf):
    """Weights of a root tree's lengths 0..`size` (longer lumped at `size`) under the generator's rules, by depth
    from `MAX_DEPTH` up: a node weighs `digit` as a digit (`leaf_digit` at `MAX_DEPTH`) and, above it, `operator`
    times its arguments' weights for each argument count 2..`MAX_ARGUMENTS`. Probabilities: digit 0.75, operator
    0.25 / 9; distinct-tree counts: digit 10, operator 4 (capped at `cap`)."""
    import numpy as np

    weights = np.zeros(size + 1)
    weights[1] = leaf_digit
    for _ in range(MAX_DEPTH - 1):
        arguments, total = weights, np.zeros(size + 1)
        for _count in range(2, MAX_ARGUMENTS + 1):
            arguments = np.minimum(truncated_convolution(arguments, weights, size, fft), cap)
            total += arguments
        node = np.zeros(size + 1)
        node[1] = digit
        node[2:] += operator * total[: size - 1]  # the opening symbol and `]`
        node[size] += operator * total[size - 1 :].sum()
        weights = np.minimum(node, cap)
    return weights


@functools.lru_cache(maxsize=8)
def length_distribution(size: int):
    """P(a drawn tree has length n), n = 0..`size` (longer lumped at `size`)."""
    operator = OPERATOR_PROBABILITY / (MAX_ARGUMENTS - 1)
    return length_weights(size, 1 - OPERATOR_PROBABILITY, 1.0, operator, fft=True)


def window_share(min_length: int, max_length: int) -> tuple[float, float]:
    """(the share of drawn trees kept: `min_length < length < max_length`, their mean length); lengths beyond
    `DISTRIBUTION_LIMIT` are counted at it, so the share is an upper bound there."""
    size = min(max_length, DISTRIBUTION_LIMIT)
    p = length_distribution(size)
    low, high = min(min_length + 1, size), size if max_length > size else max_length  # kept: low..high - 1
    kept = p[low:high].sum() + (p[size] if max_length > size else 0.0)
    lengths = sum(n * p[n] for n in range(low, min(high, size))) + (size * p[size] if max_length > size else 0.0)
    return float(kept), float(lengths / kept) if kept else 0.0


def symbols_per_draw(max_length: int) -> float:
    """The symbols one draw costs: a tree's length, cut where it reaches `max_length` (`TooLong`)."""
    p = length_distribution(min(max_length, DISTRIBUTION_LIMIT))
    return float(sum(min(n, max_length) * share for n, share in enumerate(p)))


def distinct_trees(min_length: int, max_length: int) -> float:
    """How many distinct trees have `min_length < length < max_length` (at least `COUNT_CAP` when the window
    reaches past `COUNT_LIMIT`)."""
    if max_length - 1 > COUNT_LIMIT:
        return COUNT_CAP
    counts = length_weights(max_length, 10, 10, len(OPERATORS), fft=False, cap=COUNT_CAP)
    return float(counts[min_length + 1 : max_length].sum())


CHARACTERS_PER_SYMBOL = 2.5  # a digit and its space, or an operator such as `[MAX` and its space


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

    def check(self, where: str) -> None:
        """ValueError naming `where`, the limit and the fix for settings the generator can never finish, before
        any draw: length bounds no tree of these rules falls between, fewer distinct trees there than the splits
        want, splits beyond memory, or a window so rarely drawn that filling it takes more than `MAX_SYMBOLS`."""
        wanted = self.train + self.dev + self.test
        if not reachable_lengths(self.min_length + 1, self.max_length - 1):
            raise ValueError(
                f"{where}: no tree is longer than {self.min_length} and shorter than {self.max_length} symbols: with "
                f"depth <= {MAX_DEPTH} and 2-{MAX_ARGUMENTS} arguments an operator, a tree is 1 symbol (a digit) or "
                f"{SHORTEST_OPERATOR_TREE} to {LONGEST_TREE:,}; give bounds with such a length between them, e.g. "
                f"listops:{MIN_MAX_LENGTH} (the shortest) to listops:2000 (LRA's)"
            )
        if (possible := distinct_trees(self.min_length, self.max_length)) < 2 * wanted:
            raise ValueError(
                f"{where}: {wanted:,} distinct trees wanted but only {possible:,.0f} are longer than "
                f"{self.min_length} and shorter than {self.max_length} symbols; raise the max length or give fewer "
                "examples"
            )
        share, mean_length = window_share(self.min_length, self.max_length)
        row_bytes = MIN_ROW_BYTES + int(3 * CHARACTERS_PER_SYMBOL * mean_length)  # text, seen-set, file
        kept = f" (trees longer than {self.min_length} and shorter than {self.max_length} symbols)"
        fix = f" or a smaller max length (listops:2000, LRA's bounds, keeps {window_share(500, 2000)[0]:.0%} of the draws)"
        cost = symbols_per_draw(self.max_length)
        if problem := generation_problem(where, wanted, row_bytes, share, cost, kept, fix):
            raise ValueError(problem)


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
    settings = ListOpsSettings(max_length // 4, max_length, train, held, held)
    settings.check(f"task={task!r}")
    return settings


def generate_splits(settings: ListOpsSettings) -> dict[str, list[dict]]:
    """split → rows `{"text": "[MAX 2 9 ]", "label": 9, "length": 4, "depth": 2}`: distinct trees with
    `min_length < length < max_length`, drawn from `random.Random(settings.seed)`; settings it could never finish
    are refused first (`ListOpsSettings.check`)."""
    settings.check(f"ListOps settings {settings}")
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
