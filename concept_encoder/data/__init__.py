"""Data pipeline: sources → tokenizer → tokenise/pack (cached) → masking collator, or another corruption of the
input (`objectives`: masked diffusion, TSDAE deletion). `base` holds what every source shares.

`prepare_data(DataArguments(...))` does all of it; `python -m concept_encoder data` prints a
summary of what it built. Nothing here needs the network unless a Hub name is asked for.
Public names load on first use, so `DataArguments` imports without torch or datasets.
"""

from ..common.lazy import lazy_attributes

EXPORTS = {
    "DataArguments": "arguments",
    "PreparedData": "pipeline",
    "prepare_data": "pipeline",
    "collator_for": "pipeline",
    "MLMCollator": "collators",
    "SpanMaskingCollator": "collators",
    "WholeWordMaskingCollator": "collators",
    "build_collator": "collators",
    "preprocess": "processing",
    "tokenize_and_pack": "processing",
    "DataSourceError": "base",
    "embedded_documents": "sources",
    "load_raw_dataset": "sources",
    "check_tokenizer": "tokenizer",
    "load_tokenizer": "tokenizer",
    "train_tokenizer": "tokenizer",
}
__all__ = sorted(EXPORTS)
__getattr__, __dir__ = lazy_attributes(__name__, EXPORTS)
