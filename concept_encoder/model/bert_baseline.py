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

from .constants import IGNORE_INDEX
from .heads import ConceptMaskedLMOutput, labelled_loss
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
    ) -> ConceptMaskedLMOutput:
        """The Concept Encoder's MLM interface on BERT.

        `input_ids`, `attention_mask`, `labels`, `label_weights`: `[B,N]` →
        with labels, `loss []`, `loss_sum []`, `num_labelled []` and `logits [L,V]` at the L labelled
        positions in row-major order (None when `return_logits=False`); without labels, `logits [B,N,V]`.
        `concepts` is None (BERT has none); `token_states [B,N,H]` are the last hidden states (distillation pools them).
        """
        hidden = self.bert(input_ids, attention_mask=attention_mask).last_hidden_state  # [B,N,H]
        head = self.cls.predictions
        if labels is None:
            return ConceptMaskedLMOutput(logits=head.decoder(head.transform(hidden)), token_states=hidden)
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels shape {tuple(labels.shape)} must equal input_ids shape {tuple(input_ids.shape)}")
        keep = labels.ne(IGNORE_INDEX)  # [B,N]
        targets = labels[keep]  # [L]
        states = head.transform(hidden[keep])  # [L,H]
        weights = None if label_weights is None else label_weights[keep]  # [L]
        logits, loss_sum = labelled_loss(head.decoder, states, targets, weights, return_logits)
        num_labelled = keep.sum()
        return ConceptMaskedLMOutput(
            loss=loss_sum / num_labelled.clamp(min=1),
            loss_sum=loss_sum,
            logits=logits,
            num_labelled=num_labelled,
            token_states=hidden,
        )

    def save_pretrained(self, save_directory, *args, **kwargs):
        """`BertForMaskedLM.save_pretrained`, with `architectures` naming transformers' class (nothing of ours is needed to load it)."""
        super().save_pretrained(save_directory, *args, **kwargs)
        path = Path(save_directory) / "config.json"
        if path.exists():
            config = json.loads(path.read_text())
            config["architectures"] = [BertForMaskedLM.__name__]
            path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
