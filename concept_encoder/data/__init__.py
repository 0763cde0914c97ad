"""Data pipeline: sources → tokenizer → tokenise/pack (cached) → masking collator.

`prepare_data(DataArguments(...))` does all of it; `python -m concept_encoder.data` prints a
summary of what it built. Nothing here needs the network unless a Hub name is asked for.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from datasets import IterableDataset

from .collators import (
    MASKING_STRATEGIES,
    MLMCollator,
    SpanMaskingCollator,
    WholeWordMaskingCollator,
    build_collator,
)
from .preprocess import preprocess, tokenize_and_pack
from .sources import EMBEDDED, DataSourceError, embedded_documents, load_raw_dataset
from .tokenizer import check_tokenizer, load_tokenizer, train_tokenizer

TOKENIZER_TRAINING_DOCS = 200_000  # enough for a good vocabulary; bounds the cost on huge corpora


@dataclass
class DataArguments:
    """Where the text comes from and how it becomes masked blocks."""

    dataset: str = field(
        default=EMBEDDED,
        metadata={"help": "`embedded` (offline built-in corpus), a local file/folder, or a Hub `name[:config]`"},
    )
    text_field: str = field(default="text", metadata={"help": "column holding the text (json/jsonl/parquet/Hub)"})
    tokenizer: str = field(
        default="train:wordpiece:8000",
        metadata={"help": "Hub name or local folder, or `train:<wordpiece|bpe>:<vocab_size>`"},
    )
    max_seq_length: int = field(default=128, metadata={"help": "tokens per example (block length when packing)"})
    packing: bool = field(default=True, metadata={"help": "pack documents into full blocks (else one doc per example)"})
    validation_split_percentage: float = field(
        default=5.0, metadata={"help": "held-out percent of documents when the source has no validation split"}
    )
    streaming: bool = field(
        default=False,
        metadata={
            "help": "stream the source (Hub or local files) instead of loading it whole: tokenised lazily, not cached"
        },
    )
    streaming_validation_documents: int = field(
        default=1000,
        metadata={"help": "streaming a source without a validation split: hold out its first N documents"},
    )
    masking: str = field(default="mlm", metadata={"help": f"masking strategy: one of {MASKING_STRATEGIES}"})
    mlm_probability: float = field(default=0.15, metadata={"help": "fraction of tokens to predict"})
    mean_span_length: float = field(default=3.0, metadata={"help": "span masking: mean of the geometric lengths"})
    max_span_length: int = field(default=10, metadata={"help": "span masking: longest span"})
    pad_to_multiple_of: int | None = field(default=None, metadata={"help": "pad batch length to a multiple of this"})
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "processes for tokenisation"})

    def __post_init__(self):
        if self.masking not in MASKING_STRATEGIES:
            raise ValueError(f"masking={self.masking!r} is unknown; choose one of {MASKING_STRATEGIES}")
        if self.streaming_validation_documents < 1:
            raise ValueError(f"streaming_validation_documents={self.streaming_validation_documents} must be at least 1")
        if self.max_seq_length < 2:
            raise ValueError(f"max_seq_length={self.max_seq_length} must be at least 2")
        if not 0 < self.mlm_probability < 1:
            raise ValueError(f"mlm_probability={self.mlm_probability} must be in (0, 1)")


@dataclass
class PreparedData:
    tokenizer: Any
    train: Any
    validation: Any
    collator: Any
    stats: dict

    @property
    def streaming(self) -> bool:
        """True when the splits are `datasets.IterableDataset`s (no length, no indexing)."""
        return isinstance(self.train, IterableDataset)


def prepare_data(args: DataArguments, cache_dir: str | Path = "Cache", seed: int | None = None) -> PreparedData:
    """Load the source, load/train the tokenizer, tokenise + pack (cached), build the collator."""
    raw = load_raw_dataset(
        args.dataset,
        args.text_field,
        args.validation_split_percentage,
        args.streaming,
        args.streaming_validation_documents,
    )

    def training_texts():
        for batch in itertools.islice(raw["train"].iter(batch_size=1000), TOKENIZER_TRAINING_DOCS // 1000):
            yield from batch["text"]

    tokenizer = load_tokenizer(
        args.tokenizer, texts=training_texts(), corpus_id=f"{args.dataset}:{args.text_field}", cache_dir=cache_dir
    )
    processed, stats = preprocess(
        raw,
        tokenizer,
        args.max_seq_length,
        packing=args.packing,
        cache_dir=None if args.streaming else cache_dir,
        source=f"{args.dataset}:{args.text_field}",
        num_proc=args.preprocessing_num_workers,
        validation_split_percentage=args.validation_split_percentage,
    )
    collator = collator_for(args, tokenizer, seed)
    return PreparedData(tokenizer, processed["train"], processed["validation"], collator, stats)


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


__all__ = [
    "EMBEDDED",
    "MASKING_STRATEGIES",
    "DataArguments",
    "DataSourceError",
    "MLMCollator",
    "PreparedData",
    "SpanMaskingCollator",
    "WholeWordMaskingCollator",
    "build_collator",
    "collator_for",
    "check_tokenizer",
    "embedded_documents",
    "load_raw_dataset",
    "load_tokenizer",
    "prepare_data",
    "preprocess",
    "tokenize_and_pack",
    "train_tokenizer",
]
