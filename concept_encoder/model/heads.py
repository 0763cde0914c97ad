"""Task heads on top of `ConceptEncoder`: masked-language modelling and sequence classification.

MLM decoding, with shapes (sparse path, used whenever `labels` are given)::

    concepts [B,C,H]
    labelled positions gathered per sample ──▶ ids, positions [B,M]   (M = max labelled per sample)
    decoder(concepts, ids, positions) ──────▶ hidden [B,M,H]   (`mixed`: queries gathered from the mixed tokens)
    keep the real labelled slots (rows [L]) ▶ hidden [L,H]            (L = labelled positions in the batch)
    LM head ────────────────────────────────▶ logits [L,V] → cross-entropy

A `[B,N,V]` tensor is never built when labels are given: at 15% masking and a 30k
vocabulary that tensor dominates the memory of a training step.

The positions and rows (`labelled_slots`) are sizes that depend on the data: found on an accelerator they
would cost a host sync each (a `.item()`, a `nonzero`). The training loops find them on the CPU batch
before it moves (`data.objectives.prepare_batch`) and pass them in (`labelled_positions`, `labelled_rows`);
the model gathers with them as indices, so a training micro-batch never waits for the device. A caller
that passes labels alone gets them found here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel, AutoModelForMaskedLM, AutoModelForSequenceClassification
from transformers.modeling_outputs import SequenceClassifierOutput
from transformers.utils import ModelOutput

from .attention import ReadingLayer
from .config import ConceptEncoderConfig
from .constants import IGNORE_INDEX, TOKEN_QUERY_DECODERS
from .modeling import ConceptEncoder, ConceptEncoderPreTrainedModel, TokenEmbeddings, check_sequence_length
from .vocab_projection import VocabProjection


@dataclass
class ConceptMaskedLMOutput(ModelOutput):
    """Output of `ConceptEncoderForMaskedLM`.

    Attributes:
        loss: `[]` cross-entropy over the labelled positions (when `labels` are given): `loss_sum / num_labelled`.
        loss_sum: `[]` summed (with `label_weights`, weighted) cross-entropy, to normalise across micro-batches.
        logits: `[L,V]` at the L labelled positions, in row-major (sample, position) order, when
            `labels` are given; `[B,N,V]` for every position otherwise.
        concepts: `[B,C,H]` final concept states (for concept losses and health metrics).
        num_labelled: `[]` number L of labelled positions (to normalise losses across micro-batches).
        token_states: `[B,N,H]` the BERT baseline's last hidden states (a Concept Encoder has concepts instead).
    """

    loss: torch.FloatTensor | None = None
    loss_sum: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    concepts: torch.FloatTensor | None = None
    num_labelled: torch.LongTensor | None = None
    token_states: torch.FloatTensor | None = None


class CrossAttentionDecoder(nn.Module):
    """`perceiver` (queries = token + position embedding), `mixed` (queries = the tokens after the local mixer,
    `mixed_tokens`) or `posonly` (queries = position embedding)."""

    def __init__(self, config: ConceptEncoderConfig, token_queries: bool):
        super().__init__()
        self.token_queries = token_queries
        self.layers = nn.ModuleList(ReadingLayer(config) for _ in range(config.num_decoder_layers))
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(
        self,
        concepts: torch.Tensor,
        input_ids: torch.Tensor | None,
        position_ids: torch.Tensor,
        embeddings: TokenEmbeddings,
        mixed_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`concepts [B,C,H]`, `input_ids [B,M]` (None for `posonly`), `position_ids [B,M]`, `mixed_tokens [B,N,H]`
        (the `mixed` decoder's, else None) → `[B,M,H]`.

        `embeddings` is the encoder's (shared) embedding module, passed rather than owned. `position_ids` are the
        positions 0..N-1 of the input the queries sit at (the labelled ones in training), so `mixed` gathers them.
        """
        if mixed_tokens is not None:
            index = position_ids.unsqueeze(-1).expand(-1, -1, mixed_tokens.shape[-1])  # [B,M,H]
            queries = mixed_tokens.gather(1, index)  # [B,M,H]
        elif self.token_queries:
            queries = embeddings(input_ids, position_ids)
        else:
            queries = embeddings.position_embeddings(position_ids)
        for layer in self.layers:
            queries = layer(queries, concepts)
        return self.norm(queries)


