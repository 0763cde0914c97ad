"""`prepare_data`: sources → tokenizer → tokenise/pack (cached) → masking collator, in one call."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datasets import DatasetDict, IterableDataset, concatenate_datasets

from ..common.paths import cache_path
from .arguments import DataArguments
from .collators import build_collator
from .docstrings import docstring_corpus, is_docstrings_spec
from .processing import preprocess
from .sources import TaskTexts, load_raw_dataset, source_fingerprint
from .tokenizer import load_tokenizer

TOKENIZER_TRAINING_DOCS = 200_000  # enough for a good vocabulary; bounds the cost on huge corpora


@dataclass
class PreparedData:
    tokenizer: Any
    train: Any
    validation: Any
    collator: Any
    stats: dict
    documents: Any = None  # the raw splits' `text` (not streamed): example i of a split is document i when unpacked

    @property
    def streaming(self) -> bool:
        """True when the splits are `datasets.IterableDataset`s (no length, no indexing)."""
        return isinstance(self.train, IterableDataset)


def prepare_data(
    args: DataArguments,
    cache_dir: str | Path = "Cache",
    seed: int | None = None,
    tokenizer_folder: Path | None = None,
    held_out: bool = False,
    task_texts: TaskTexts | None = None,
) -> PreparedData:
    """Load the source, load/train the tokenizer, tokenise + pack (cached), build the collator.
    `tokenizer_folder`: use this saved tokenizer instead of `args.tokenizer` (a resumed run's own copy).
    `held_out`: the whole source is one `validation` split, packed in order (`train` is None): text a model
    is evaluated on, never trained on, however short (the held-out language check). `task_texts`: how a
    `task:<name>` source of a mixture is read (`tasks.loading.training_texts`; the data layer knows no tasks)."""
    cache_dir = cache_path(cache_dir)  # `Cache` is the project's (paths.py)
    raw = load_raw_dataset(
        args.dataset,
        args.text_field,
        None if held_out else args.validation_split_percentage,  # held out: read whole, however short
        args.streaming,
        args.streaming_validation_documents,
        cache_dir,
        task_texts,
    )
    if held_out:
        raw = DatasetDict({"validation": concatenate_datasets([raw["train"], raw["validation"]])})

    def training_texts():
        for batch in itertools.islice(next(iter(raw.values())).iter(batch_size=1000), TOKENIZER_TRAINING_DOCS // 1000):
            yield from batch["text"]

    content = source_fingerprint(args.dataset, task_texts)  # replacing a file at the same path rebuilds both caches
    tokenizer = load_tokenizer(
        str(tokenizer_folder) if tokenizer_folder is not None else args.tokenizer,
        texts=training_texts(),
        corpus_id=f"{args.dataset}:{args.text_field}@{content}",
        cache_dir=cache_dir,
    )
    processed, stats = preprocess(
        raw,
        tokenizer,
        args.max_seq_length,
        packing=args.packing,
        block_cls=args.block_cls,
        document_blocks=args.document_blocks,
        cache_dir=None if args.streaming else cache_dir,
        source=f"{args.dataset}:{args.text_field}",
        num_proc=args.preprocessing_num_workers,
        validation_split_percentage=args.validation_split_percentage,
        content=content,
        **({"held_out": "whole"} if held_out else {}),  # its own cache entry (read whole, in order); others unchanged
    )
    if is_docstrings_spec(args.dataset):  # which packages (and versions) the corpus was read from
        stats = {**stats, "source": docstring_corpus(args.dataset, cache_dir).manifest}
    collator = collator_for(args, tokenizer, seed)
    documents = None if args.streaming else raw
    return PreparedData(tokenizer, processed.get("train"), processed["validation"], collator, stats, documents)


def collator_for(args: DataArguments, tokenizer, seed: int | None):
    """The masking collator `args` asks for (strategy, rate, spans, padding), drawing from `seed`."""
    return build_collator(
        tokenizer,
        masking=args.masking,
        mlm_probability=args.mlm_probability,
        mean_span_length=args.mean_span_length,
        max_span_length=args.max_span_length,
        pad_to_multiple_of=args.pad_to_multiple_of,
        seed=seed,
    )
