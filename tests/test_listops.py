"""LRA ListOps: the generator follows the published rules, the splits are disjoint and cached, the tokenizer is
fixed. Labels are recomputed here by an evaluator of our own, independent of the generator's."""

import collections
import json
import random
import statistics

import pytest

from concept_encoder.tasks.arguments import TaskArguments
from concept_encoder.tasks.listops import (
    FULL,
    ListOpsSettings,
    apply,
    generate_splits,
    generate_tree,
    listops_splits,
    parse_listops,
)


def evaluate(text: str) -> int:
    """The value of a ListOps expression, read with a stack (not the generator's recursion)."""
    stack: list = []
    for symbol in text.split():
        if symbol.startswith("["):
            stack.append(symbol)
            stack.append([])
        elif symbol == "]":
            values = stack.pop()
            operator = stack.pop()
            if operator == "[MIN":
                value = min(values)
            elif operator == "[MAX":
                value = max(values)
            elif operator == "[SM":
                value = sum(values) % 10
            else:
                value = int(statistics.median(values))  # even count: mean of the middle two, truncated
            if not stack:
                return value
            stack[-1].append(value)
        else:
            if not stack:
                return int(symbol)
            stack[-1].append(int(symbol))
    raise AssertionError(f"unbalanced expression {text!r}")


@pytest.fixture(scope="module")
def small_splits():
    return generate_splits(ListOpsSettings(min_length=25, max_length=100, train=600, dev=100, test=100, seed=3))


def test_lengths_are_within_the_bounds_and_count_each_symbol(small_splits):
    for rows in small_splits.values():
        for row in rows:
            symbols = row["text"].split()
            assert 25 < row["length"] < 100 and row["length"] == len(symbols)
            operators = sum(s.startswith("[") for s in symbols)
            assert symbols.count("]") == operators  # each operator counts 2: open and close
            assert len(symbols) == 2 * operators + sum(s.isdigit() for s in symbols)


def test_labels_equal_an_independent_evaluation(small_splits):
    rows = [row for split in small_splits.values() for row in split]
    assert all(row["label"] == evaluate(row["text"]) for row in rows)
    assert all(0 <= row["label"] <= 9 for row in rows)


def test_median_of_an_even_count_truncates_the_mean_of_the_middle_two_and_sum_is_mod_10():
    assert apply("[MED", [1, 4, 9, 2]) == 3  # (2 + 4) / 2
    assert apply("[MED", [3, 8]) == 5  # 5.5 truncated
    assert apply("[MED", [7, 1, 4]) == 4
    assert apply("[SM", [9, 8, 7]) == 4  # 24 mod 10
    assert apply("[MIN", [5, 2, 8]) == 2 and apply("[MAX", [5, 2, 8]) == 8
    assert evaluate("[MED 3 8 ]") == 5 and evaluate("[SM 9 8 7 ]") == 4


def test_no_tree_is_in_two_splits_and_each_is_distinct(small_splits):
    texts = [row["text"] for split in small_splits.values() for row in split]
    assert len(texts) == len(set(texts)) == 800
    assert [len(small_splits[s]) for s in ("train", "dev", "test")] == [600, 100, 100]


def test_operators_take_two_to_ten_arguments_and_nest_at_most_ten_deep():
    rng = random.Random(1)
    counts, depths = collections.Counter(), []
    for _ in range(300):
        try:
            symbols, _ = generate_tree(rng, 10_000)
        except Exception:  # noqa: BLE001 (TooLong at 10k symbols: not expected, but not this test's point)
            continue
        stack = []
        for symbol in symbols:
            if symbol.startswith("["):
                stack.append(0)
            elif symbol == "]":
                counts[stack.pop()] += 1
                if stack:
                    stack[-1] += 1
            elif stack:
                stack[-1] += 1
            depths.append(len(stack))
    assert set(counts) == set(range(2, 11))  # every count drawn, none outside
    assert max(depths) <= 9  # depth 10 is always a digit: at most 9 operators open


