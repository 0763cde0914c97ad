"""Associative recall (tasks/recall.py): labels recomputed by a reader of our own (not the generator's), splits
disjoint, seeds reproducible, the cache keyed by content, the no-binding line, refusals, and `--task recall:4`
through loops/finetune.py."""

import json
from collections import Counter
from pathlib import Path

import pytest
from loop_runs import fresh_accelerate, workdir  # noqa: F401 (fixtures)

from concept_encoder.data.recall_vocab import example_tokens
from concept_encoder.tasks.arguments import TaskArguments
from concept_encoder.tasks.recall import (
    RecallSettings,
    generate_splits,
    no_binding_line,
    parse_recall,
    recall_splits,
)

SMALL = RecallSettings(pairs=8, keys=20, values=6, train=400, dev=100, test=100, seed=5)


def read_example(text: str) -> tuple[dict[str, str], str]:
    """(key → value, query key) read from the text, left to right."""
    head, query = text.split(" [QUERY] ")
    symbols = head.split()
    return dict(zip(symbols[0::2], symbols[1::2], strict=True)), query


@pytest.fixture(scope="module")
def small_splits():
    return generate_splits(SMALL)


def test_labels_equal_the_query_keys_value_read_from_the_text(small_splits):
    for rows in small_splits.values():
        for row in rows:
            pairs, query = read_example(row["text"])
            assert len(pairs) == 8 and len(row["text"].split()) == 2 * 8 + 2  # keys distinct within an example
            assert len(row["text"].split()) + 2 == example_tokens(8)  # what the map sizes its runs by, with [CLS] [SEP]
            assert all(k[0] == "k" and int(k[1:]) < 20 and v[0] == "v" and int(v[1:]) < 6 for k, v in pairs.items())
            assert pairs[query] == f"v{row['label']}"


def test_splits_are_disjoint_and_seeds_reproduce(small_splits):
    texts = [row["text"] for split in small_splits.values() for row in split]
    assert len(texts) == len(set(texts)) == 600
    assert [len(small_splits[s]) for s in ("train", "dev", "test")] == [400, 100, 100]
    assert generate_splits(SMALL) == small_splits
    other = generate_splits(RecallSettings(**{**SMALL.__dict__, "seed": 6}))
    assert other["train"] != small_splits["train"]


def test_the_no_binding_line_is_the_most_frequent_values_accuracy(small_splits):
    def first_most_frequent(text):
        values = list(read_example(text)[0].values())
        counts = Counter(values)
        return int(next(v for v in values if counts[v] == max(counts.values()))[1:])

    for name in ("dev", "test"):
        rows = small_splits[name]
        expected = sum(first_most_frequent(r["text"]) == r["label"] for r in rows) / len(rows)
        assert no_binding_line(small_splits)[name] == pytest.approx(expected)
    hand = {"dev": [{"text": "k1 v2 k3 v2 k4 v0 [QUERY] k4", "label": 0}],
            "test": [{"text": "k1 v5 k2 v1 k3 v1 [QUERY] k2", "label": 1}]}  # fmt: skip
    assert no_binding_line(hand) == {"dev": 0.0, "test": 1.0}


def test_task_names_parse_and_bad_settings_are_refused_in_one_line():
    assert parse_recall("recall:4") == RecallSettings(4, 64, 16, 20_000, 2_000, 2_000)
    assert parse_recall("recall:8:32:4:500") == RecallSettings(8, 32, 4, 500, 50, 50)
    for bad, message in (("recall", "recall:<K>"), ("recall:4:64", "recall:<K>"), ("recall:x", "recall:<K>"),
                         ("recall:80", "K=80 pairs need K distinct keys out of 64"), ("recall:0", "1 <= K"),
                         ("recall:4:64:0", "at least 2 keys and 2 values"), ("recall:4:64:16:10", "100 training"),
                         ("recall:2:2:2:200", "distinct examples"),
                         ("recall:8:64:16:900000000", "examples fit here; give fewer training examples")):  # fmt: skip
        with pytest.raises(ValueError, match=message) as error:
            TaskArguments(task=bad)
        assert "\n" not in str(error.value)


def test_the_cache_is_keyed_by_content_and_read_back(tmp_path):
    first = recall_splits("recall:4:64:16:200", tmp_path)
    assert recall_splits("recall:4:64:16:200", tmp_path) == first
    recall_splits("recall:4:64:8:200", tmp_path)  # another value vocabulary: another entry
    folders = sorted(p for p in (tmp_path / "tasks" / "recall").iterdir() if p.is_dir())
    assert len(folders) == 2
    meta = json.loads((folders[0] / "meta.json").read_text())
    assert meta["generator_version"] == 1 and set(meta["digests"]) == {"train", "dev", "test"}


