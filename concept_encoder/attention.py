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
    cross-attention (concepts ← tokens, positions ← concepts) and self-attention.
    """

    def __init__(self, config: ConceptEncoderConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.dropout = config.attention_probs_dropout_prob
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.kv_proj = nn.Linear(config.hidden_size, 2 * config.hidden_size)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(
        self,
        query: torch.Tensor,
        key_value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`query [B,Q,H]`, `key_value [B,K,H]`, `key_padding_mask [B,K]` bool (True = attend) or None → `[B,Q,H]`."""
        batch, q_len, hidden = query.shape
        k_len = key_value.shape[1]
        q = self.q_proj(query).view(batch, q_len, self.num_heads, self.head_dim).transpose(1, 2)  # [B,h,Q,d]
        kv = self.kv_proj(key_value).view(batch, k_len, 2, self.num_heads, self.head_dim)
        k, v = kv.permute(2, 0, 3, 1, 4).unbind(0)  # 2 × [B,h,K,d]
        mask = None if key_padding_mask is None else key_padding_mask[:, None, None, :]  # [B,1,1,K]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=self.dropout if self.training else 0.0
        )  # [B,h,Q,d]
        return self.o_proj(out.transpose(1, 2).reshape(batch, q_len, hidden))


class AttentionBlock(nn.Module):
    """Pre-LN residual attention: `x + Dropout(Attn(LN(x), LN_ctx(context)))`.

    With `cross=False` it is self-attention over `x` and has no context norm.
    """

    def __init__(self, config: ConceptEncoderConfig, cross: bool):
        super().__init__()
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.context_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if cross else None
        self.attn = MultiHeadAttention(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """`x [B,Q,H]`, `context [B,K,H]` (cross only), `context_mask [B,K]` bool or None → `[B,Q,H]`."""
        h = self.norm(x)
        kv = h if self.context_norm is None else self.context_norm(context)
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
