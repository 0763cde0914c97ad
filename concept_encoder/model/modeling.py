"""The Concept Encoder backbone.

Forward pass, with shapes::

    input_ids [B,N] ──embeddings──▶ tokens [B,N,H]            (word + learned position, LN)
    [local_mixer conv, placement first] tokens ← LN(tokens + depthwise-conv_w(tokens))   O(N·H·w), once
    concepts  [C,H] ──repeat──────▶ concepts [B,C,H]
    L × ConceptLayer:
        [local_mixer conv, placement every] tokens ← this layer's own mixer(tokens)   O(N·H·w) per layer
        concepts ← cross-attn(concepts, tokens, key padding mask)   O(N·C)
        concepts ← self-attn(concepts)                              O(C²)
        concepts ← gated-GELU FFN(concepts)
        [token_refinement] tokens ← cross-attn(tokens, concepts), FFN(tokens)   O(N·C)
    final LayerNorm ──▶ concepts [B,C,H]   (and, refined, tokens [B,N,H])

By default tokens are read, never updated (as in Perceiver): the cost per layer is linear in N. With
`token_refinement` every token also reads the concepts in each layer (Luna's "unpack", BiXT's bidirectional
cross-attention), still linear in N, so the next layer's concepts read tokens that have seen the whole input
through the bottleneck.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers import initialization as init
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutput

from .attention import AttentionBlock, FeedForwardBlock, ReadingLayer, TokenKeyValue
from .config import ConceptEncoderConfig
from .constants import refining_layers, token_kv_group, token_kv_groups


class TokenEmbeddings(nn.Module):
    """Word + learned absolute position embeddings, then LayerNorm and dropout."""

    def __init__(self, config: ConceptEncoderConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """`input_ids [B,S]`, `position_ids [B,S]` or `[1,S]` → `[B,S,H]`."""
        return self.dropout(self.norm(self.word_embeddings(input_ids) + self.position_embeddings(position_ids)))


class LocalMixer(nn.Module):
    """`local_mixer: conv`: each token adds a depthwise convolution (window w, centred, per channel) of itself and
    its neighbours, then a LayerNorm: `LN(x + conv(x))`, O(N·H·w).

    Why: without it a token embedding carries only its identity and position, so nothing binds a token to the one
    beside it and every composition (a key to its value) must happen inside the C concepts, which read tokens one
    by one (issue 54: with this mixer associative recall was learned, without it never). Residual, so the token's
    own identity stays; normalised, so the concepts read states of the scale the embeddings had.

    Padding: padded positions are zeroed before the convolution (the convolution's own zero padding at the
    sequence ends is the same zero), so a real token's mixed state is the same with or without padding after it.

    Placement (`local_mixer_placement`): `first`, one mixer on the embeddings (`ConceptEncoder.local_mixer`);
    `every`, one per layer (`ConceptEncoder.local_mixers`), each on the tokens its layer reads.
    """

    def __init__(self, config: ConceptEncoderConfig):
        super().__init__()
        width = config.local_mixer_width
        hidden = config.hidden_size
        self.conv = nn.Conv1d(hidden, hidden, kernel_size=width, padding=width // 2, groups=hidden)
        self.norm = nn.LayerNorm(hidden, eps=config.layer_norm_eps)

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """`tokens [B,N,H]`, `attention_mask [B,N]` (1 = token, 0 = pad) or None → mixed tokens `[B,N,H]`."""
        real = tokens if attention_mask is None else tokens * attention_mask.unsqueeze(-1).to(tokens.dtype)  # [B,N,H]
        mixed = self.conv(real.transpose(1, 2)).transpose(1, 2)  # [B,H,N] → [B,N,H]
        return self.norm(tokens + mixed)


@dataclass
class ConceptEncoderOutput(BaseModelOutput):
    """`last_hidden_state`: the concepts `[B,C,H]`; `token_states`: the refined tokens `[B,N,H]` under
    `token_refinement` (after a final LayerNorm), else None; `mixed_tokens`: the tokens `[B,N,H]` after the first
    local mixer, as the first layer reads them, when the encoder returns them (`returns_mixed`), else None."""

    token_states: torch.FloatTensor | None = None
    mixed_tokens: torch.FloatTensor | None = None


class ConceptLayer(GradientCheckpointingLayer):
    """One encoder layer: concepts read the tokens, talk among themselves, then pass an FFN; with `refine`, the
    tokens then read the concepts (`ReadingLayer`)."""

    def __init__(self, config: ConceptEncoderConfig, shared_kv: bool = False, refine: bool = False):
        super().__init__()
        self.cross_attn = AttentionBlock(config, cross=True, shared_kv=shared_kv)
        self.self_attn = AttentionBlock(config, cross=False)
        self.ffn = FeedForwardBlock(config)
        self.token_update = ReadingLayer(config) if refine else None

    def forward(
        self, concepts: torch.Tensor, tokens: torch.Tensor, token_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`concepts [B,C,H]`, `tokens [B,N,H]` (their keys/values `[B,N,2H]` under token_kv_sharing),
        `token_mask [B,N]` bool or None → (`concepts [B,C,H]`, `tokens [B,N,H]`: refined, or as given)."""
        concepts = self.cross_attn(concepts, tokens, token_mask)
        concepts = self.self_attn(concepts)
        concepts = self.ffn(concepts)
        if self.token_update is not None:
            tokens = self.token_update(tokens, concepts)  # [B,N,H]: each token reads the C concepts
        return concepts, tokens


