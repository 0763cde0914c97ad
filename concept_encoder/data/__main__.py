"""`python -m concept_encoder data [--dataset ...] [--tokenizer ...] [--max_seq_length ...] [--masking ...]`

Builds (or loads from the cache) the processed dataset and prints a summary: documents,
tokens, blocks and split sizes, the cache path, and two decoded masked examples.
"""

from __future__ import annotations

import sys

import torch
from transformers import HfArgumentParser

from ..common.cli_types import at_least
from ..model.constants import IGNORE_INDEX
from . import DataArguments, DataSourceError, prepare_data


def show_masked(tokenizer, batch: dict, row: int, max_tokens: int = 60) -> str:
    """Decode one masked example; predicted positions shown as `[MASK→original]`-style pieces."""
    ids, labels = batch["input_ids"][row][:max_tokens], batch["labels"][row][:max_tokens]
    pieces = []
    for token, label in zip(ids.tolist(), labels.tolist(), strict=True):
        shown = tokenizer.convert_ids_to_tokens(token)
        pieces.append(f"{shown}→{tokenizer.convert_ids_to_tokens(label)}" if label != IGNORE_INDEX else shown)
    return " ".join(pieces)


def main(argv: list[str] | None = None) -> int:
    parser = HfArgumentParser(DataArguments, prog="python -m concept_encoder data", description=__doc__)
    parser.add_argument("--cache_dir", default="Cache", help="where tokenizers and datasets are cached")
    parser.add_argument("--seed", type=at_least(0), default=0, help="masking seed for the shown examples")
    try:
        data_args, extra = parser.parse_args_into_dataclasses(args=argv)
    except ValueError as error:  # a rule of DataArguments (__post_init__): one usage line, as argparse's own
        parser.error(str(error))
    try:
        data = prepare_data(data_args, cache_dir=extra.cache_dir, seed=extra.seed)
    except DataSourceError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    print(f"dataset      {data_args.dataset}  (text field {data_args.text_field!r})")
    print(f"tokenizer    {data_args.tokenizer}  ({len(data.tokenizer):,} tokens)")
    blocks = "  document_blocks" if data_args.document_blocks else ""
    print(f"packing      {data_args.packing}{blocks}  max_seq_length={data_args.max_seq_length}  "
          f"masking={data_args.masking}")  # fmt: skip
    for split in ("train", "validation"):
        s = data.stats.get(split)
        if s:
            dropped = (
                f", ≤{s['dropped_tokens_at_most']:,} tokens cut as remainders" if "dropped_tokens_at_most" in s else ""
            )
            print(
                f"{split:<12} {s['documents']:,} documents → {s['tokens']:,} tokens → {s['examples']:,} examples{dropped}"
            )
            if lengths := s.get("document_tokens"):
                print(f"{'':<12} tokens per document: median {lengths['median']:,}, 90th percentile "
                      f"{lengths['p90']:,}, longest {lengths['max']:,}")  # fmt: skip
    print(f"cache        {data.stats.get('cache_path')}")
    examples = list(data.train.take(2)) if hasattr(data.train, "take") else [data.train[0], data.train[1]]
    torch.manual_seed(extra.seed)
    batch = data.collator(examples)
    rate = (batch["labels"] != IGNORE_INDEX).float().mean().item()
    print(f"\n2 masked examples (first 60 tokens, `shown→target` where predicted; batch mask rate {rate:.1%}):")
    for row in range(len(examples)):
        print(f"[{row}] {show_masked(data.tokenizer, batch, row)}\n")
    return 0


if __name__ == "__main__":
    from ..common.entry import run_tool

    sys.exit(run_tool(main, "python -m concept_encoder data"))
