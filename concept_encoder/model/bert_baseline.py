"""The honest baseline: transformers' `BertForMaskedLM` of a preset's shape, trained by the same loop.

`BertForSparseMaskedLM` is transformers' BERT, unchanged network and weights, with one difference in
`forward`: given labels it runs the MLM head only at the labelled positions and computes the loss
with `vocab_projection.linear_cross_entropy`, exactly as the Concept Encoder's head does, so the
comparison measures the architectures, not two loss implementations (transformers' own forward
builds `[B,N,V]` logits). Its vocabulary projection is BERT's `nn.Linear`, given
`VocabProjection`'s forward (same parameters, same state dict, still tied to the word embeddings).
Saved folders are ordinary `BertForMaskedLM` checkpoints: `AutoModelForMaskedLM` loads them
without this package.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import BertConfig, BertForMaskedLM

from .heads import ConceptMaskedLMOutput, labelled_loss, labelled_slots
from .modeling import padding_mask
from .vocab_projection import VocabProjection


def bert_config(shape: dict, vocab_size: int, **special_ids) -> BertConfig:
    """A `BertConfig` of a preset's `shape` (hidden size, layers, heads, FFN width, positions; dropout
    when given), with the tokenizer's vocabulary and special ids."""
    dropout = shape.get("hidden_dropout_prob", 0.1)
    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=shape["hidden_size"],
        num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["num_attention_heads"],
        intermediate_size=shape["intermediate_size"],
        max_position_embeddings=shape["max_position_embeddings"],
        hidden_dropout_prob=dropout,
        attention_probs_dropout_prob=dropout,
        **special_ids,
    )


class BertForSparseMaskedLM(BertForMaskedLM):
    """`BertForMaskedLM` whose training forward decodes only the labelled positions (see the module doc)."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.cls.predictions.decoder.__class__ = VocabProjection  # adds the loss path; parameters untouched

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        label_weights: torch.Tensor | None = None,
        return_logits: bool = True,
        labelled_positions: torch.Tensor | None = None,
        labelled_rows: torch.Tensor | None = None,
        padded: bool | None = None,
    ) -> ConceptMaskedLMOutput:
        """The Concept Encoder's MLM interface on BERT (`ConceptEncoderForMaskedLM.forward`'s arguments).

        `input_ids`, `attention_mask`, `labels`, `label_weights`: `[B,N]`; `labelled_positions [B,M]` and
        `labelled_rows [L]` (int64, `heads.labelled_slots(labels)`; found here when not given) pick the labelled
        positions by index; `padded`: whether `attention_mask` holds a 0 (True: passed to BERT as a prepared
        `[B,1,1,N]` mask, which transformers does not test for padding, a host sync; None: transformers tests it).
        → with labels, `loss []`, `loss_sum []`, `num_labelled []` and `logits [L,V]` at the L labelled
        positions in row-major order (None when `return_logits=False`); without labels, `logits [B,N,V]`.
        `concepts` is None (BERT has none); `token_states [B,N,H]` are the last hidden states (distillation pools them).
        """
        mask = self.prepared_mask(attention_mask) if padded and attention_mask is not None else attention_mask
        hidden = self.bert(input_ids, attention_mask=mask).last_hidden_state  # [B,N,H]
        head = self.cls.predictions
        if labels is None:
            return ConceptMaskedLMOutput(logits=head.decoder(head.transform(hidden)), token_states=hidden)
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels shape {tuple(labels.shape)} must equal input_ids shape {tuple(input_ids.shape)}")
        positions, rows = labelled_slots(labels) if labelled_positions is None else (labelled_positions, labelled_rows)
        batch, seq_len = labels.shape
        offsets = torch.arange(batch, device=labels.device)[:, None] * seq_len  # [B,1]
        flat = (positions + offsets).flatten().index_select(0, rows)  # [L] into the B·N positions, row-major
        targets = labels.flatten().index_select(0, flat)  # [L]
        states = head.transform(hidden.flatten(0, 1).index_select(0, flat))  # [L,H]
        weights = None if label_weights is None else label_weights.flatten().index_select(0, flat)  # [L]
        logits, loss_sum = labelled_loss(head.decoder, states, targets, weights, return_logits)
        num_labelled = torch.full((), rows.shape[0], dtype=torch.long, device=labels.device)
        return ConceptMaskedLMOutput(
            loss=loss_sum / num_labelled.clamp(min=1),
            loss_sum=loss_sum,
            logits=logits,
            num_labelled=num_labelled,
            token_states=hidden,
        )

    def prepared_mask(self, attention_mask: torch.Tensor) -> torch.Tensor:
        """A padded `attention_mask [B,N]` → the `[B,1,1,N]` mask transformers passes to BERT's attention as given:
        bool (True = attend) for SDPA, additive (0 or the dtype's minimum) for eager attention; for another
        attention kernel the `[B,N]` mask itself (transformers then builds its own). Built here because
        transformers tests a `[B,N]` mask for padding before it builds one (`padding_mask.all()`), a host sync;
        a row with no real token attends to all positions, as in the Concept Encoder (`modeling.padding_mask`)."""
        keep = padding_mask(attention_mask, padded=True)[:, None, None, :]  # [B,1,1,N]
        implementation = self.config._attn_implementation
        if implementation == "sdpa":
            return keep
        if implementation == "eager":
            dtype = self.bert.embeddings.word_embeddings.weight.dtype
            return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, torch.finfo(dtype).min)
        return attention_mask

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`BertForMaskedLM.save_pretrained`, with `architectures` naming transformers' class (nothing of ours is needed to load it)."""
        super().save_pretrained(save_directory, *args, **kwargs)
        path = Path(save_directory) / "config.json"
        if path.exists():
            config = json.loads(path.read_text())
            config["architectures"] = [BertForMaskedLM.__name__]
            path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
