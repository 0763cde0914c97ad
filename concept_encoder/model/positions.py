"""Reading past the trained length: grow a model's learned position tables by repeating their trained rows.

A fresh model's table is sized from `--max_seq_length` (`fresh_model_fields`); a saved model reads at most its
`max_position_embeddings` tokens, and a longer input is refused. `extend_position_tables(model, length)` is the
way past that for a model pretrained shorter: row `p` of the grown table is row `p mod L` of the trained one
(Longformer's copy initialisation, Beltagy et al. 2020, section 5, which grew RoBERTa's 512 positions to 4,096).
Every position past `L` starts as a trained position, so neighbouring tokens keep the offsets they were trained
with except across each seam at a multiple of `L`; what the model makes of that without training at the new
length is measured, not assumed (docs/model.md, "Reading past the trained length"). Fine-tuning or continued
pretraining at the new length then trains the copies apart (`--extend_positions copy` in both loops).

Tables grown: every `nn.Embedding` indexed by position (`POSITION_TABLES`: the token embeddings' position table,
the weighted decoder's mixture logits, BERT's position table) and BERT's position/token-type id buffers.
"""

from __future__ import annotations

import torch
from torch import nn

POSITION_TABLES = ("position_embeddings", "mixture_logits")  # module names of the tables indexed by position
POSITION_BUFFERS = ("position_ids", "token_type_ids")  # transformers' BERT embeddings: [1, max_position_embeddings]


def extend_position_tables(model: nn.Module, length: int) -> int:
    """Grow `model`'s position tables (and `config.max_position_embeddings`) to `length` rows by repeating the
    trained rows; returns the trained length. Nothing changes when `length` is not longer. ValueError when the
    model has no position table or its parameters are partitioned (ZeRO-3: extend the saved folder first)."""
    trained = model.config.max_position_embeddings
    if length <= trained:
        return trained
    tables = [(parent, name) for parent in model.modules() for name in POSITION_TABLES
              if isinstance(getattr(parent, name, None), nn.Embedding)]  # fmt: skip
    if not tables:
        raise ValueError(f"{type(model).__name__} has no learned position table to extend")
    for parent, name in tables:
        table = getattr(parent, name)
        if table.weight.numel() == 0 or table.num_embeddings != trained:  # a ZeRO-3 shard holds no rows here
            raise ValueError(
                f"{name} has {table.weight.shape[0]} rows, not the trained {trained}: partitioned weights (ZeRO-3) "
                "cannot be extended in place; extend without ZeRO-3 (a ZeRO-0/1/2 or plain run) first"
            )
        rows = torch.arange(length, device=table.weight.device) % trained
        grown = nn.Embedding(length, table.embedding_dim, device=table.weight.device, dtype=table.weight.dtype)
        grown.weight.data.copy_(table.weight.data[rows])
        grown.weight.requires_grad_(table.weight.requires_grad)
        setattr(parent, name, grown)
    for parent in model.modules():
        for name in POSITION_BUFFERS:
            buffer = getattr(parent, name, None)
            if isinstance(buffer, torch.Tensor) and buffer.dim() == 2 and buffer.shape[1] == trained:
                values = torch.arange(length) if name == "position_ids" else torch.zeros(length, dtype=buffer.dtype)
                parent.register_buffer(name, values.to(buffer.device).expand(1, -1), persistent=False)
    model.config.max_position_embeddings = length
    return trained
