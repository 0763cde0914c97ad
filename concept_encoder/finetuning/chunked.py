"""Reading a long input in chunks: the long-document baseline for a token encoder whose window is shorter.

`read_in_chunks(model, length)` makes a Hugging Face sequence classifier (BERT and its kin: `model.base_model`
returns `last_hidden_state` and has a `pooler`) read an input of N tokens as ceil(N / length) chunks of `length`
tokens, each encoded alone (its own positions 0..length-1, attention only inside the chunk):

    input_ids [B,N] ──pad, reshape──▶ [B·K, length] ──encoder──▶ states [B·K, length, H]
    each chunk: mean of its real tokens' states ──▶ [B, K, H] ──mean over chunks with a real token──▶ [B, H]
    pooler (dense + tanh, as the model's own) ──▶ pooler_output [B, H] ──▶ the model's dropout + classifier

`last_hidden_state` comes back as `[B,N,H]`, position for position, so the linear probes' masked mean reads it
as it reads a whole-input encoder's. Mean-pooled chunk features are the usual "BERT over chunks" baseline of
long-document classification; a chunk after the first starts mid-text, without `[CLS]`, which is why a chunk's
feature is the mean of its tokens rather than its first token's state.

With `length=None` the whole input is one chunk: the mean of its real tokens' states replaces `[CLS]` as the
pooler's input (`--pooling mean` for a token encoder), so BERT has the mean pooling a Concept Encoder has.

Both feed the pooler, so both need a classifier that has one (BERT's). RoBERTa's, DistilBERT's and MPNet's heads
read the first token's state themselves: the pooled vector would be dropped and the classifier would go on reading
`[CLS]` (of the first chunk only), so `pooler_problem` refuses them in one line instead.

Why hand-written: transformers has no chunked reading for encoders (its strided `overflowing_tokens` splits an
input into separate examples, which the classifier would then score one by one).
"""

from __future__ import annotations

import copy
import inspect

import torch
import torch.nn.functional as F
from transformers.modeling_outputs import BaseModelOutputWithPooling

from .probe import CONCEPT_MODEL_TYPE, masked_mean


def chunk_problem(config, length: int | None, model=None) -> str | None:
    """Why a model of `config` (`model`: its sequence classifier, when built) cannot read in chunks of `length`
    tokens (None: mean-pooled whole), else None."""
    if config.model_type == CONCEPT_MODEL_TYPE:
        return (
            "a Concept Encoder reads the whole input (its cost is linear in it); --chunk_length is for token encoders"
        )
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and length is not None and length > positions:
        return f"--chunk_length {length} is longer than the model's {positions} positions; give at most {positions}"
    return pooler_problem(config, model)


def pooler_problem(config, model=None) -> str | None:
    """Why the chunked or mean reading cannot feed the sequence classifier of a token encoder of `config` (`model`:
    that classifier, else built on the meta device, without memory, to look): it has no pooler (the module doc);
    None when it has one."""
    if model is None:
        from transformers import AutoModelForSequenceClassification

        with torch.device("meta"):
            model = AutoModelForSequenceClassification.from_config(copy.deepcopy(config))
    if getattr(model.base_model, "pooler", None) is not None:
        return None
    return (
        f"{config.model_type}'s sequence classifier reads its first token's state in its own head, not through a "
        "pooler, so neither the mean token state (--pooling mean) nor chunks (--chunk_length) can feed it (it would "
        "go on reading [CLS] alone); use --pooling auto without --chunk_length, or a model with a pooler (BERT)"
    )


def apply_reading(model, chunk_length: int | None, pooling: str) -> str | None:
    """The reading mode the fine-tuning arguments ask of `model`, applied (again after every load: it is not part
    of the weights): chunks of `chunk_length`, or a token encoder's `mean` pooling; a note for the log, else None."""
    if chunk_length:
        read_in_chunks(model, chunk_length)
        return f"read in chunks of {chunk_length} tokens, their mean token states averaged"
    if pooling == "mean" and model.config.model_type != CONCEPT_MODEL_TYPE:
        read_in_chunks(model, None)
        return "the mean of its real tokens' states pooled instead of [CLS]"
    return None


def read_in_chunks(model, length: int | None) -> None:
    """Make `model` (an `AutoModelForSequenceClassification`) read its inputs in chunks of `length` tokens (None:
    the whole input as one chunk), as the module docstring draws; its weights and saved form are unchanged (apply
    again after loading)."""
    if problem := chunk_problem(model.config, length, model):
        raise ValueError(problem)
    base = model.base_model
    encode = base.forward
    pooler = getattr(base, "pooler", None)

    def forward(input_ids, attention_mask=None, token_type_ids=None, **kwargs) -> BaseModelOutputWithPooling:
        """`input_ids [B,N]`, `attention_mask [B,N]` → `last_hidden_state [B,N,H]`, `pooler_output [B,H]`."""
        batch, n = input_ids.shape
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        size = length or n
        pad = -n % size
        chunks = -(-n // size)

        def split(x):  # [B,N] → [B·K, size], padded with zeros (masked out)
            return F.pad(x, (0, pad)).reshape(batch * chunks, size)

        ids, mask = split(input_ids), split(attention_mask)
        extra = {"token_type_ids": split(token_type_ids)} if token_type_ids is not None else {}
        kwargs = {k: v for k, v in kwargs.items() if k not in ("position_ids", "inputs_embeds")}  # per chunk: own
        states = encode(ids, attention_mask=mask, **extra, **kwargs).last_hidden_state  # [B·K, length, H]
        features = masked_mean(states, mask).reshape(batch, chunks, -1)  # [B,K,H]
        real = (mask.reshape(batch, chunks, size).sum(-1) > 0).to(features.dtype).unsqueeze(-1)  # [B,K,1]
        pooled = (features * real).sum(1) / real.sum(1).clamp(min=1.0)  # [B,H]
        if pooler is not None:
            pooled = pooler.activation(pooler.dense(pooled))
        hidden = states.reshape(batch, chunks * size, -1)[:, :n]  # [B,N,H]
        return BaseModelOutputWithPooling(last_hidden_state=hidden, pooler_output=pooled)

    forward.__signature__ = inspect.signature(forward)  # what the probes pass: input_ids, attention_mask, ...
    base.forward = forward