class ConceptEncoderPreTrainedModel(PreTrainedModel):
    """Weight init and HF plumbing shared by the backbone and every head."""

    config_class = ConceptEncoderConfig
    config: ConceptEncoderConfig
    base_model_prefix = "encoder"
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _no_split_modules = ["ConceptLayer"]

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        if isinstance(module, ConceptEncoder):
            init.normal_(module.concepts, mean=0.0, std=self.config.initializer_range)


def padding_mask(attention_mask: torch.Tensor | None, padded: bool | None = None) -> torch.Tensor | None:
    """`attention_mask [B,N]` (1 = token, 0 = pad) → bool key mask `[B,N]`, or None when nothing is padded.

    Returning None for a padding-free batch keeps SDPA's fused kernels (flash) eligible. `padded` says whether
    the mask holds a 0: False drops it, True keeps it, None tests it, which reads the data (a host sync on an
    accelerator, and a data-dependent branch under torch.compile, where the test is skipped and the mask kept).
    The training loops know it from the CPU batch: they leave a padding-free batch's mask out and pass
    `padded=True` with the others (`data.objectives.prepare_batch`), so the step never waits for this test.
    A row with no real token would make attention NaN, so such a row attends to all positions.
    """
    if attention_mask is None or padded is False:
        return None
    mask = attention_mask.bool()
    if padded is None and not torch.compiler.is_compiling() and bool(mask.all()):
        return None
    return mask | ~mask.any(dim=-1, keepdim=True)


def check_sequence_length(config: ConceptEncoderConfig, seq_len: int) -> None:
    if seq_len > config.max_position_embeddings:
        raise ValueError(
            f"sequence length {seq_len} exceeds max_position_embeddings={config.max_position_embeddings}; "
            f"shorten the input or build the model with a larger max_position_embeddings"
        )


