"""Attention and feed-forward building blocks shared by the encoder and the decoders.

Attention calls `torch.nn.functional.scaled_dot_product_attention` directly, so the
fused kernels (flash, memory-efficient) are used whenever the inputs allow it: no
`nn.MultiheadAttention`, and no mask at all when a batch has no padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ConceptEncoderConfig


class MultiHeadAttention(nn.Module):
    """Multi-head attention of `Q` queries over `K` keys/values through SDPA.

    The query and key/value projections are separate so one module serves both
    cross-attention (concepts ← tokens, positions ← concepts) and self-attention. With
    `own_kv=False` the module has no key/value projection: it is handed keys and values already
    projected (`[B,K,2H]`, by a `TokenKeyValue` shared across layers).
    """

    def __init__(self, config: ConceptEncoderConfig, own_kv: bool = True):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.dropout = config.attention_probs_dropout_prob
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.kv_proj = nn.Linear(config.hidden_size, 2 * config.hidden_size) if own_kv else None
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(
        self,
        query: torch.Tensor,
        key_value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`query [B,Q,H]`, `key_value [B,K,H]` (`[B,K,2H]` projected keys/values without own `kv_proj`),
        `key_padding_mask [B,K]` bool (True = attend) or None → `[B,Q,H]`."""
        batch, q_len, hidden = query.shape
        k_len = key_value.shape[1]
        q = self.q_proj(query).view(batch, q_len, self.num_heads, self.head_dim).transpose(1, 2)  # [B,h,Q,d]
        projected = key_value if self.kv_proj is None else self.kv_proj(key_value)  # [B,K,2H]
        kv = projected.view(batch, k_len, 2, self.num_heads, self.head_dim)
        k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)  # 2 × [B,h,K,d]
        mask = None if key_padding_mask is None else key_padding_mask[:, None, None, :]  # [B,1,1,K]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0
        )  # [B,h,Q,d]
        return self.o_proj(out.transpose(1, 2).reshape(batch, q_len, hidden))


class AttentionBlock(nn.Module):
    """Pre-LN residual attention: `x + Dropout(Attn(LN(x), LN_ctx(context)))`.

    With `cross=False` it is self-attention over `x` and has no context norm. With `shared_kv=True`
    (cross only) the context arrives as keys/values already normed and projected (`TokenKeyValue`).
    """

    def __init__(self, config: ConceptEncoderConfig, cross: bool, shared_kv: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        own_context_norm = cross and not shared_kv
        self.context_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if own_context_norm else None
        self.cross = cross
        self.attn = MultiHeadAttention(config, own_kv=not shared_kv)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`x [B,Q,H]`, `context [B,K,H]` (cross only; `[B,K,2H]` keys/values when shared), `context_mask [B,K]`
        bool or None → `[B,Q,H]`."""
        h = self.norm(x)
        if not self.cross:
            kv = h
        else:
            kv = context if self.context_norm is None else self.context_norm(context)
        return x + self.dropout(self.attn(h, kv, context_mask))


class FeedForwardBlock(nn.Module):
    """Pre-LN residual gated-GELU FFN: `x + Dropout(W_out(GELU(x W_gate) ⊙ x W_up))`.

    Gate and up projections share one `H×2I` matmul.
    """

    def __init__(self, config: ConceptEncoderConfig):
        super().__init__()
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.w_in = nn.Linear(config.hidden_size, 2 * config.intermediate_size)
        self.w_out = nn.Linear(config.intermediate_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x [B,S,H]` → `[B,S,H]` (inner width `[B,S,I]`)."""
        gate, up = self.w_in(self.norm(x)).chunk(2, dim=-1)
        return x + self.dropout(self.w_out(F.gelu(gate) * up))


class TokenKeyValue(nn.Module):
    """The tokens' keys and values for the concepts' cross-attention, computed once and read by a group
    of layers (`config.token_kv_sharing`): `LN(tokens) W_kv`, `[B,N,H]` → `[B,N,2H]`."""

    def __init__(self, config: ConceptEncoderConfig):
        super().__init__()
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.kv_proj = nn.Linear(config.hidden_size, 2 * config.hidden_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """`tokens [B,N,H]` → keys and values `[B,N,2H]`."""
        return self.kv_proj(self.norm(tokens))


class ReadingLayer(nn.Module):
    """Queries read a context by cross-attention, then pass an FFN: `AttentionBlock(cross)` then
    `FeedForwardBlock`. The MLM decoder's layer (positions read the concepts) and token refinement's (every
    token reads the concepts, `config.token_refinement`)."""

    def __init__(self, config: ConceptEncoderConfig):
        super().__init__()
        self.cross_attn = AttentionBlock(config, cross=True)
        self.ffn = FeedForwardBlock(config)

    def forward(self, queries: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """`queries [B,Q,H]`, `context [B,K,H]` (unmasked: concepts are never padding) → `[B,Q,H]`."""
        return self.ffn(self.cross_attn(queries, context))
