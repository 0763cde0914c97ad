"""`DataArguments`: where the text comes from and how it becomes masked blocks (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..common.padding import check_pad_multiple, pad_multiple_field
from ..constants import EMBEDDED_DATASET, MASKING_STRATEGIES
from .mixture import TASK_SOURCE, is_mixture, parse_mixture
from .recall_vocab import masked_example_tokens


@dataclass
class DataArguments:
    """Where the text comes from and how it becomes masked blocks."""

    dataset: str = field(
        default=EMBEDDED_DATASET,
        metadata={
            "help": "`embedded` (offline built-in corpus), `docstrings[:folder]` / `licenses[:folder]` / "
            "`modules[:folder]` (the installed packages' docstrings / license texts / one long document per module "
            "file), a local file/folder, a Hub `name[:config]`, or a mixture of them and "
            f"{TASK_SOURCE}<task> (a fine-tuning task's training texts), each weighted by *<times per epoch>, e.g. "
            f"docstrings,{TASK_SOURCE}embedded*8"
        },
    )
    text_field: str = field(default="text", metadata={"help": "column holding the text (json/jsonl/parquet/Hub)"})
    tokenizer: str = field(
        default="train:wordpiece:8000",
        metadata={"help": "Hub name or local folder, or `train:<wordpiece|bpe>:<vocab_size>`"},
    )
    max_seq_length: int = field(default=128, metadata={"help": "tokens per example (block length when packing)"})
    packing: bool = field(default=True, metadata={"help": "pack documents into full blocks (else one doc per example)"})
    block_cls: bool = field(
        default=True,
        metadata={"help": "packing: start every block with [CLS], as fine-tuning inputs start (false: blocks of the "
                  "[SEP]-separated stream alone, the format before this option)"},
    )  # fmt: skip
    document_blocks: bool = field(
        default=False,
        metadata={"help": "packing: each block holds one document's contiguous text ([CLS] first), a long document "
                  "going on in its next blocks, never two documents in one block; a document's last block is "
                  "shorter (padded per batch). For long inputs: a block is a window of one document"},
    )  # fmt: skip
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
    pad_to_multiple_of: int | None = pad_multiple_field("pad batch length to a multiple of this")
    preprocessing_num_workers: int | None = field(default=None, metadata={"help": "processes for tokenisation"})

    def __post_init__(self):
        if is_mixture(self.dataset):
            parse_mixture(self.dataset)  # a malformed mixture fails here, naming what is wrong
            if self.streaming:
                raise ValueError(f"dataset={self.dataset!r} is a mixture, read whole: leave out --streaming")
        if self.masking not in MASKING_STRATEGIES:
            raise ValueError(f"masking={self.masking!r} is unknown; choose one of {MASKING_STRATEGIES}")
        if self.streaming_validation_documents < 1:
            raise ValueError(f"streaming_validation_documents={self.streaming_validation_documents} must be at least 1")
        if self.max_seq_length < 2:
            raise ValueError(f"max_seq_length={self.max_seq_length} must be at least 2")
        if not 0 < self.mlm_probability < 1:
            raise ValueError(f"mlm_probability={self.mlm_probability} must be in (0, 1)")
        if not 0 < self.validation_split_percentage < 100:
            raise ValueError(f"validation_split_percentage={self.validation_split_percentage} must be in (0, 100)")
        check_pad_multiple(self.pad_to_multiple_of)
        if self.mean_span_length < 1 or self.max_span_length < 1:
            raise ValueError(
                f"mean_span_length={self.mean_span_length} and max_span_length={self.max_span_length} must be >= 1"
            )
        if self.masking == "query_values":
            self.check_recall_examples()
        if self.document_blocks and not self.packing:
            raise ValueError("document_blocks=True cuts documents into blocks: it needs packing=True (without "
                             "packing each document is one example already, truncated to max_seq_length)")  # fmt: skip
        if self.preprocessing_num_workers is not None and self.preprocessing_num_workers < 1:
            raise ValueError(f"preprocessing_num_workers={self.preprocessing_num_workers} must be >= 1 (or unset)")

    def check_recall_examples(self) -> None:
        """`--masking query_values` trains on whole recall examples: packing would cut them at block ends and put
        several in one block (each binding the same keys to other values), and an example longer than
        `--max_seq_length` would lose its last queries."""
        if self.packing:
            raise ValueError("masking=query_values reads whole recall examples: packing would cut them at block ends "
                             "and put several, each binding keys to other values, in one block; pass --packing false")  # fmt: skip
        tasks = [p.task for p in parse_mixture(self.dataset)] if is_mixture(self.dataset) else []
        longest = max([n for task in tasks if task and (n := masked_example_tokens(task))], default=0)
        if longest > self.max_seq_length:
            raise ValueError(f"max_seq_length={self.max_seq_length} cuts the masked recall examples of "
                             f"--dataset {self.dataset} ({longest} tokens each): pass --max_seq_length {longest} "
                             "or more")  # fmt: skip
