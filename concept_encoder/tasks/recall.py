"""Multi-query associative recall (Zoology, Arora et al. 2023): K key-value pairs, then a query key; the label is
the value it was paired with.

    k12 v3 k40 v7 k5 v3 k9 v0 [QUERY] k40   → v7      (framed by the tokenizer: [CLS] … [SEP])

Our own generator: K keys drawn without replacement from `keys` (distinct within an example), each given a value
drawn uniformly (with replacement) from `values`, the query one of the K keys, uniformly; each distinct example
once, the first `train` the training split, the next `dev`, then `test`: no example text stands in two splits.
Binding is the whole task: the query key alone says nothing, and the one rule that needs no binding, predicting the
value most frequent in the example (`no_binding_line`), scores about 32% / 25% / 19% / 15% at K = 4 / 8 / 16 / 32
with 16 values (chance 6.25%): the line a model must cross.

`recall:<K>` (64 keys, 16 values, 20,000 training examples, 2,000 dev and test), `recall:<K>:<keys>:<values>`,
`recall:<K>:<keys>:<values>:<train>` (dev and test each `max(50, train // 10)`). The splits are generated once per
setting into `Cache/tasks/recall/<key>/` (the key a digest of the generator's version, seed and settings;
`generated.py`). The vocabulary is fixed by `keys` and `values` (`data/recall_vocab.py`): `--tokenizer recall`
(64 and 16) or `--tokenizer recall:<keys>:<values>`.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

from ..data.recall_vocab import KEYS, PREFIX, QUERIES, QUERY, VALUES, check_vocabularies, key, value
from .generated import cached_splits, consecutive_splits, generation_problem, rule_accuracies, settings_digest

GENERATOR_VERSION = 1
SEED = 0
TRAIN, HELD = 20_000, 2_000
FORMS = (
    "recall:<K>, recall:<K>:<keys>:<values> or recall:<K>:<keys>:<values>:<train> (e.g. recall:8, recall:8:64:16:2000)"
)


@dataclass(frozen=True)
class RecallSettings:
    """What a generated set depends on (with the generator's version): its key in the cache."""

    pairs: int  # K, the key-value pairs of an example
    keys: int = KEYS
    values: int = VALUES
    train: int = TRAIN
    dev: int = HELD
    test: int = HELD
    seed: int = SEED

    def key(self) -> str:
        digest = settings_digest(self, GENERATOR_VERSION)
        return f"{self.pairs}-{self.keys}-{self.values}-{self.train}-v{GENERATOR_VERSION}-s{self.seed}-{digest}"

    def label_names(self) -> list[str]:
        return [value(v) for v in range(self.values)]

    def check(self, where: str) -> None:
        """ValueError naming `where` and the fix for settings no generator can meet, before any work."""
        check_vocabularies(self.keys, self.values, where)
        if not 1 <= self.pairs <= self.keys:
            raise ValueError(f"{where}: K={self.pairs} pairs need K distinct keys out of {self.keys}; "
                             f"give 1 <= K <= {self.keys} or more keys")  # fmt: skip
        if self.train < 100:
            raise ValueError(f"{where}: give at least 100 training examples")
        wanted, possible = self.train + self.dev + self.test, self.distinct_examples()
        if possible < 2 * wanted:
            raise ValueError(f"{where}: {wanted} distinct examples wanted but only {possible} exist with "
                             f"K={self.pairs}, {self.keys} keys, {self.values} values; use more keys or values")  # fmt: skip
        if problem := generation_problem(where, wanted):  # splits beyond what memory holds: refused before any work
            raise ValueError(problem)

    def distinct_examples(self) -> int:
        return math.perm(self.keys, self.pairs) * self.values**self.pairs * self.pairs


def is_recall(task: str) -> bool:
    return task.split(":")[0] == PREFIX


def parse_recall(task: str) -> RecallSettings:
    """`recall:<K>[:<keys>:<values>[:<train>]]` → its settings; ValueError naming the forms or the bad setting."""
    parts = task.split(":")
    if parts[0] != PREFIX or len(parts) not in (2, 4, 5) or not all(p.isdigit() for p in parts[1:]):
        raise ValueError(f"task={task!r}: use {FORMS}")
    numbers = [int(p) for p in parts[1:]]
    settings = RecallSettings(*numbers[:3])
    if len(numbers) == 4:
        held = max(50, numbers[3] // 10)
        settings = RecallSettings(*numbers, dev=held, test=held)
    settings.check(f"task={task!r}")
    return settings


def generate_example(rng: random.Random, settings: RecallSettings) -> tuple[str, int]:
    """One example as (text, the query key's value index)."""
    keys = rng.sample(range(settings.keys), settings.pairs)
    values = [rng.randrange(settings.values) for _ in keys]
    query = rng.randrange(settings.pairs)
    pairs = " ".join(f"{key(k)} {value(v)}" for k, v in zip(keys, values, strict=True))
    return f"{pairs} {QUERY} {key(keys[query])}", values[query]


def generate_splits(settings: RecallSettings) -> dict[str, list[dict]]:
    """split → rows `{"text": "k3 v1 k7 v0 [QUERY] k7", "label": 0}`: distinct examples drawn from
    `random.Random(settings.seed)`."""
    rng = random.Random(settings.seed)
    wanted = settings.train + settings.dev + settings.test
    seen: set[str] = set()
    rows: list[dict] = []
    while len(rows) < wanted:
        text, label = generate_example(rng, settings)
        if text not in seen:
            seen.add(text)
            rows.append({"text": text, "label": label})
    return consecutive_splits(rows, {"train": settings.train, "dev": settings.dev, "test": settings.test})


def most_frequent_value(text: str) -> int:
    """The value most frequent among the example's pairs (a tie: the one written first): a prediction that reads
    the values but binds none of them to its key."""
    values = [int(symbol[1:]) for symbol in text.split(QUERY)[0].split()[1::2]]
    counts = Counter(values)
    return max(values, key=lambda v: counts[v])  # max keeps the first of equal counts


def no_binding_line(splits: dict[str, list[dict]]) -> dict[str, float]:
    """A sceptic's baseline: the dev and test accuracy of `most_frequent_value`, the line a recall model must cross
    to show it binds a key to its value."""
    return rule_accuracies(lambda r: most_frequent_value(r["text"]), splits)


def recall_splits(task: str, cache_dir: str | Path = "Cache") -> dict[str, list[dict]]:
    """The splits of `task` (see `parse_recall`), generated into `<cache_dir>/tasks/recall/<key>/` the first time
    and read from there afterwards."""
    settings = parse_recall(task)
    meta = {"generator_version": GENERATOR_VERSION, **asdict(settings)}
    return cached_splits(PREFIX, settings.key(), task, meta, lambda: generate_splits(settings), cache_dir)


def recall_pairs(text: str) -> str:
    """An example's pairs, `k3 v1 k7 v0`, whatever queries follow (the classification form's one, or the masked
    form's answered ones): what two forms of one example share, and what leaks its answers."""
    return text.split(f" {QUERY} ")[0]


def answered(text: str, queries: int, rng: random.Random) -> str:
    """The masked form of one example: its pairs, then `queries` distinct keys of them (at most K), each followed
    by its value, `k3 v1 k7 v0 [QUERY] k7 v0 [QUERY] k3 v1`; `--masking query_values` masks those values."""
    head = recall_pairs(text)
    symbols = head.split()
    pairs = list(zip(symbols[0::2], symbols[1::2], strict=True))
    asked = rng.sample(pairs, min(queries, len(pairs)))
    return " ".join([head, *(f"{QUERY} {k} {v}" for k, v in asked)])


def pretraining_texts(task: str, cache_dir: str | Path = "Cache") -> list[str]:
    """`--dataset task:recall:<K>…`: the training split's examples in the masked form, `QUERIES` answered queries
    each (drawn from the settings' seed). Built from the training split alone: no dev or test example's text is
    read (a held-out example sharing all its pairs with a training one is possible in principle, at 64 keys and
    16 values vanishingly rare)."""
    settings = parse_recall(task)
    rng = random.Random(settings.seed)
    return [answered(row["text"], QUERIES, rng) for row in recall_splits(task, cache_dir)["train"]]


__all__ = ["RecallSettings", "generate_splits", "is_recall", "no_binding_line", "parse_recall", "pretraining_texts",
           "recall_pairs", "recall_splits"]  # fmt: skip
