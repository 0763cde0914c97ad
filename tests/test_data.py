"""Data pipeline: sources, tokenizer cache (a damaged entry rebuilt), packing, masking collators, offline
behaviour, caches keyed on content (a replaced file rebuilds, an empty split is never cached)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from datasets import Dataset, DatasetDict, IterableDatasetDict

from concept_encoder.data import (
    DataArguments,
    DataSourceError,
    SpanMaskingCollator,
    WholeWordMaskingCollator,
    build_collator,
    embedded_documents,
    load_raw_dataset,
    load_tokenizer,
    prepare_data,
    preprocess,
)
from concept_encoder.data.sources import source_fingerprint

ROOT = Path(__file__).resolve().parents[1]
WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda omicron sigma omega".split()


def make_documents(n: int = 60, seed: int = 0) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    docs = []
    for _ in range(n):
        length = int(torch.randint(5, 80, (1,), generator=g))
        picks = torch.randint(len(WORDS), (length,), generator=g).tolist()
        docs.append(" ".join(WORDS[i] + ("ification" if i % 3 == 0 else "") for i in picks) + ".")
    return docs


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    texts = embedded_documents()[:200]
    return load_tokenizer("train:wordpiece:2000", texts=iter(texts), corpus_id="embedded-test", cache_dir=cache)


def raw_from(docs: list[str]) -> DatasetDict:
    return DatasetDict(
        {"train": Dataset.from_dict({"text": docs}), "validation": Dataset.from_dict({"text": docs[:3]})}
    )


@pytest.mark.parametrize("block_cls", [True, False])
def test_packing_keeps_every_token_up_to_the_final_remainder(tokenizer, block_cls):
    docs = make_documents()
    L = 32
    processed, stats = preprocess(raw_from(docs), tokenizer, L, packing=True, block_cls=block_cls)
    stream = []
    for ids in tokenizer(docs, add_special_tokens=False)["input_ids"]:
        stream += ids + [tokenizer.sep_token_id]
    blocks = processed["train"]["input_ids"]
    body = L - block_cls  # stream tokens per block: [CLS] takes the first position
    assert all(len(b) == L for b in blocks)
    assert all((b[0] == tokenizer.cls_token_id) == block_cls for b in blocks)  # [CLS] at every block start, or none
    assert sum(b.count(tokenizer.cls_token_id) for b in blocks) == len(blocks) * block_cls  # nowhere else
    assert len(blocks) == len(stream) // body
    assert [t for b in blocks for t in b[block_cls:]] == stream[: len(blocks) * body]  # same tokens, same order
    assert len(stream) - len(blocks) * body < body  # the documented remainder
    assert stats["train"]["tokens"] == len(blocks) * L and stats["block_cls"] == block_cls
    assert len(stream) - len(blocks) * body <= stats["train"]["dropped_tokens_at_most"]
    assert all(len(w) == L for w in processed["train"]["word_start"])
    if block_cls:  # [CLS] is a unit of its own for whole-word and span masking
        assert all(w[0] == 1 for w in processed["train"]["word_start"])


def test_document_blocks_never_mix_two_documents_and_each_restarts_at_cls(tokenizer):
    docs = make_documents(40)
    L = 16
    processed, stats = preprocess(raw_from(docs), tokenizer, L, packing=True, document_blocks=True)
    blocks = processed["train"]["input_ids"]
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    assert all(b[0] == cls and 2 <= len(b) <= L for b in blocks)
    assert sum(b.count(cls) for b in blocks) == len(blocks)  # [CLS] at every block start, nowhere else
    assert sum(b.count(sep) for b in blocks) == len(docs)  # one [SEP] per document ...
    assert all(sep not in b[:-1] for b in blocks)  # ... always the last token: no block holds two documents
    documents, current = [], []
    for b in blocks:  # reassembled block after block, each document comes back whole, in order
        current += b[1:]
        if b[-1] == sep:
            documents.append(current)
            current = []
    expected = [ids + [sep] for ids in tokenizer(docs, add_special_tokens=False)["input_ids"]]
    assert documents == expected  # nothing dropped, nothing from another document
    assert all(len(b) == L for i, b in enumerate(blocks) if b[-1] != sep)  # only a document's last block is short
    assert stats["document_blocks"] and stats["train"]["tokens"] == sum(len(b) for b in blocks)
    lengths = sorted(len(d) for d in expected)
    assert stats["train"]["document_tokens"] == {"median": lengths[len(lengths) // 2],
                                                 "p90": lengths[int(0.9 * len(lengths))], "max": lengths[-1]}  # fmt: skip
    again, _ = preprocess(raw_from(docs), tokenizer, L, packing=True)
    assert again["train"]["input_ids"] != blocks  # the stream packing is another dataset (and cache key)
    with pytest.raises(ValueError, match="document_blocks=True cuts documents into blocks: it needs packing=True"):
        DataArguments(packing=False, document_blocks=True)


def test_packing_needs_a_cls_token_or_says_how_to_go_without(tokenizer):
    from transformers import PreTrainedTokenizerFast

    headless = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, pad_token="[PAD]",
                                       mask_token="[MASK]", sep_token="[SEP]")  # fmt: skip
    with pytest.raises(ValueError, match="no \\[CLS\\] token to start each packed block with; pass --block_cls false"):
        preprocess(raw_from(make_documents()), headless, 32)
    processed, _ = preprocess(raw_from(make_documents()), headless, 32, block_cls=False)
    assert len(processed["train"]) > 0


def test_one_document_per_example_mode(tokenizer):
    docs = make_documents(10)
    processed, _ = preprocess(raw_from(docs), tokenizer, 16, packing=False)
    rows = processed["train"]["input_ids"]
    assert len(rows) == len(docs)
    assert all(r[0] == tokenizer.cls_token_id and r[-1] == tokenizer.sep_token_id and len(r) <= 16 for r in rows)
    batch = build_collator(tokenizer, seed=0, pad_to_multiple_of=8)([processed["train"][i] for i in range(4)])
    assert batch["input_ids"].shape[1] % 8 == 0
    assert (batch["labels"][batch["attention_mask"] == 0] == -100).all()


def test_processed_dataset_is_cached_and_reused(tokenizer, tmp_path, monkeypatch):
    from concept_encoder.data import processing

    raw = raw_from(make_documents())
    first, stats = preprocess(raw, tokenizer, 32, cache_dir=tmp_path, source="gen")
    path = Path(stats["cache_path"])
    assert path.is_dir() and path.parent == tmp_path / "datasets"
    stamp = (path / "stats.json").stat().st_mtime_ns
    second, stats2 = preprocess(raw, tokenizer, 32, cache_dir=tmp_path, source="gen")
    assert (path / "stats.json").stat().st_mtime_ns == stamp and stats2 == stats
    assert second["train"]["input_ids"] == first["train"]["input_ids"]
    _, other = preprocess(raw, tokenizer, 64, cache_dir=tmp_path, source="gen")
    assert other["cache_path"] != stats["cache_path"]  # the key includes the sequence length
    headless, without_cls = preprocess(raw, tokenizer, 32, cache_dir=tmp_path, source="gen", block_cls=False)
    assert without_cls["cache_path"] != stats["cache_path"]  # ... and whether blocks start with [CLS]
    assert headless["train"]["input_ids"][0][0] != tokenizer.cls_token_id == first["train"]["input_ids"][0][0]
    blocks = [list(ids) for ids in first["train"]["input_ids"]]  # read now: `first` maps the files damaged below
    for arrow in path.rglob("*.arrow"):  # a damaged entry (a disk error, a killed copy): named and rebuilt
        arrow.write_bytes(b"not arrow")
    warnings = []
    monkeypatch.setattr(processing.logger, "warning", lambda text, *args: warnings.append(text % args))
    rebuilt, stats3 = preprocess(raw, tokenizer, 32, cache_dir=tmp_path, source="gen")
    assert len(warnings) == 1 and warnings[0].startswith(f"dataset cache {path} does not load (")
    assert [list(ids) for ids in rebuilt["train"]["input_ids"]] == blocks and stats3 == stats
    assert not [p for p in (tmp_path / "datasets").iterdir() if ".partial" in p.name]  # written aside, renamed


def packed_examples(tokenizer, n_docs=400, L=64):
    processed, _ = preprocess(raw_from(make_documents(n_docs, seed=1)), tokenizer, L)
    return [processed["train"][i] for i in range(len(processed["train"]))]


@pytest.mark.parametrize("masking", ["mlm", "whole_word", "span"])
def test_masking_rate_and_specials(tokenizer, masking):
    examples = packed_examples(tokenizer)
    collator = build_collator(tokenizer, masking=masking, mlm_probability=0.15, seed=0)
    masked = eligible = replaced = 0
    for start in range(0, len(examples), 16):
        chunk = examples[start : start + 16]
        batch = collator(chunk)
        original = torch.tensor([e["input_ids"] for e in chunk])
        labelled = batch["labels"] != -100
        special = torch.isin(original, torch.tensor(tokenizer.all_special_ids))
        assert not (labelled & special).any(), "a special token was masked"
        assert (batch["labels"][labelled] == original[labelled]).all()
        assert (batch["input_ids"][~labelled] == original[~labelled]).all()
        masked += int(labelled.sum())
        eligible += int((~special).sum())
        replaced += int((batch["input_ids"][labelled] == tokenizer.mask_token_id).sum())
    assert eligible > 20_000
    assert abs(masked / eligible - 0.15) < 0.01, f"{masking}: masked fraction {masked / eligible:.4f}"
    assert abs(replaced / masked - 0.8) < 0.03, f"{masking}: [MASK] share {replaced / masked:.3f}"


def test_whole_words_are_masked_together(tokenizer):
    examples = packed_examples(tokenizer, n_docs=100)
    collator = WholeWordMaskingCollator(tokenizer, mlm_probability=0.3, seed=1)
    batch = collator(examples[:32])
    labelled = (batch["labels"] != -100).tolist()
    multi_token_words = 0
    for row, example in enumerate(examples[:32]):
        starts = example["word_start"]
        word, words = [], []
        for i, s in enumerate(starts):
            if s and word:
                words.append(word)
                word = []
            word.append(i)
        words.append(word)
        for w in words:
            flags = {labelled[row][i] for i in w}
            assert len(flags) == 1, f"word {w} partly masked"
            multi_token_words += len(w) > 1
    assert multi_token_words > 50  # the corpus really has words split into several tokens


def masked_runs(row: list[bool]) -> list[int]:
    runs, n = [], 0
    for flag in row + [False]:
        if flag:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


def test_spans_are_contiguous_bounded_and_hit_the_budget(tokenizer):
    examples = packed_examples(tokenizer)
    collator = SpanMaskingCollator(tokenizer, mean_span_length=3.0, max_span_length=6, mlm_probability=0.2, seed=2)
    batch = collator(examples[:64])
    original = torch.tensor([e["input_ids"] for e in examples[:64]])
    eligible = ~torch.isin(original, torch.tensor(tokenizer.all_special_ids))
    lengths = []
    for row in range(64):
        labelled = (batch["labels"][row] != -100).tolist()
        runs = masked_runs(labelled)
        assert all(1 <= r <= 6 for r in runs)
        assert sum(runs) == round(0.2 * int(eligible[row].sum()))
        lengths += runs
    mean = sum(lengths) / len(lengths)
    assert 2.0 < mean < 3.5, f"mean span length {mean:.2f}"  # geometric(1/3) clipped at 6, last span shortened


@pytest.mark.parametrize("masking", ["mlm", "whole_word", "span"])
def test_seeded_collators_are_reproducible_and_resumable(tokenizer, masking):
    examples = packed_examples(tokenizer, n_docs=60)[:8]
    a = build_collator(tokenizer, masking=masking, seed=5)
    b = build_collator(tokenizer, masking=masking, seed=5)
    first = a(examples)
    assert torch.equal(first["labels"], b(examples)["labels"])
    state = a.state_dict()
    expected = a(examples)
    c = build_collator(tokenizer, masking=masking, seed=99)
    c.load_state_dict(state)
    assert torch.equal(c(examples)["input_ids"], expected["input_ids"])
    assert not torch.equal(a(examples)["labels"], expected["labels"])  # the stream moves on


def test_local_txt_jsonl_parquet_round_trip(tmp_path):
    docs = [d.replace("\n", " ") for d in make_documents(40)]
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "a.txt").write_text("\n\n".join(docs[:20]))
    (tmp_path / "txt" / "b.txt").write_text("\n\n".join(docs[20:]))
    with open(tmp_path / "docs.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"content": d, "id": 1}) + "\n")
    Dataset.from_dict({"body": docs}).to_parquet(str(tmp_path / "docs.parquet"))

    for spec, field in [
        (tmp_path / "txt", "text"),
        (tmp_path / "docs.jsonl", "content"),
        (tmp_path / "docs.parquet", "body"),
    ]:
        raw = load_raw_dataset(str(spec), text_field=field, validation_split_percentage=10)
        assert raw["train"].column_names == ["text"]
        assert len(raw["validation"]) == 4
        assert sorted(list(raw["train"]["text"]) + list(raw["validation"]["text"])) == sorted(docs), spec


def test_streamed_local_file_holds_out_its_first_documents_and_tokenises_lazily(tmp_path, tokenizer):
    docs = [d.replace("\n", " ") for d in make_documents(30)]
    with open(tmp_path / "docs.jsonl", "w") as f:
        for d in docs:
            f.write(json.dumps({"content": d, "id": 1}) + "\n")
    raw = load_raw_dataset(str(tmp_path / "docs.jsonl"), text_field="content", streaming=True,
                           streaming_validation_documents=4)  # fmt: skip
    assert isinstance(raw, IterableDatasetDict)
    assert [r["text"] for r in raw["validation"]] == docs[:4]
    assert [r["text"] for r in raw["train"]] == docs[4:]
    processed, stats = preprocess(raw, tokenizer, 32, packing=True, cache_dir=tmp_path / "cache")
    assert stats == {"streaming": True, "cache_path": None} and not (tmp_path / "cache").exists()
    blocks = [row["input_ids"] for row in processed["train"]]
    assert blocks and all(len(b) == 32 for b in blocks)
    with pytest.raises(ValueError, match="streaming_validation_documents=0 must be at least 1"):
        DataArguments(streaming=True, streaming_validation_documents=0)


def test_a_local_folder_is_read_only_inside_itself(tmp_path, caplog):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("\n\n".join(f"secretword paragraph {i} " * 5 for i in range(30)))
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    (corpus / "a.txt").write_text("\n\n".join(f"inside words paragraph {i} " * 5 for i in range(30)))
    (corpus / "link.txt").symlink_to(outside / "secret.txt")
    (corpus / "sub" / "linked").symlink_to(outside, target_is_directory=True)
    before = source_fingerprint(str(corpus))
    raw = load_raw_dataset(str(corpus))
    texts = [*raw["train"]["text"], *raw["validation"]["text"]]
    assert len(texts) == 30 and not any("secretword" in t for t in texts)
    (corpus / "link.txt").unlink()  # the caches key on the files read: a link left out is no part of the key
    assert source_fingerprint(str(corpus)) == before
    assert "1 file(s) lead outside the folder through a link and are not read" in caplog.text  # link.txt
    # (a linked folder is not walked into at all, so sub/linked/secret.txt is never listed)


def test_a_folder_named_by_splits_keeps_them_apart_and_leaves_test_out(tmp_path, caplog):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for name, word, n in (
        ("train.txt", "trainword", 40),
        ("validation.txt", "validword", 6),
        ("test.txt", "testword", 6),
    ):
        (corpus / name).write_text("\n\n".join(f"{word} paragraph {i} " * 5 for i in range(n)))
    raw = load_raw_dataset(str(corpus))
    assert len(raw["train"]) == 40 and all("trainword" in t for t in raw["train"]["text"])
    assert len(raw["validation"]) == 6 and all("validword" in t for t in raw["validation"]["text"])
    assert "1 test file(s) left out of pretraining" in caplog.text
    (corpus / "train.txt").unlink()
    with pytest.raises(DataSourceError, match="no training text"):
        load_raw_dataset(str(corpus))


def test_bad_sources_give_clear_errors(tmp_path):
    with pytest.raises(DataSourceError, match="no such file or folder"):
        load_raw_dataset("./missing/corpus.txt")
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "x y z"}) + "\n")
    with pytest.raises(DataSourceError, match="no column 'text'.*--text_field"):
        load_raw_dataset(str(tmp_path / "d.jsonl"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataSourceError, match="holds no .txt"):
        load_raw_dataset(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="masking='bert'"):
        DataArguments(masking="bert")
    with pytest.raises(ValueError, match="train:<kind>:<vocab_size>"):
        load_tokenizer("train:sentencepiece:8000", texts=iter(["a"]))
    (tmp_path / "model-only").mkdir()  # a model saved without its tokenizer: no default one is made up
    (tmp_path / "model-only" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(DataSourceError, match="--tokenizer .*model-only holds no tokenizer \\(tokenizer.json"):
        load_tokenizer(str(tmp_path / "model-only"))


def test_texts_that_are_not_strings_are_counted_and_skipped_and_too_little_text_is_one_error(tmp_path, caplog):
    rows = [{"text": t} for t in ["first doc here", 5, None, ["a", "list"], "second one", 2.5, *make_documents(40)]]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = load_raw_dataset(str(tmp_path / "mixed.jsonl"))
    texts = list(raw["train"]["text"]) + list(raw["validation"]["text"])
    assert sorted(texts) == sorted(r["text"] for r in rows if isinstance(r["text"], str))
    assert "mixed.jsonl (train split): 4 text(s) are not strings (1 NoneType, 1 float, 1 int, 1 list): skipped" in (
        caplog.text
    )
    (tmp_path / "numbers.jsonl").write_text("".join(json.dumps({"text": n}) + "\n" for n in range(50)))
    (tmp_path / "blank.txt").write_text("   \n\n\t\n")
    for name in ("numbers.jsonl", "blank.txt"):
        with pytest.raises(DataSourceError, match="has no documents in its train split: every 'text' value is empty"):
            load_raw_dataset(str(tmp_path / name))
    (tmp_path / "one.txt").write_text("a single document of a few words\n")
    with pytest.raises(DataSourceError, match="1 document\\(s\\) cannot be split .* --validation_split_percentage 5"):
        load_raw_dataset(str(tmp_path / "one.txt"))


def test_unreachable_hub_fails_fast_with_a_clear_message(monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    for call in (lambda: load_raw_dataset("JeanKaddour/minipile"), lambda: load_tokenizer("bert-base-uncased")):
        start = time.monotonic()
        with pytest.raises(DataSourceError) as error:
            call()
        assert time.monotonic() - start < 10
        message = str(error.value)
        assert "Hub" in message and "local path" in message


def test_trained_tokenizer_is_cached_and_reused(tmp_path):
    texts = embedded_documents()[:100]
    first = load_tokenizer("train:bpe:600", texts=iter(texts), corpus_id="c1", cache_dir=tmp_path)

    def must_not_train():
        raise AssertionError("tokenizer was trained again")
        yield  # pragma: no cover

    second = load_tokenizer("train:bpe:600", texts=must_not_train(), corpus_id="c1", cache_dir=tmp_path)
    assert second.get_vocab() == first.get_vocab()
    assert {second.pad_token, second.mask_token, second.cls_token, second.sep_token, second.unk_token} == {
        "[PAD]",
        "[MASK]",
        "[CLS]",
        "[SEP]",
        "[UNK]",
    }
    assert len([p for p in (tmp_path / "tokenizers").iterdir() if p.suffix != ".lock"]) == 1  # one entry (+ its lock)


def test_embedded_corpus_and_cli_work_offline(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_ENDPOINT": "http://127.0.0.1:9"}
    cmd = [
        sys.executable,
        "-m",
        "concept_encoder.data",
        "--tokenizer",
        "train:wordpiece:3000",
        "--max_seq_length",
        "64",
    ]
    out = subprocess.run(
        cmd + ["--cache_dir", str(tmp_path)], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "documents" in out.stdout and "examples" in out.stdout and str(tmp_path) in out.stdout
    assert out.stdout.count("[MASK]") >= 2
    data = prepare_data(DataArguments(tokenizer="train:wordpiece:3000", max_seq_length=64), cache_dir=tmp_path)
    assert len(data.train) > 100 and len(data.validation) > 5
    assert data.stats["train"]["documents"] > 300


def test_a_damaged_tokenizer_cache_entry_is_named_and_rebuilt(tmp_path, monkeypatch):
    from concept_encoder.data import tokenizer as tokenizers

    warnings = []
    monkeypatch.setattr(tokenizers.logger, "warning", lambda text, *args: warnings.append(text % args))
    texts = ["alpha beta gamma delta", "epsilon zeta eta theta"] * 20
    path = tmp_path / "wordpiece-300-x"
    first = tokenizers.cached_trained_tokenizer(path, "train:wordpiece:300", "wordpiece", 300, iter(texts))
    (path / "tokenizer.json").write_text("{ not json")
    again = tokenizers.cached_trained_tokenizer(path, "train:wordpiece:300", "wordpiece", 300, iter(texts))
    assert len(warnings) == 1 and warnings[0].startswith(f"tokenizer cache {path} does not load (")
    assert warnings[0].endswith("rebuilding it") and len(again) == len(first)  # retrained: ids may differ (README)
    reread = tokenizers.cached_trained_tokenizer(path, "train:wordpiece:300", "wordpiece", 300, None)  # no training
    assert reread.get_vocab() == again.get_vocab()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wordpiece-300-x", "wordpiece-300-x.lock"]  # no partials


def write_corpus(path: Path, documents: int, seed: int) -> None:
    words = "alpha beta gamma delta epsilon zeta theta kappa lambda omicron sigma omega".split()
    paragraphs = [" ".join(words[(seed + i * 7 + j) % len(words)] for j in range(60)) for i in range(documents)]
    path.write_text("\n\n".join(paragraphs) + "\n")


def test_a_replaced_data_file_rebuilds_and_an_empty_split_is_never_cached(tmp_path):
    from concept_encoder.data import DataArguments, DataSourceError, prepare_data

    corpus = tmp_path / "corpus.txt"
    write_corpus(corpus, 40, seed=0)
    args = DataArguments(dataset=str(corpus), tokenizer="train:wordpiece:200", max_seq_length=32)
    first = prepare_data(args, cache_dir=tmp_path / "cache")
    assert first.stats["train"]["documents"] + first.stats["validation"]["documents"] == 40
    write_corpus(corpus, 80, seed=1)  # same path, new content
    second = prepare_data(args, cache_dir=tmp_path / "cache")
    assert second.stats["train"]["documents"] + second.stats["validation"]["documents"] == 80
    assert second.stats["cache_path"] != first.stats["cache_path"]

    tiny = tmp_path / "tiny.txt"
    write_corpus(tiny, 20, seed=2)
    for _ in range(2):  # the second attempt gives the same clear error: nothing empty was cached
        with pytest.raises(DataSourceError, match=r"the validation split yields no example: 1 documents, \d+ tokens"):
            prepare_data(DataArguments(dataset=str(tiny), tokenizer="train:wordpiece:200", max_seq_length=512),
                         cache_dir=tmp_path / "cache")  # fmt: skip
    assert len([p for p in (tmp_path / "cache" / "datasets").iterdir() if p.is_dir()]) == 2  # the two good builds


def test_a_model_folder_is_read_with_its_own_tokenizer(tmp_path, tokenizer):
    from concept_encoder.data.tokenizer import model_tokenizer_folder
    from concept_encoder.training.runs import starting_tokenizer

    model, bare, other = tmp_path / "model", tmp_path / "bare", tmp_path / "other"
    for folder in (model, bare):
        folder.mkdir()
        (folder / "config.json").write_text("{}")
    tokenizer.save_pretrained(model)
    tokenizer.save_pretrained(other)
    assert model_tokenizer_folder(model, None) == str(model) == model_tokenizer_folder(model, str(model) + "/")
    with pytest.raises(DataSourceError, match=f"--tokenizer {other}: {model} has its own tokenizer, the one its"):
        model_tokenizer_folder(model, str(other))  # another tokenizer: ids would read other tokens' embeddings
    assert model_tokenizer_folder(bare, str(other)) == str(other)  # a folder saved without one: the one given
    with pytest.raises(DataSourceError, match=f"{bare} holds no tokenizer .*pass --tokenizer <the folder of the"):
        model_tokenizer_folder(bare, None)
    assert starting_tokenizer(None, str(model), "train:wordpiece:8000") == model  # the default: the folder's own
    with pytest.raises(DataSourceError, match="holds no tokenizer .*; --tokenizer must be the folder of the tokenizer"):
        starting_tokenizer(None, str(bare), "train:wordpiece:2000")  # a fresh tokenizer for trained weights
    assert starting_tokenizer(None, None, "train:wordpiece:8000") is None
