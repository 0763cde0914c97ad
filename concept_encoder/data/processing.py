"""Tokenise documents and pack them into fixed-length blocks, with an on-disk cache.

Packing: every document is tokenised without special tokens, followed by `[SEP]`, the
stream is concatenated and cut into blocks of exactly `max_seq_length` tokens, each of which
starts with `[CLS]` (`block_cls`, the default: `[CLS] …doc a… [SEP] doc b… `, so pretraining
sees the token fine-tuning classifies from, at the position it has there). Nothing is
truncated away; the only tokens dropped are the final remainder of each `map` batch (fewer
than a block's worth per `PACK_BATCH_DOCS` documents and worker), bounded in the stats as
`dropped_tokens_at_most`.

Document blocks (`document_blocks=True`, for long inputs): each block holds one document's contiguous text,
`[CLS]` first; a long document goes on in its next blocks, never mixed with another, and its last block is
shorter (the collator pads it). Nothing is dropped.

Without packing (`packing=False`), each document is one example: `[CLS] doc [SEP]`,
truncated to `max_seq_length` and padded by the collator (evaluation-style data).

Each example also carries `word_start` (1 where a token begins a word, from the fast
tokenizer's word ids), which whole-word and span masking use as unit boundaries.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
from pathlib import Path

from accelerate import PartialState
from datasets import DatasetDict, Features, IterableDatasetDict, Sequence, Value, load_from_disk
from transformers import PreTrainedTokenizerBase

from ..common.paths import written_aside
from .base import DataSourceError
from .tokenizer import cache_lock, first_line, slug

logger = logging.getLogger(__name__)

PACK_BATCH_DOCS = 10_000
CACHE_FORMAT_VERSION = 1
FEATURES = Features({"input_ids": Sequence(Value("int32")), "word_start": Sequence(Value("int8"))})


def word_starts(word_ids: list[int | None]) -> list[int]:
    """Fast-tokenizer word ids of one document → 1 where a new word (or a special token) begins."""
    flags, previous = [], object()
    for word in word_ids:
        flags.append(int(word is None or word != previous))
        previous = word
    return flags


def tokenize_and_pack(
    batch: dict, tokenizer: PreTrainedTokenizerBase, max_seq_length: int, block_cls: bool = True
) -> dict:
    """`{"text": [docs]}` → `{"input_ids": [[L]...], "word_start": [[L]...]}`, blocks of exactly L tokens:
    `[CLS]` and L-1 tokens of the `[SEP]`-separated stream (`block_cls`), or L tokens of the stream."""
    encoded = tokenizer(batch["text"], add_special_tokens=False)
    ids, starts = [], []
    for i, doc in enumerate(encoded["input_ids"]):
        ids.extend(doc)
        ids.append(tokenizer.sep_token_id)
        starts.extend(word_starts(encoded.word_ids(i)))
        starts.append(1)
    head_ids, head_starts = ([tokenizer.cls_token_id], [1]) if block_cls else ([], [])
    body = max_seq_length - len(head_ids)  # stream tokens per block
    usable = len(ids) // body * body
    return {
        "input_ids": [head_ids + ids[i : i + body] for i in range(0, usable, body)],
        "word_start": [head_starts + starts[i : i + body] for i in range(0, usable, body)],
    }


def tokenize_document_blocks(
    batch: dict, tokenizer: PreTrainedTokenizerBase, max_seq_length: int, block_cls: bool = True
) -> dict:
    """`{"text": [docs]}` → blocks of at most L tokens, each `[CLS]` (`block_cls`) and the next up to L-1 tokens
    of one document followed by `[SEP]`: the document's text continues block after block, and its last block
    holds what remains (shorter than L)."""
    encoded = tokenizer(batch["text"], add_special_tokens=False)
    head_ids, head_starts = ([tokenizer.cls_token_id], [1]) if block_cls else ([], [])
    body = max_seq_length - len(head_ids)
    blocks, block_starts = [], []
    for i, doc in enumerate(encoded["input_ids"]):
        ids, starts = [*doc, tokenizer.sep_token_id], [*word_starts(encoded.word_ids(i)), 1]
        for at in range(0, len(ids), body):
            blocks.append(head_ids + ids[at : at + body])
            block_starts.append(head_starts + starts[at : at + body])
    return {"input_ids": blocks, "word_start": block_starts}


def tokenize_documents(batch: dict, tokenizer: PreTrainedTokenizerBase, max_seq_length: int) -> dict:
    """One example per document: `[CLS] doc [SEP]`, truncated to `max_seq_length`."""
    encoded = tokenizer(batch["text"], truncation=True, max_length=max_seq_length)
    return {
        "input_ids": encoded["input_ids"],
        "word_start": [word_starts(encoded.word_ids(i)) for i in range(len(batch["text"]))],
    }


def tokenizer_identity(tokenizer: PreTrainedTokenizerBase) -> str:
    """What the token ids depend on, not where the tokenizer was loaded from: a fast tokenizer's whole
    serialised pipeline (vocabulary, normaliser, pre-tokeniser, post-processor), else name and vocabulary.
    So a run's own copy of its tokenizer (`<run>/tokenizer`) finds the blocks cached for the original."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # truncation and padding are call settings a tokenizer call leaves behind: not identity
        pipeline = {k: v for k, v in json.loads(backend.to_str()).items() if k not in ("truncation", "padding")}
        text = json.dumps(pipeline, sort_keys=True)
    else:
        text = tokenizer.name_or_path + json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def cache_key(source: str, tokenizer: PreTrainedTokenizerBase, max_seq_length: int, packing: bool, **extra) -> str:
    """Directory name for a processed dataset: readable prefix + hash of everything that changes its content."""
    fields = dict(
        source=source,
        tokenizer=tokenizer_identity(tokenizer),
        max_seq_length=max_seq_length,
        packing=packing,
        version=CACHE_FORMAT_VERSION,
        **extra,
    )
    digest = hashlib.sha1(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]
    return f"{slug(source)}-L{max_seq_length}-{'packed' if packing else 'docs'}-{digest}"