class WeightedDecoder(nn.Module):
    """Each position is a learned softmax mixture of the concepts: `softmax(W[pos]) @ concepts`."""

    def __init__(self, config: ConceptEncoderConfig):
        super().__init__()
        # An embedding table of mixture logits: row p holds position p's logits over the C concepts.
        self.mixture_logits = nn.Embedding(config.max_position_embeddings, config.concept_num)

    def forward(
        self,
        concepts: torch.Tensor,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        embeddings: TokenEmbeddings,
        mixed_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`concepts [B,C,H]`, `position_ids [B,M]` → `[B,M,H]` (`input_ids`, `embeddings`, `mixed_tokens`
        unused)."""
        weights = self.mixture_logits(position_ids).softmax(dim=-1)  # [B,M,C]
        return torch.bmm(weights.to(concepts.dtype), concepts)


def build_decoder(config: ConceptEncoderConfig) -> nn.Module:
    if config.decoder_type == "weighted":
        return WeightedDecoder(config)
    return CrossAttentionDecoder(config, token_queries=config.decoder_type in TOKEN_QUERY_DECODERS)


class MaskedLMHead(nn.Module):
    """BERT-style transform then vocabulary projection: `[...,H] → dense → GELU → LN → [...,V]`."""

    def __init__(self, config: ConceptEncoderConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.decoder = VocabProjection(config.hidden_size, config.vocab_size)

    def forward(
        self, hidden: torch.Tensor, targets: torch.Tensor | None = None, row_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`hidden [...,H]` → logits `[...,V]`; with `targets [L]` (`hidden [L,H]`, optional `row_weights [L]`)
        → (weighted) summed cross-entropy `[]`, computed without keeping the logits (`vocab_projection`)."""
        return self.decoder(self.norm(F.gelu(self.dense(hidden))), targets, row_weights)


def labelled_slots(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`labels [B,N]` → (`positions [B,M]`, `rows [L]`), both int64 on `labels`' device.

    `positions`: each sample's labelled positions packed to the front, in order (a stable sort). M is the
    largest labelled count of any sample, at least 1 (so attention over M query slots is never empty); slots
    past a sample's count point at unlabelled positions. `rows`: the real labelled slots among the `B·M`
    (row-major, `b·M + m`), L in all: `hidden[B,M,H].flatten(0, 1).index_select(0, rows)` is the labelled
    rows in (sample, position) order, as `hidden[labels != IGNORE_INDEX]` would give them, without a boolean
    index. On an accelerator this reads M and L on the host (two syncs): the training loops call it on the
    CPU batch (`data.objectives.prepare_batch`). Under torch.compile M is traced as an unbacked size ≥ 1.
    """
    if labels.numel() == 0:
        return labels.new_zeros(labels.shape), labels.new_zeros(0)
    labelled = labels.ne(IGNORE_INDEX)  # [B,N]
    m = labelled.sum(dim=1).max().clamp(min=1).item()
    torch._check(m >= 1)
    torch._check(m <= labels.shape[1])
    positions = torch.sort(labelled.to(torch.uint8), dim=1, descending=True, stable=True).indices[:, :m]  # [B,M]
    rows = labelled.gather(1, positions).flatten().nonzero().squeeze(1)  # [L]
    return positions, rows


def labelled_rows_of(values: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`values [B,N]` (labels, weights) at the labelled slots: `[L]`, in the order of `labelled_slots`."""
    return values.gather(1, positions).flatten().index_select(0, rows)


def labelled_loss(
    project: nn.Module,
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weights: torch.Tensor | None,
    return_logits: bool,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(logits `[L,V]` or None, (weighted) summed cross-entropy `[]`) at the L labelled rows.

    `project` maps `hidden [L,H]` to logits `[L,V]`, or with `(hidden, targets [L], weights [L])` to the
    summed loss without keeping the logits (`MaskedLMHead`, `VocabProjection`): used unless `return_logits`.
    """
    if not return_logits:
        return None, project(hidden, targets, weights)
    logits = project(hidden)  # [L,V]
    ce = F.cross_entropy(logits.float(), targets, reduction="none")  # [L]
    return logits, (ce if weights is None else ce * weights).sum()


class ConceptEncoderForMaskedLM(ConceptEncoderPreTrainedModel):
    """Concept Encoder with an MLM decoder (`config.decoder_type`) and sparse decoding in training."""

    _tied_weights_keys = {"lm_head.decoder.weight": "encoder.embeddings.word_embeddings.weight"}

    def __init__(self, config: ConceptEncoderConfig):
        super().__init__(config)
        # The decoder reads the concepts (and, `mixed`, the first layer's mixed tokens as its queries)
        self.encoder = ConceptEncoder(config, returns_tokens=False, returns_mixed=config.decoder_type == "mixed")
        self.mlm_decoder = build_decoder(config)
        self.lm_head = MaskedLMHead(config)
        self.post_init()

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head.decoder

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head.decoder = value

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
        """Masked-language-model forward.

        Args:
            input_ids: `[B,N]` token ids (masked positions hold `[MASK]` or a replacement).
            attention_mask: `[B,N]`, 1 for real tokens, 0 for padding (optional).
            labels: `[B,N']` original ids at positions to predict, `-100` elsewhere (optional).
                Usually N' = N. A decoder whose queries are positions only (`posonly`, `weighted`)
                also takes N' != N: the encoder then saw a shortened sequence (e.g. TSDAE's deletions)
                and the decoder predicts positions 0..N'-1 of the original.
            label_weights: `[B,N']` weight of each labelled position's cross-entropy (optional;
                e.g. masked diffusion's 1/t). The loss is then `Σ w·CE / num_labelled`.
            return_logits: with labels, False skips the `[L,V]` logits: the loss is then computed
                by `vocab_projection.linear_cross_entropy` (same value and gradients, less memory
                and time; what the training loop uses). Ignored without labels.
            labelled_positions: `[B,M]` int64, `labelled_slots(labels)[0]` (optional: found from `labels`
                when not given, a host sync on an accelerator; the training loops pass it from the CPU).
            labelled_rows: `[L]` int64, `labelled_slots(labels)[1]`, given with `labelled_positions`.
            padded: whether `attention_mask` holds a 0 (`modeling.padding_mask`; None: tested here).

        Returns:
            `ConceptMaskedLMOutput`: with labels, `loss []`, `loss_sum []`, `num_labelled []` and sparse
            `logits [L,V]` at the L labelled positions (None when `return_logits=False`); without labels,
            `logits [B,N,V]` at every position. Always `concepts [B,C,H]`.
        """
        encoded = self.encoder(input_ids, attention_mask, padded=padded)
        concepts, mixed = encoded.last_hidden_state, encoded.mixed_tokens  # [B,C,H], [B,N,H] (`mixed`) or None
        # `perceiver`'s queries read the unmixed embeddings, never the `local_mixer`'s output: a masked position's
        # query holds [MASK] and its position only, so it cannot copy a neighbour's identity past the concepts.
        # `mixed`'s read the mixed tokens: its neighbours, as BERT's do (docs/model.md, "Local token mixer").
        embeddings = self.encoder.embeddings
        if labels is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            hidden = self.mlm_decoder(concepts, input_ids, position_ids, embeddings, mixed)  # [B,N,H]
            return ConceptMaskedLMOutput(logits=self.lm_head(hidden), concepts=concepts)

        check_sequence_length(self.config, labels.shape[1])
        if labels.shape != input_ids.shape and (
            labels.shape[0] != input_ids.shape[0] or self.config.decoder_type in TOKEN_QUERY_DECODERS
        ):
            raise ValueError(
                f"labels shape {tuple(labels.shape)} must equal input_ids shape {tuple(input_ids.shape)}; only a "
                "decoder that queries positions alone (decoder_type posonly or weighted) can predict a sequence "
                "of another length than the encoder's input"
            )
        positions, rows = labelled_slots(labels) if labelled_positions is None else (labelled_positions, labelled_rows)
        torch._check(positions.shape[1] >= 1)  # for torch.compile: M is unbacked (`objectives.model_inputs`)
        ids = input_ids.gather(1, positions) if self.config.decoder_type == "perceiver" else None  # token queries
        hidden = self.mlm_decoder(concepts, ids, positions, embeddings, mixed)  # [B,M,H]
        targets = labelled_rows_of(labels, positions, rows)  # [L]
        weights = None if label_weights is None else labelled_rows_of(label_weights, positions, rows)  # [L]
        states = hidden.flatten(0, 1).index_select(0, rows)  # [L,H]
        logits, loss_sum = labelled_loss(self.lm_head, states, targets, weights, return_logits)
        num_labelled = torch.full((), rows.shape[0], dtype=torch.long, device=labels.device)  # no host copy
        # Sum / count (not `mean`) so a batch with nothing labelled gives 0, not NaN, and still
        # touches every parameter (DDP/ZeRO need a gradient for each).
        loss = loss_sum / num_labelled.clamp(min=1)
        return ConceptMaskedLMOutput(
            loss=loss, loss_sum=loss_sum, logits=logits, concepts=concepts, num_labelled=num_labelled
        )


class ConceptPooling(nn.Module):
    """The encoder's output → one vector `[B,H]`: learned softmax weights over the concepts (`weighted`), their
    mean (`mean`), or the `[CLS]` token's refined state (`cls`, which `token_refinement` makes)."""

    def __init__(self, config: ConceptEncoderConfig):
        super().__init__()
        self.cls = config.classifier_pooling == "cls"
        self.score = nn.Linear(config.hidden_size, 1) if config.classifier_pooling == "weighted" else None

    def forward(self, concepts: torch.Tensor, token_states: torch.Tensor | None = None) -> torch.Tensor:
        """`concepts [B,C,H]`, `token_states [B,N,H]` (refined tokens; `cls` pooling only) → `[B,H]`."""
        if self.cls:
            return token_states[:, 0]  # position 0 holds [CLS]
        if self.score is None:
            return concepts.mean(dim=1)
        weights = self.score(concepts).softmax(dim=1)  # [B,C,1]
        return (weights * concepts).sum(dim=1)


class ConceptEncoderForSequenceClassification(ConceptEncoderPreTrainedModel):
    """Concept pooling → dense/tanh → classifier; regression, single- or multi-label like HF heads."""

    def __init__(self, config: ConceptEncoderConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.encoder = ConceptEncoder(config)
        self.pooling = ConceptPooling(config)
        dropout = config.classifier_dropout if config.classifier_dropout is not None else config.hidden_dropout_prob
        self.dropout = nn.Dropout(dropout)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        padded: bool | None = None,
    ) -> SequenceClassifierOutput:
        """Classify or regress whole sequences.

        Args:
            input_ids: `[B,N]` token ids.
            attention_mask: `[B,N]`, 1 for real tokens, 0 for padding (optional).
            labels: `[B]` class ids (single-label), `[B]`/`[B,1]` floats (regression, `num_labels == 1`),
                or `[B,num_labels]` multi-hot floats (multi-label) (optional).
            padded: whether `attention_mask` holds a 0 (`modeling.padding_mask`; None: tested here, a host
                sync on an accelerator; fine-tuning's loaders say it from the CPU batch).

        Returns:
            `SequenceClassifierOutput` with `logits [B,num_labels]` and `loss []` when labels are given.
        """
        encoded = self.encoder(input_ids, attention_mask, padded=padded)  # concepts [B,C,H], tokens [B,N,H] or None
        features = self.pooling(encoded.last_hidden_state, encoded.token_states)  # [B,H]
        pooled = self.dropout(torch.tanh(self.dense(self.dropout(features))))  # [B,H]
        logits = self.classifier(pooled)  # [B,num_labels]
        loss = None if labels is None else self._loss(logits, labels)
        return SequenceClassifierOutput(loss=loss, logits=logits)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        problem_type = self.config.problem_type
        if problem_type is None:
            if self.num_labels == 1:
                problem_type = "regression"
            elif labels.dtype in (torch.long, torch.int):
                problem_type = "single_label_classification"
            else:
                problem_type = "multi_label_classification"
            self.config.problem_type = problem_type
        if problem_type == "regression":
            return F.mse_loss(logits.squeeze(-1).float(), labels.view(-1).float())
        if problem_type == "single_label_classification":
            return F.cross_entropy(logits.float(), labels.view(-1))
        return F.binary_cross_entropy_with_logits(logits.float(), labels.float())


# Registered with transformers here, and marked so save_pretrained copies the code beside the weights.
AutoModel.register(ConceptEncoderConfig, ConceptEncoder, exist_ok=True)
AutoModelForMaskedLM.register(ConceptEncoderConfig, ConceptEncoderForMaskedLM, exist_ok=True)
AutoModelForSequenceClassification.register(
    ConceptEncoderConfig, ConceptEncoderForSequenceClassification, exist_ok=True
)
ConceptEncoder.register_for_auto_class("AutoModel")
ConceptEncoderForMaskedLM.register_for_auto_class("AutoModelForMaskedLM")
ConceptEncoderForSequenceClassification.register_for_auto_class("AutoModelForSequenceClassification")
