"""The architectures whose FLOPs and attention calls this project models, and their sizes read from a config.

Torch-free, like the rest of `accounting`. Two kinds are modelled:

- the Concept Encoder (`model_type` "concept_encoder"), with formulas of its own (`flops.py`);
- token encoders with plain multi-head self-attention: per layer one N×N attention of the tokens over each other
  (query, key, value and output projections) and a two-matmul FFN. BERT, RoBERTa (whose code XLM-R and CamemBERT
  reuse), DistilBERT and MPNet are all this (MPNet's relative position bias is a table lookup added to the scores,
  no matmul), so they share BERT's count and attention call.

Their configs name the same sizes differently (DistilBERT: `dim`, `n_layers`, `n_heads`, `hidden_dim`);
transformers maps the names on a config object (`attribute_map`) but not in `to_dict()` or config.json, which the
accounting reads, so `token_encoder_sizes` looks under every name. Any other architecture (ELECTRA's embedding
projection, DeBERTa's disentangled attention, Longformer's windows, Funnel's pooling: each a different count) is
not modelled: the accounting raises `UnmodelledArchitecture` and the kernel probe says so, instead of guessing.
"""

from __future__ import annotations

from collections.abc import Mapping

CONCEPT_MODEL_TYPE = "concept_encoder"
TOKEN_ENCODERS = ("bert", "roberta", "xlm-roberta", "camembert", "distilbert", "mpnet")
# Position ids that start after the padding index (`padding_idx + 1 + i`): their tables hold `padding_idx + 1` rows
# no token reads, so roberta-base's 514 rows read 512 tokens. The padding index is the config's `pad_token_id`,
# except MPNet's, fixed at 1 in transformers' MPNetEmbeddings.
POSITIONS_AFTER_PADDING = {"roberta": None, "xlm-roberta": None, "camembert": None, "mpnet": 1}
SIZE_NAMES = {
    "hidden_size": ("hidden_size", "dim"),
    "num_hidden_layers": ("num_hidden_layers", "n_layers"),
    "num_attention_heads": ("num_attention_heads", "n_heads"),
    "intermediate_size": ("intermediate_size", "hidden_dim"),
}


class UnmodelledArchitecture(ValueError):
    """An architecture whose FLOPs or attention calls this project does not model; the message names it."""


def unmodelled(model_type: str | None, what: str) -> str:
    """The plain line for `what` (e.g. "its FLOPs") of an architecture outside the modelled ones."""
    return (
        f"{what} of model_type {model_type!r} are not modelled: this project models the Concept Encoder and token "
        f"encoders with plain self-attention ({', '.join(TOKEN_ENCODERS)})"
    )


def token_encoder_sizes(config: Mapping) -> dict[str, int]:
    """`hidden_size`, `num_hidden_layers`, `num_attention_heads`, `intermediate_size` of a modelled token encoder's
    config (a `to_dict()` or config.json), under whichever name its architecture uses; `UnmodelledArchitecture`
    for another architecture or a config lacking one of them."""
    model_type = config.get("model_type")
    if model_type not in TOKEN_ENCODERS:
        raise UnmodelledArchitecture(unmodelled(model_type, "the sizes"))
    sizes = {}
    for size, names in SIZE_NAMES.items():
        found = next((config[name] for name in names if config.get(name) is not None), None)
        if found is None:
            raise UnmodelledArchitecture(f"this {model_type} config sets none of {', '.join(names)}; pass its whole "
                                         "config.json, as transformers saved it")  # fmt: skip
        sizes[size] = found
    return sizes


def readable_positions(config: Mapping) -> int | None:
    """How many tokens the model's position table can read (a config.json or `to_dict()`): its
    `max_position_embeddings`, less the rows before the first position where position ids start after the padding
    index (`POSITIONS_AFTER_PADDING`); None where the config sets no table size."""
    rows, model_type = config.get("max_position_embeddings"), config.get("model_type")
    if rows is None or model_type not in POSITIONS_AFTER_PADDING:
        return rows
    padding_idx = POSITIONS_AFTER_PADDING[model_type]
    return rows - (config.get("pad_token_id") or 0 if padding_idx is None else padding_idx) - 1