def worker_count(num_documents: int, requested: int | None) -> int | None:
    """Processes for `map`: as asked, else up to 8 (one per core) for large corpora, else none."""
    if requested is not None:
        return requested if requested > 1 else None
    if num_documents < 20_000:
        return None  # process start-up costs more than it saves on small corpora
    return min(8, os.cpu_count() or 1)


def preprocess(
    raw: DatasetDict | IterableDatasetDict,
    tokenizer: PreTrainedTokenizerBase,
    max_seq_length: int,
    packing: bool = True,
    cache_dir: str | Path | None = None,
    source: str = "",
    num_proc: int | None = None,
    block_cls: bool = True,
    document_blocks: bool = False,
    **key_extra,
) -> tuple[DatasetDict | IterableDatasetDict, dict]:
    """Tokenise (and pack) `raw` → (`{train, validation}` of `input_ids`/`word_start`, stats dict).

    With `cache_dir`, the result is saved under `<cache_dir>/datasets/<key>` and reused; the main
    process builds it first while the other ranks wait, then they load it. `block_cls` (packing only):
    every block starts with `[CLS]`; `document_blocks` (packing only): blocks of one document each; both part of
    the cache key.
    """
    if max_seq_length < 2:
        raise ValueError(f"max_seq_length={max_seq_length} must be at least 2")
    block_cls = block_cls and packing  # unpacked documents are `[CLS] doc [SEP]` anyway
    if block_cls and tokenizer.cls_token_id is None:
        raise ValueError(
            f"tokenizer {tokenizer.name_or_path!r} has no [CLS] token to start each packed block with; "
            "pass --block_cls false, or use a tokenizer with a cls_token"
        )
    fn = (tokenize_document_blocks if document_blocks else tokenize_and_pack) if packing else tokenize_documents
    fn_kwargs = dict(
        tokenizer=tokenizer, max_seq_length=max_seq_length, **({"block_cls": block_cls} if packing else {})
    )
    kwargs = dict(batched=True, fn_kwargs=fn_kwargs)
    if packing:
        key_extra["block_cls"] = block_cls
    if packing and document_blocks:  # only then: the keys of every earlier cache entry stay as they were
        key_extra["document_blocks"] = True
    full_blocks = packing and not document_blocks  # every example exactly max_seq_length tokens

    if isinstance(raw, IterableDatasetDict):  # streaming: processed lazily, never cached
        processed = IterableDatasetDict(
            {
                name: ds.map(fn, remove_columns=["text"], batch_size=PACK_BATCH_DOCS, **kwargs)
                for name, ds in raw.items()
            }
        )
        return processed, {"streaming": True, "cache_path": None}

    path = (
        None
        if cache_dir is None
        else Path(cache_dir) / "datasets" / cache_key(source, tokenizer, max_seq_length, packing, **key_extra)
    )
    with PartialState().main_process_first(), cache_lock(path):
        if path is not None and (path / "stats.json").exists():
            try:
                return load_from_disk(str(path)), json.loads((path / "stats.json").read_text())
            except Exception as error:  # a damaged entry: say which, then rebuild it
                logger.warning("dataset cache %s does not load (%s): rebuilding it", path, first_line(error))
                shutil.rmtree(path, ignore_errors=True)
        workers = {name: worker_count(len(ds), num_proc) for name, ds in raw.items()}
        processed = DatasetDict(
            {
                name: ds.map(
                    fn,
                    remove_columns=ds.column_names,
                    batch_size=PACK_BATCH_DOCS,
                    features=FEATURES,
                    num_proc=workers[name],
                    desc=f"tokenizing {name}",
                    **kwargs,
                )
                for name, ds in raw.items()
            }
        )
        stats = dataset_stats(raw, processed, max_seq_length, full_blocks, workers)
        stats.update(packing=packing, block_cls=block_cls, document_blocks=packing and document_blocks)
        if packing and document_blocks:  # the length of what a long-input model reads: each document's tokens
            for name in raw:
                stats[name]["document_tokens"] = length_summary(
                    document_lengths(processed[name]["input_ids"], tokenizer.sep_token_id, int(block_cls))
                )
        check_not_empty(raw, processed, tokenizer, max_seq_length, packing, block_cls)  # an empty split is never cached
        if path is not None and PartialState().is_main_process:  # written aside, renamed when whole
            stats["cache_path"] = str(path)
            with written_aside(path, replace_existing=True) as partial:
                processed.save_to_disk(str(partial))
                (partial / "stats.json").write_text(json.dumps(stats, indent=2))
            processed = load_from_disk(str(path))  # memory-mapped, like the later runs get it
    return processed, stats