def test_the_recall_tokenizer_gives_every_symbol_an_id(tmp_path):
    from concept_encoder.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("recall", cache_dir=tmp_path)
    assert len(tokenizer) == 5 + 1 + 64 + 16
    ids = tokenizer("k63 v15 k0 v0 [QUERY] k0")["input_ids"]
    assert len(ids) == 8 and tokenizer.unk_token_id not in ids
    assert len(load_tokenizer("recall:8:4", cache_dir=tmp_path)) == 5 + 1 + 8 + 4
    with pytest.raises(ValueError, match="recall:<keys>:<values>"):
        load_tokenizer("recall:8", cache_dir=tmp_path)


@pytest.mark.loop
def test_recall_fine_tunes_through_the_loop(workdir, monkeypatch):
    import loops.finetune as finetune
    from concept_encoder.data.tokenizer import load_tokenizer
    from concept_encoder.decide import listops
    from concept_encoder.tasks import linear

    monkeypatch.setattr(linear, "C_GRID", (1.0,))  # the TF-IDF baseline's grid: seconds saved, nothing tested here

    arm = listops.Arm("m", "m", "micro", "concept", 8, False, "mean", 1, "scratch")
    model = listops.fresh_folder(workdir / "recall", arm, load_tokenizer("recall"), 20)
    assert finetune.main(["--model_name_or_path", str(model), "--from_scratch", "--task", "recall:4:64:16:200", "--seeds", "1",
                          "--max_steps", "2", "--eval_steps", "2", "--per_device_train_batch_size", "8",
                          "--learning_rates", "1e-3", "--max_seq_length", "20", "--report_to", "none",
                          "--progress_bar", "false"]) == 0  # fmt: skip
    report = json.loads(sorted(Path("Cache/reports").glob("finetune_*.json"))[-1].read_text())
    [run] = report["runs"]
    assert run["steps"] == 2 and 0 <= run["validation"]["accuracy"] <= 1 and run["task"] == "recall:4:64:16:200"
    assert list(Path("Cache/finetune").glob("ft-recall_4_64_16_200-*"))  # the task named in a folder name


def test_the_masked_form_answers_several_queries_and_only_their_values_are_masked(tmp_path, monkeypatch):
    from concept_encoder.data.collators import build_collator
    from concept_encoder.data.tokenizer import load_tokenizer
    from concept_encoder.tasks.loading import training_texts

    monkeypatch.chdir(tmp_path)
    texts = training_texts("recall:6:64:16:200")
    assert len(texts) == 200
    for text in texts:
        pairs = dict(zip(text.split(" [QUERY] ")[0].split()[0::2], text.split(" [QUERY] ")[0].split()[1::2],
                         strict=True))  # fmt: skip
        answers = [part.split() for part in text.split(" [QUERY] ")[1:]]
        assert len(answers) == 4 and len({k for k, _ in answers}) == 4
        assert all(pairs[k] == v for k, v in answers)  # each answer is its key's value
    tokenizer = load_tokenizer("recall")
    collator = build_collator(tokenizer, masking="query_values", seed=0)
    batch = collator([{"input_ids": tokenizer(t)["input_ids"]} for t in texts[:8]])
    query = tokenizer.convert_tokens_to_ids("[QUERY]")
    for row, text in enumerate(texts[:8]):
        ids = tokenizer(text)["input_ids"]
        after = {i for i in range(2, len(ids)) if ids[i - 2] == query}
        masked = {i for i, label in enumerate(batch["labels"][row].tolist()) if label != -100}
        assert masked == after and len(after) == 4
        assert all(batch["labels"][row, i] == ids[i] and batch["input_ids"][row, i] == tokenizer.mask_token_id
                   for i in after)  # fmt: skip
    with pytest.raises(ValueError, match="--tokenizer recall"):
        build_collator(load_tokenizer("listops"), masking="query_values")


@pytest.mark.loop
def test_the_masked_form_pretrains_through_the_mlm_loop(workdir):
    import loops.mlm as mlm
    from concept_encoder.common.metrics_log import read_metrics

    assert mlm.main(["--preset", "micro", "--concept_num", "8", "--max_seq_length", "32", "--tokenizer", "recall",
                     "--dataset", "task:recall:4:64:16:200", "--masking", "query_values", "--packing", "false",
                     "--max_steps", "2",
                     "--per_device_train_batch_size", "8", "--logging_steps", "1", "--eval_steps", "0",
                     "--save_steps", "0", "--max_eval_batches", "1", "--report_to", "none", "--progress_bar", "false",
                     "--output_dir", "runs", "--run_name", "recall"]) == 0  # fmt: skip
    losses = [r["loss"] for r in read_metrics(Path("runs/recall/metrics.jsonl")) if r.get("kind") == "train"]
    assert len(losses) == 2 and all(loss > 0 for loss in losses)