class ConceptEncoder(ConceptEncoderPreTrainedModel):
    """Token embeddings → `concept_num` learned concepts refined by `num_hidden_layers` concept layers."""

    def __init__(self, config: ConceptEncoderConfig, returns_tokens: bool | None = None, returns_mixed: bool = False):
        """`returns_tokens`: whether the refined tokens are an output (`token_states`), which only then need
        the last layer's token update and the final token norm; by default when the config pools `cls`. The MLM
        model passes False: its decoder reads the concepts alone, so a last token update would be dead weight
        that no gradient reaches (DDP and ZeRO need one for every parameter). `returns_mixed`: whether the tokens
        after the first local mixer are an output (`mixed_tokens`: the `mixed` MLM decoder's queries)."""
        super().__init__(config)
        self.returns_mixed = returns_mixed
        self.embeddings = TokenEmbeddings(config)
        mixing = config.local_mixer == "conv"
        every = mixing and config.local_mixer_placement == "every"
        self.local_mixer = LocalMixer(config) if mixing and not every else None  # placement first: once
        # placement every: a mixer of its own before each layer (each its own weights)
        layers = config.num_hidden_layers
        self.local_mixers = nn.ModuleList(LocalMixer(config) for _ in range(layers)) if every else None
        self.concepts = nn.Parameter(torch.empty(config.concept_num, config.hidden_size))
        shared = config.token_kv_sharing != "none"
        groups = token_kv_groups(config.token_kv_sharing, config.num_hidden_layers)
        self.token_kv = nn.ModuleList(TokenKeyValue(config) for _ in range(groups)) if shared else None
        returns_tokens = config.classifier_pooling == "cls" if returns_tokens is None else returns_tokens
        refined = refining_layers(config.token_refinement, config.num_hidden_layers, returns_tokens)
        self.layers = nn.ModuleList(
            ConceptLayer(config, shared_kv=shared, refine=index < refined) for index in range(config.num_hidden_layers)
        )
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        returned = config.token_refinement and returns_tokens
        self.token_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if returned else None
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings.word_embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings.word_embeddings = value

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        padded: bool | None = None,
    ) -> ConceptEncoderOutput:
        """Encode tokens into concepts.

        Args:
            input_ids: `[B,N]` token ids.
            attention_mask: `[B,N]`, 1 for real tokens and 0 for padding (optional).
            position_ids: `[B,N]` or `[1,N]` (optional; default `0..N-1`).
            padded: whether `attention_mask` holds a 0 (optional; None: tested here, see `padding_mask`).

        Returns:
            `ConceptEncoderOutput`: `last_hidden_state` the concepts `[B,C,H]`; `token_states` the refined tokens
            `[B,N,H]` under `token_refinement` when they are an output (`returns_tokens`), else None;
            `mixed_tokens` `[B,N,H]` the tokens after the first local mixer when they are (`returns_mixed`).
        """
        batch, seq_len = input_ids.shape
        check_sequence_length(self.config, seq_len)
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=input_ids.device).unsqueeze(0)  # [1,N]
        tokens = self.embeddings(input_ids, position_ids)  # [B,N,H]
        mixer_mask = None if padded is False else attention_mask  # [B,N] or None: padding zeroed before each conv
        if self.local_mixer is not None:  # placement first: each token sees its neighbours (never padding), once
            tokens = self.local_mixer(tokens, mixer_mask)  # [B,N,H]
        mixed_tokens = tokens  # [B,N,H]; placement every: replaced by the first layer's mixed tokens below
        token_mask = padding_mask(attention_mask, padded)  # [B,N] or None
        concepts = self.concepts.unsqueeze(0).repeat(batch, 1, 1)  # [B,C,H], a real copy per sample
        shared_kv: dict[int, torch.Tensor] = {}  # group → the tokens' keys/values [B,N,2H], computed once
        for index, layer in enumerate(self.layers):
            if self.local_mixers is not None:  # placement every: this layer's mixer, on the tokens it reads
                tokens = self.local_mixers[index](tokens, mixer_mask)  # [B,N,H]; kept: the next layer mixes again
                mixed_tokens = tokens if index == 0 else mixed_tokens
            context = tokens
            if self.token_kv is not None:
                group = token_kv_group(index, len(self.token_kv), len(self.layers))
                if group not in shared_kv:
                    shared_kv[group] = self.token_kv[group](tokens)
                context = shared_kv[group]
            concepts, read = layer(concepts, context, token_mask)
            if layer.token_update is not None:  # refined: the next layer reads the updated tokens
                tokens = read
        token_states = None if self.token_norm is None else self.token_norm(tokens)
        mixed_tokens = mixed_tokens if self.returns_mixed else None
        return ConceptEncoderOutput(
            last_hidden_state=self.norm(concepts), token_states=token_states, mixed_tokens=mixed_tokens
        )