def check_not_empty(
    raw: DatasetDict, processed: DatasetDict, tokenizer, max_seq_length: int, packing: bool, block_cls: bool = False
) -> None:
    """DataSourceError naming the split that yields no example, its token count and what is needed."""
    for name in raw:
        if len(processed[name]):
            continue
        tokens = sum(len(ids) for ids in tokenizer(list(raw[name]["text"]), add_special_tokens=False)["input_ids"])
        need = (
            f"packing needs at least {max_seq_length - block_cls} tokens (counting a [SEP] after each document) "
            f"for one block of --max_seq_length {max_seq_length}"
            if packing
            else "each document becomes one example"
        )
        raise DataSourceError(
            f"the {name} split yields no example: {len(raw[name])} documents, {tokens} tokens; {need}. "
            f"Use more text, a smaller --max_seq_length"
            + (", or a larger --validation_split_percentage" if len(raw) > 1 else "")
        )


def dataset_stats(raw: DatasetDict, processed: DatasetDict, max_seq_length: int, full_blocks: bool, workers) -> dict:
    """Documents, examples and tokens per split; for full blocks (packing a stream), a bound on the tokens cut
    as remainders."""
    stats: dict = {"max_seq_length": max_seq_length, "packing": full_blocks, "cache_path": None}
    for name in raw:
        examples = len(processed[name])
        tokens = examples * max_seq_length if full_blocks else sum(len(ids) for ids in processed[name]["input_ids"])
        stats[name] = {"documents": len(raw[name]), "examples": examples, "tokens": tokens}
        if full_blocks:
            # each map batch (per worker shard) may cut fewer than max_seq_length tokens at its end
            map_batches = math.ceil(len(raw[name]) / PACK_BATCH_DOCS) + (workers[name] or 1) - 1
            stats[name]["dropped_tokens_at_most"] = map_batches * (max_seq_length - 1)
    return stats


def document_lengths(blocks: list[list[int]], sep_id: int, head: int) -> list[int]:
    """Tokens per document (its text and `[SEP]`) of document blocks in order: a document's blocks are
    consecutive and only its last one ends with `[SEP]` (`head`: the `[CLS]` each block starts with)."""
    lengths, current = [], 0
    for ids in blocks:
        current += len(ids) - head
        if ids and ids[-1] == sep_id:
            lengths.append(current)
            current = 0
    return lengths


def length_summary(lengths: list[int]) -> dict:
    """Median and 90th percentile (nearest rank) of `lengths`, and the longest."""
    ordered = sorted(lengths)
    if not ordered:
        return {"median": 0, "p90": 0, "max": 0}
    return {"median": ordered[len(ordered) // 2], "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))],
            "max": ordered[-1]}  # fmt: skip