def test_class_histogram_of_full_length_trees_is_near_the_published_one():
    rows = generate_splits(ListOpsSettings(min_length=500, max_length=2000, train=1500, dev=0, test=0))["train"]
    shares = collections.Counter(row["label"] for row in rows)
    majority = max(shares.values()) / len(rows)
    assert 0.13 < majority < 0.21  # LRA: about 16.6%
    assert {label for label, _ in shares.most_common(2)} == {0, 9}  # MIN pulls to 0, MAX to 9
    assert min(shares[label] for label in range(10)) / len(rows) > 0.05
    assert 900 < statistics.mean(row["length"] for row in rows) < 1200  # LRA: about 1,070


def test_task_names_parse_and_bad_forms_are_refused_naming_the_forms():
    assert parse_listops("listops") == ListOpsSettings(**FULL)
    assert parse_listops("listops:400") == ListOpsSettings(100, 400, 96_000, 2_000, 2_000)
    assert parse_listops("listops:100:960") == ListOpsSettings(25, 100, 960, 50, 50)
    for bad in ("listops:", "listops:abc", "listops:8", "listops:100:10", "listops:1:2:3"):
        with pytest.raises(ValueError, match="listops"):
            TaskArguments(task=bad)


def test_splits_are_generated_once_into_the_cache_and_a_damaged_entry_is_rebuilt(tmp_path):
    first = listops_splits("listops:64:200", tmp_path)
    (folder,) = [p for p in (tmp_path / "tasks" / "listops").iterdir() if p.is_dir()]
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["generator_version"] == 1 and meta["seed"] == 0 and set(meta["digests"]) == {"train", "dev", "test"}
    assert listops_splits("listops:64:200", tmp_path) == first  # read back
    (folder / "dev.jsonl").write_text('{"text": "5", "label": 5, "length": 1, "depth": 0}\n')
    assert listops_splits("listops:64:200", tmp_path) == first  # named, generated again, the same


def test_task_splits_tokenize_to_the_fixed_vocabulary(tmp_path, monkeypatch):
    from concept_encoder.data.tokenizer import load_tokenizer
    from concept_encoder.tasks.loading import encode_splits, load_task

    monkeypatch.chdir(tmp_path)
    task = load_task(TaskArguments(task="listops:64:200"))
    tokenizer = load_tokenizer("listops")
    assert len(tokenizer) == 20 and task.num_labels == 10 and task.symbolic
    assert task.sizes() == {"train": 200, "dev": 50, "validation": 50}
    encoded = encode_splits(task, tokenizer, 128)
    row, text = encoded["train"][0], task.train[0]["text_a"]
    assert len(row["input_ids"]) == len(text.split()) + 2  # one id a symbol, with [CLS] and [SEP]
    assert tokenizer.unk_token_id not in row["input_ids"]
    assert set(task.validation_groups()) == {"depth", "length_range"}
    ids = [task.train["id"], task.dev["id"], task.validation["id"]]
    assert ids == [list(range(200)), list(range(200, 250)), list(range(250, 300))]  # distinct rows, distinct ids


def test_the_root_operator_rule_predicts_each_roots_most_frequent_training_value():
    from concept_encoder.tasks.listops import root_operator_rule

    rows = lambda *pairs: [{"text": t, "label": evaluate(t)} for t in pairs]  # noqa: E731
    splits = {
        "train": rows("[MAX 1 9 ]", "[MAX 9 2 ]", "[MAX 3 4 ]", "[MIN 0 5 ]", "[SM 2 3 ]", "[SM 2 3 1 ]"),
        "dev": rows("[MAX 9 9 ]", "[MIN 3 4 ]"),
        "test": rows("[MAX 0 9 ]", "[SM 1 2 3 ]", "[MED 4 6 ]"),
    }
    result = root_operator_rule(splits)
    assert result["rule"] == {"[MAX": 9, "[MIN": 0, "[SM": 5}  # SM: 5 and 6 tie once each: the lower value
    assert result["dev"] == 0.5 and result["test"] == pytest.approx(1 / 3)  # an unseen root predicts nothing