def test_a_recall_example_longer_than_max_seq_length_is_refused_not_cut(tmp_path, monkeypatch):
    from concept_encoder.data.tokenizer import load_tokenizer
    from concept_encoder.tasks.loading import encode_splits, load_task

    monkeypatch.chdir(tmp_path)
    task = load_task(TaskArguments(task="recall:8:64:16:100"))  # 2 * 8 + 4 = 20 tokens an example
    tokenizer = load_tokenizer("recall:64:16")
    with pytest.raises(ValueError, match="recall:8:64:16:100' has examples of up to 20 tokens, longer than "
                                         "--max_seq_length 19: .* pass --max_seq_length 20 or more"):  # fmt: skip
        encode_splits(task, tokenizer, 19)
    encoded = encode_splits(task, tokenizer, 20)
    assert {len(ids) for split in encoded.values() for ids in split["input_ids"]} == {20}  # whole: the query kept
    assert tokenizer.convert_ids_to_tokens(encoded["train"][0]["input_ids"])[-3] == "[QUERY]"


def test_a_point_is_never_read_from_a_report_an_earlier_attempt_left(tmp_path, monkeypatch):
    from concept_encoder.decide import experiments

    folder = experiments.PointFolder(tmp_path / "map", "recall:4", [], 1, probe=False)
    reports = tmp_path / "map" / "reports" / "C4-conv"
    reports.mkdir(parents=True)
    old = {"rows": [{"seeds": [42]}], "baselines": {}, "runs": []}  # a one-seed attempt's report
    (reports / "finetune_20261201-000000.json").write_text(json.dumps(old))
    monkeypatch.setattr(experiments, "run_command", lambda command: 0)  # a run that ends without a report
    with pytest.raises(RuntimeError, match="did not finish \\(exit code 0 but no report: it failed, or a signal"):
        folder.measure("C4-conv", "model", ["--seeds", "3"], {})
    assert not folder.point_file("C4-conv").exists()  # no point holding the old attempt's seeds

    def reported(command):  # a run that ends writes its report (the old one is left beside it)
        (reports / "finetune_20261201-000001.json").write_text(json.dumps({**old, "rows": [{"seeds": [42, 43, 44]}]}))
        return 0

    monkeypatch.setattr(experiments, "run_command", reported)
    assert folder.measure("C4-conv", "model", ["--seeds", "3"], {})["rows"] == [{"seeds": [42, 43, 44]}]


def test_pretraining_on_a_larger_recall_split_that_holds_the_tasks_test_examples_is_refused(tmp_path, monkeypatch):
    from concept_encoder.tasks.leakage import planned_overlap
    from concept_encoder.tasks.loading import load_task
    from concept_encoder.tasks.recall import pretraining_texts, recall_pairs

    monkeypatch.chdir(tmp_path)
    task = load_task(TaskArguments(task="recall:8:64:16:200"))  # rows 200-299 of the stream: its dev and test
    larger = parse_recall("recall:8:64:16:300")  # its training split is rows 0-299: the same examples
    masked = set(pretraining_texts("recall:8:64:16:300"))
    held = {text for split in (task.dev, task.validation) for text in split["text_a"]}
    assert larger.train == 300 and not held & masked  # the masked form never equals a held-out text...
    assert {recall_pairs(t) for t in held} <= {recall_pairs(t) for t in masked}  # ...but holds its pairs, answered
    message = planned_overlap("task:recall:8:64:16:300", task)
    assert message and "100 of them stand in the dev or" in message
    assert planned_overlap("task:recall:8:64:16:200", task) is None  # its own training split: nothing held out read


def test_the_masked_form_is_read_whole_or_refused():
    from concept_encoder.data.arguments import DataArguments

    masked = {"dataset": "task:recall:64,docstrings", "masking": "query_values"}
    with pytest.raises(ValueError, match="packing would cut them at block ends .* pass --packing false"):
        DataArguments(**masked)  # packing is the default
    with pytest.raises(ValueError, match="max_seq_length=128 cuts the masked recall examples of --dataset "
                                         "task:recall:64,docstrings \\(142 tokens each\\): pass --max_seq_length 142"):  # fmt: skip
        DataArguments(**masked, packing=False)  # 1 + 64 pairs + 4 queries of 3 symbols + 1
    assert DataArguments(**masked, packing=False, max_seq_length=142).max_seq_length == 142
    assert DataArguments(dataset="task:recall:64", max_seq_length=16).packing  # other maskings: documents packed
