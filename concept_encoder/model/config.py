"""`ConceptEncoderConfig` and the named size presets.

The config follows transformers 5 conventions: fields are dataclass fields on a
`PreTrainedConfig` subclass, extra keyword arguments (e.g. `num_labels`) go to the
base class, and validation runs in `__post_init__` so a bad config fails on
construction, before any weight is allocated.
"""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig, PretrainedConfig

from .constants import (
    CLASSIFIER_POOLINGS,
    DECODER_TYPES,
    local_mixer_problem,
    mixed_decoder_problem,
    token_kv_groups,
    token_refinement_problem,
)
from .presets import PRESETS

# Where `trust_remote_code=True` finds each class in the code files a saved model carries (heads.py and
# the files it imports are copied beside the weights), so a checkpoint loads without this package.
AUTO_MAP = {
    "AutoConfig": "config.ConceptEncoderConfig",
    "AutoModel": "modeling.ConceptEncoder",
    "AutoModelForMaskedLM": "heads.ConceptEncoderForMaskedLM",
    "AutoModelForSequenceClassification": "heads.ConceptEncoderForSequenceClassification",
}


class ConceptEncoderConfig(PretrainedConfig):
    r"""Configuration of a Concept Encoder.

    Shapes: `[B,N] ids → [B,N,H] tokens → L × (concepts ← tokens cross-attention,
    concept self-attention, gated-GELU FFN) → [B,C,H] concepts → MLM decoder`.

    Args:
        vocab_size: size V of the token vocabulary (>= the tokenizer's length).
        hidden_size: width H of tokens and concepts. DeepSpeed's `"auto"` bucket sizes read it.
        num_hidden_layers: number L of concept layers in the encoder.
        num_attention_heads: heads in every attention; must divide `hidden_size`.
        intermediate_size: inner width I of the gated-GELU FFN (weights `H×2I` and `I×H`).
        concept_num: number C of learned concept vectors (C ≪ N is the point).
        max_position_embeddings: longest sequence N the learned position table supports.
        hidden_dropout_prob: dropout on embeddings and residual branches.
        attention_probs_dropout_prob: dropout on attention probabilities.
        classifier_dropout: dropout before the classifier (defaults to `hidden_dropout_prob`).
        initializer_range: std of the normal initialisation of weights and concepts.
        layer_norm_eps: epsilon of every LayerNorm.
        decoder_type: MLM decoder: `perceiver` (queries = position + token embedding,
            cross-attend to concepts), `mixed` (as perceiver, but the queries are the tokens after the
            local mixer, as the first layer reads them: a masked position's query sees its neighbours, as BERT's
            does; needs `local_mixer` conv; docs/model.md), `posonly` (queries = position embedding only) or
            `weighted` (learned per-position softmax mixture of concepts).
        num_decoder_layers: cross-attention blocks in the `perceiver`/`posonly` decoders.
        token_kv_sharing: `none` (each encoder layer projects the tokens to its own keys/values, 4·N·H²
            FLOPs per layer), `all` (one token key/value projection, computed once per forward and read
            by every layer's cross-attention) or `groups:K` (K contiguous groups of layers, one projection
            each). The tokens are never updated by the encoder, so each layer only re-projects the same
            states. Sharing keys/values across layers has precedent in the literature: Cross-Layer
            Attention (Brandon et al., 2024) shares them between adjacent layers of a decoder, and YOCO
            (Sun et al., 2024) computes one global key/value cache that every cross-decoder layer reads.
        token_refinement: in each layer, after the concepts' update, every token cross-attends to the concepts
            and passes an FFN (Luna's unpack, BiXT's bidirectional cross-attention; O(N·C) like the concepts'
            read, plus 4·N·H² + 6·N·H·I per layer for the tokens' projections and FFN). Off by default: the
            tokens are then never updated (Perceiver). Needs `token_kv_sharing` none (refined tokens change
            every layer, so their keys and values cannot be computed once).
        local_mixer: `none` (tokens carry only their identity and position) or `conv`: before the first layer
            (or before every layer: `local_mixer_placement`), each token embedding adds a depthwise convolution of
            itself and its neighbours, then a LayerNorm (`LocalMixer`, O(N·H·w)), so a concept can read a token
            bound to the tokens beside it (a key to its value). Padded positions are zeroed before the convolution,
            so padding never reaches a real token. The MLM decoder's queries keep the unmixed embeddings
            unless `decoder_type` is `mixed` (docs/model.md, "Local token mixer").
        local_mixer_width: the convolution's window w, odd (3: a token and one neighbour on each side).
        local_mixer_placement: where the `conv` mixer acts. `first` (the default, and what a saved config without
            the key loads as): once, on the embeddings before the first layer. `every`: each layer has a mixer of
            its own (`ConceptEncoder.local_mixers`), applied before the layer to the tokens its cross-attention
            reads, O(N·H·w) per layer. Without `token_refinement` the tokens persist between layers, so layer l
            reads the embeddings mixed l+1 times (the window grows by w-1 per layer); with it each mixer acts on
            the refined tokens its layer receives. Needs `local_mixer` conv and `token_kv_sharing` none (shared
            keys/values come from one token state, while each layer here reads its own).
        classifier_pooling: `weighted` (learned attention pooling over concepts), `mean`, or `cls` (the `[CLS]`
            token's refined state; needs `token_refinement`).
        pad_token_id, mask_token_id, cls_token_id, sep_token_id, unk_token_id: special token ids.
        tie_word_embeddings: tie the MLM output projection to the input token embeddings.
    """

    model_type = "concept_encoder"

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 2048
    concept_num: int = 128
    max_position_embeddings: int = 512
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.0
    classifier_dropout: float | None = None
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-5
    decoder_type: str = "perceiver"
    num_decoder_layers: int = 1
    token_kv_sharing: str = "none"
    token_refinement: bool = False
    local_mixer: str = "none"
    local_mixer_width: int = 3
    local_mixer_placement: str = "first"
    classifier_pooling: str = "weighted"
    pad_token_id: int | None = 0
    unk_token_id: int | None = 1
    cls_token_id: int | None = 2
    sep_token_id: int | None = 3
    mask_token_id: int | None = 4
    tie_word_embeddings: bool = True

    def __post_init__(self, **kwargs: Any) -> None:
        super().__post_init__(**kwargs)
        self.auto_map = {**AUTO_MAP, **(getattr(self, "auto_map", None) or {})}
        self._validate()

    def _validate(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "concept_num",
            "max_position_embeddings",
            "num_decoder_layers",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"{name}={value!r} must be a positive integer")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size={self.hidden_size} is not divisible by num_attention_heads="
                f"{self.num_attention_heads}; choose hidden_size as a multiple of {self.num_attention_heads}"
            )
        for name in ("hidden_dropout_prob", "attention_probs_dropout_prob", "classifier_dropout"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value < 1.0:
                raise ValueError(f"{name}={value!r} must be in [0, 1)")
        if not self.initializer_range > 0:
            raise ValueError(f"initializer_range={self.initializer_range!r} must be > 0")
        if not self.layer_norm_eps > 0:
            raise ValueError(f"layer_norm_eps={self.layer_norm_eps!r} must be > 0")
        if self.decoder_type not in DECODER_TYPES:
            raise ValueError(f"decoder_type={self.decoder_type!r} is unknown; choose one of {DECODER_TYPES}")
        token_kv_groups(self.token_kv_sharing, self.num_hidden_layers)  # raises naming the valid forms
        if self.classifier_pooling not in CLASSIFIER_POOLINGS:
            raise ValueError(
                f"classifier_pooling={self.classifier_pooling!r} is unknown; choose one of {CLASSIFIER_POOLINGS}"
            )
        if problem := token_refinement_problem(self.token_refinement, self.token_kv_sharing):
            raise ValueError(problem)
        if problem := local_mixer_problem(
            self.local_mixer, self.local_mixer_width, self.local_mixer_placement, self.token_kv_sharing
        ):
            raise ValueError(problem)
        if problem := mixed_decoder_problem(self.decoder_type, self.local_mixer):
            raise ValueError(problem)
        if self.classifier_pooling == "cls" and not self.token_refinement:
            raise ValueError(
                "classifier_pooling='cls' reads the [CLS] token's refined state, which only token_refinement makes "
                "(without it the tokens are never updated); set token_refinement=True, or pool weighted or mean"
            )
        for name in ("pad_token_id", "unk_token_id", "cls_token_id", "sep_token_id", "mask_token_id"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < self.vocab_size:
                raise ValueError(
                    f"{name}={value} is outside the vocabulary [0, {self.vocab_size}); "
                    f"raise vocab_size or fix the token id"
                )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


def config_from_preset(name: str, **overrides: Any) -> ConceptEncoderConfig:
    """Build a `ConceptEncoderConfig` from a preset name, with field overrides on top.

    >>> config_from_preset("small", vocab_size=8000).hidden_size
    256
    """
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
    return ConceptEncoderConfig(**{**PRESETS[name], **overrides})


AutoConfig.register(ConceptEncoderConfig.model_type, ConceptEncoderConfig, exist_ok=True)
ConceptEncoderConfig.register_for_auto_class("AutoConfig")  # save_pretrained copies this file's code
