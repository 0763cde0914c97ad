"""The associative-recall symbols (torch-free): keys `k0…`, values `v0…` and `[QUERY]`, what `tasks/recall.py`
writes examples in and `--tokenizer recall[:<keys>:<values>]` (`tokenizer.symbol_tokenizer`) gives ids to."""

from __future__ import annotations

QUERY = "[QUERY]"
KEYS = 64  # the published set-up (Zoology's multi-query recall, issue #54): 64 keys, 16 values
VALUES = 16
PREFIX = "recall"
VOCAB_VERSION = 1  # part of the tokenizer's cache folder name: a changed vocabulary is a new folder
QUERIES = 4  # the masked form's answered queries an example (at most K)


def example_tokens(pairs: int) -> int:
    """The tokens of one classification example at K pairs: `[CLS] k1 v1 … kK vK [QUERY] kq [SEP]`."""
    return 2 * pairs + 4


def masked_example_tokens(task: str) -> int | None:
    """The tokens of one masked-form example of task `recall:<K>…` (`[CLS]`, K pairs, min(QUERIES, K) answered
    queries `[QUERY] k v`, `[SEP]`: one token a symbol), else None (another task, or a malformed name: the task's
    own parser names that)."""
    parts = task.split(":")
    if parts[0] != PREFIX or len(parts) < 2 or not parts[1].isdigit():
        return None
    pairs = int(parts[1])
    return 2 * pairs + 3 * min(QUERIES, pairs) + 2


def key(index: int) -> str:
    return f"k{index}"


def value(index: int) -> str:
    return f"v{index}"


def recall_symbols(keys: int = KEYS, values: int = VALUES) -> tuple[str, ...]:
    return (QUERY, *(key(i) for i in range(keys)), *(value(i) for i in range(values)))


def check_vocabularies(keys: int, values: int, where: str) -> None:
    """ValueError naming `where` unless there are at least 2 keys and 2 values (one would leave nothing to bind)."""
    if keys < 2 or values < 2:
        raise ValueError(f"{where}: give at least 2 keys and 2 values (got {keys} keys, {values} values)")


def parse_recall_tokenizer(spec: str) -> tuple[int, int] | None:
    """`recall` → (64, 16), `recall:<keys>:<values>` → those; None for any other spec; ValueError on a bad form."""
    parts = spec.split(":")
    if parts[0] != PREFIX:
        return None
    if len(parts) not in (1, 3) or not all(p.isdigit() for p in parts[1:]):
        raise ValueError(f"--tokenizer {spec!r}: use recall (64 keys, 16 values) or recall:<keys>:<values>")
    keys, values = (int(parts[1]), int(parts[2])) if len(parts) == 3 else (KEYS, VALUES)
    check_vocabularies(keys, values, f"--tokenizer {spec!r}")
    return keys, values
