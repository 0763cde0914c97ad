"""The vocabulary projection of the MLM head, with a cross-entropy that never keeps the logits.

`torch.nn.functional.cross_entropy(linear(h), t)` keeps three `[L,V]` tensors alive across a
training step (the logits, their float copy under autocast, the log-softmax saved for backward)
and passes over them about ten times. At a 30k vocabulary these are the largest tensors of a
Concept Encoder step; in the CPU profile of a `small` step at N=8192 those passes took almost half
as long as the vocabulary matmuls themselves (benchmarks/README.md).

`linear_cross_entropy` computes the loss and the gradient of the logits in one sweep instead:
logits → max, one `exp`, sum → loss, and `softmax - onehot` written in place of the logits (all rows
at once in float32; in row chunks with a float32 working copy for 16-bit compute). Backward is then
two matmuls and a column sum with that single `[L,V]` buffer (in the compute dtype). No library
does this for CPU and CUDA in eager PyTorch (Liger's fused linear cross-entropy is Triton-only),
hence our own; the result equals `cross_entropy(linear(h), t, reduction="sum")` (tested, values
and gradients).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .constants import VOCAB_CHUNK_ELEMENTS

# Rows per chunk are chosen so a chunk's float32 working copy stays under VOCAB_CHUNK_ELEMENTS
# (only used when the compute dtype is not float32; float32 logits are worked on in place).


class _LinearCrossEntropy(torch.autograd.Function):
    """`hidden [L,H]`, `weight [V,H]`, `bias [V]` or None, `targets [L]` → summed cross-entropy `[]` (float32)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, compute_dtype):
        device_type = hidden.device.type
        with torch.autocast(device_type, enabled=False):
            h = hidden.to(compute_dtype)
            w = weight.to(compute_dtype)
            b = None if bias is None else bias.to(compute_dtype)
            rows, vocab = h.shape[0], w.shape[0]
            grad_logits = torch.empty(rows, vocab, dtype=compute_dtype, device=hidden.device)  # [L,V]
            in_place = compute_dtype == torch.float32
            chunk = max(1, rows) if in_place else max(1, VOCAB_CHUNK_ELEMENTS // vocab)
            loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in range(0, rows, chunk):
                z = grad_logits[start : start + chunk]  # [R,V] view
                if b is None:
                    torch.mm(h[start : start + chunk], w.t(), out=z)
                else:
                    torch.addmm(b, h[start : start + chunk], w.t(), out=z)
                zf = z if in_place else z.float()  # [R,V] float32
                t = targets[start : start + chunk, None]  # [R,1]
                picked = zf.gather(1, t)  # [R,1] logit of the target
                peak = zf.amax(dim=1, keepdim=True)  # [R,1]
                zf.sub_(peak).exp_()
                total = zf.sum(dim=1, keepdim=True)  # [R,1]
                loss += (peak + total.log() - picked).sum()  # Σ logsumexp - logit[target]
                zf.div_(total).scatter_add_(1, t, torch.full_like(picked, -1.0))  # softmax - onehot
                if not in_place:
                    z.copy_(zf)
        ctx.save_for_backward(h, w, grad_logits)
        ctx.input_dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        h, w, grad_logits = ctx.saved_tensors
        hidden_dtype, weight_dtype, bias_dtype = ctx.input_dtypes
        scale = grad_loss.to(grad_logits.dtype)
        grad_hidden = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_hidden = (grad_logits @ w).mul_(scale).to(hidden_dtype)  # [L,H]
        if ctx.needs_input_grad[1]:
            grad_weight = (grad_logits.t() @ h).mul_(scale).to(weight_dtype)  # [V,H]
        if bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_bias = grad_logits.sum(dim=0).mul_(scale).to(bias_dtype)  # [V]
        return grad_hidden, grad_weight, grad_bias, None, None


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor
) -> torch.Tensor:
    """Summed cross-entropy of `hidden @ weight.T + bias` against `targets`, without keeping logits.

    Args:
        hidden: `[L,H]` rows to classify.
        weight: `[V,H]` vocabulary projection; `bias`: `[V]` or None.
        targets: `[L]` class ids, all valid (select the labelled rows first; no ignore index).

    Returns:
        `[]` float32 sum over the L rows. Under autocast the matmuls run in the autocast dtype,
        the softmax in float32, as `cross_entropy(linear(h).float(), t)` would.
    """
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(hidden.dtype, weight.dtype)
    return _LinearCrossEntropy.apply(hidden, weight, bias, targets, compute_dtype)


class VocabProjection(nn.Linear):
    """`nn.Linear(H, V)` whose forward can also return the summed cross-entropy against targets.

    The loss is computed inside this module's own forward so that frameworks which gather
    parameters around a module's forward (DeepSpeed ZeRO-3) see the weight used.
    """

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """`hidden [...,H]` → logits `[...,V]`; with `targets [L]` (and `hidden [L,H]`) → summed CE `[]`."""
        if targets is None:
            return F.linear(hidden, self.weight, self.bias)
        return linear_cross_entropy(hidden, self.weight, self.bias, targets)
