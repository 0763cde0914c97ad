"""The vocabulary projection of the MLM head, with a cross-entropy that never keeps the logits.

`torch.nn.functional.cross_entropy(linear(h), t)` keeps three `[L,V]` tensors alive across a
training step (the logits, their float copy under autocast, the log-softmax saved for backward)
and passes over them about ten times. At a 30k vocabulary these are the largest tensors of a
Concept Encoder step; in the CPU profile of a `small` step at N=8192 those passes took almost half
as long as the vocabulary matmuls themselves (benchmarks/README.md). A dense objective that
predicts every position (TSDAE) makes L = B·N and such a tensor unaffordable.

`linear_cross_entropy` therefore works in row chunks of at most `VOCAB_CHUNK_ELEMENTS` logits:
per chunk, logits → max, one `exp`, sum → loss, `softmax - onehot` in place of the logits, and
then at once the chunk's share of the three gradients (two matmuls and a column sum), scaled by
the optional per-row weights. Only the gradients (`[L,H]`, `[V,H]`, `[V]`) are kept for backward,
which multiplies them by the incoming scalar: peak memory is one chunk plus the gradients, whatever
L and V. No library does this for CPU and CUDA in eager PyTorch (Liger's fused linear
cross-entropy, the same idea, is Triton-only), hence our own; the result equals
`(w * cross_entropy(linear(h), t, reduction="none")).sum()` (tested, values and gradients).
It is a custom operator (`torch.ops.concept_encoder.linear_cross_entropy`) so that torch.compile
sees one call with symbolic shapes rather than a loop over a data-dependent row count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import register_flop_formula

from .constants import VOCAB_CHUNK_ELEMENTS


def chunk_rows(vocab_size: int) -> int:
    """Rows per chunk: the chunk's logits stay under `VOCAB_CHUNK_ELEMENTS` (the memory model counts the same)."""
    return max(1, VOCAB_CHUNK_ELEMENTS // max(vocab_size, 1))


def gradient_dtype(compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype the gradients are computed in: float32 under float16. They are the gradients of the loss itself,
    computed in forward before fp16's GradScaler multiplies them (in backward) by its scale of up to 2^16: in
    float16 a softmax entry of a 30k vocabulary (~3e-5) is at the edge of its range (normal down to 6e-5, zero
    below 6e-8), so rare tokens' rows would get no gradient. bf16 has float32's range and keeps its own dtype."""
    return torch.float32 if compute_dtype == torch.float16 else compute_dtype


def _chunked_loss_and_gradients(hidden, weight, bias, targets, row_weights, compute_dtype, needs):
    """The work of `linear_cross_entropy`: (loss `[]` float32, grad_hidden `[L,H]` in `gradient_dtype`, grad_weight
    `[V,H]` float32, grad_bias `[V]` float32), each gradient its own empty `[0]` (outputs may not alias) where
    `needs` (hidden, weight, bias) says it is not wanted; the gradients are of the loss itself (backward
    multiplies them by the incoming scalar)."""
    with torch.autocast(hidden.device.type, enabled=False):
        h = hidden.to(compute_dtype)
        w = weight.to(compute_dtype)
        b = None if bias is None else bias.to(compute_dtype)
        grad_type = gradient_dtype(compute_dtype)
        hg, wg = h.to(grad_type), w.to(grad_type)  # the same tensors unless fp16 (then float32 copies)
        rows, vocab = h.shape[0], w.shape[0]
        grad_hidden = torch.empty_like(hg) if needs[0] else None  # [L,H]
        grad_weight = None  # [V,H] float32: the first chunk's product, then summed into (no [V,H] zero fill)
        grad_bias = torch.zeros(vocab, dtype=torch.float32, device=w.device) if needs[2] and b is not None else None
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        step = chunk_rows(vocab)
        for start in range(0, rows, step):
            part = slice(start, start + step)
            z = torch.mm(h[part], w.t()) if b is None else torch.addmm(b, h[part], w.t())  # [R,V]
            zf = z.float()  # the same tensor in float32 compute
            t = targets[part, None]  # [R,1]
            picked = zf.gather(1, t)  # [R,1] logit of the target
            peak = zf.amax(dim=1, keepdim=True)  # [R,1]
            zf.sub_(peak).exp_()
            total = zf.sum(dim=1, keepdim=True)  # [R,1]
            row_loss = peak + total.log() - picked  # [R,1] logsumexp - logit[target]
            scale = None if row_weights is None else row_weights[part, None].float()  # [R,1]
            loss += (row_loss if scale is None else row_loss * scale).sum()
            if not (needs[0] or needs[1] or grad_bias is not None):
                continue
            zf.div_(total).scatter_add_(1, t, torch.full_like(picked, -1.0))  # softmax - onehot
            if scale is not None:
                zf.mul_(scale)
            g = zf.to(grad_type)  # [R,V]
            if grad_hidden is not None:
                torch.mm(g, wg, out=grad_hidden[part])
            if needs[1]:
                product = g.t() @ hg[part]  # [V,H]
                if grad_weight is None:
                    grad_weight = product.float()  # no copy in float32
                else:
                    grad_weight += product
            if grad_bias is not None:
                grad_bias += zf.sum(dim=0)
    if needs[1] and grad_weight is None:  # no rows
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    return tuple(x if x is not None else hidden.new_empty(0) for x in (loss, grad_hidden, grad_weight, grad_bias))


def _fake_loss_and_gradients(hidden, weight, bias, targets, row_weights, compute_dtype, needs):
    """Shapes and dtypes of `_chunked_loss_and_gradients`, for torch.compile's tracing."""
    f32 = torch.float32
    return (
        hidden.new_empty((), dtype=f32),
        hidden.new_empty(hidden.shape, dtype=gradient_dtype(compute_dtype)) if needs[0] else hidden.new_empty(0),
        weight.new_empty(weight.shape, dtype=f32) if needs[1] else hidden.new_empty(0),
        weight.new_empty(weight.shape[:1], dtype=f32) if needs[2] and bias is not None else hidden.new_empty(0),
    )


def _save_gradients(ctx, inputs, output):
    hidden, weight, bias, *_, needs = inputs
    ctx.save_for_backward(*output[1:])
    dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
    ctx.grad_dtypes = [dtype if need else None for dtype, need in zip(dtypes, needs, strict=True)]


def _scale_gradients(ctx, grad_loss, *unused_output_grads):
    grads = []
    for saved, dtype in zip(ctx.saved_tensors, ctx.grad_dtypes, strict=True):
        grads.append(None if dtype is None else (saved * grad_loss.to(saved.dtype)).to(dtype))  # scaled, then cast
    return (*grads, None, None, None, None)


def _matmul_flops(hidden_shape, weight_shape, *unused, out_shape=None) -> int:
    """For `FlopCounterMode`: the logits `2·L·H·V`, and as much again for each gradient computed in forward
    (`needs`, the operator's last argument, is passed through as a list of bools)."""
    (rows, hidden), vocab, needs = hidden_shape, weight_shape[0], unused[-1]
    return 2 * rows * hidden * vocab * (1 + int(needs[0]) + int(needs[1]))


def _register_operator():
    """`torch.ops.concept_encoder.linear_cross_entropy`: a custom operator, so torch.compile treats the
    chunk loop as one opaque call with symbolic shapes (traced as Python, its `range(0, L, step)` would
    specialise the graph on L, the masked count, and recompile every batch). A model loaded from a
    saved folder imports a copy of this file: the operator is registered once per process."""
    namespace = torch.ops.concept_encoder
    if hasattr(namespace, "linear_cross_entropy"):
        return namespace.linear_cross_entropy
    op = torch.library.custom_op(
        "concept_encoder::linear_cross_entropy",
        _chunked_loss_and_gradients,
        mutates_args=(),
        schema="(Tensor hidden, Tensor weight, Tensor? bias, Tensor targets, Tensor? row_weights, "
        "ScalarType compute_dtype, bool[] needs) -> (Tensor, Tensor, Tensor, Tensor)",
    )
    op.register_fake(_fake_loss_and_gradients)
    op.register_autograd(_scale_gradients, setup_context=_save_gradients)
    register_flop_formula(namespace.linear_cross_entropy)(_matmul_flops)
    return op


_linear_cross_entropy_op = _register_operator()


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    row_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Summed cross-entropy of `hidden @ weight.T + bias` against `targets`, without keeping logits.

    Args:
        hidden: `[L,H]` rows to classify.
        weight: `[V,H]` vocabulary projection; `bias`: `[V]` or None.
        targets: `[L]` class ids, all valid (select the labelled rows first; no ignore index).
        row_weights: `[L]` weight of each row's cross-entropy (e.g. the masked-diffusion 1/t), or None.

    Returns:
        `[]` float32 (weighted) sum over the L rows. Under autocast the matmuls run in the autocast
        dtype, the softmax in float32, as `cross_entropy(linear(h).float(), t)` would.
    """
    device_type = hidden.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):  # not on `meta`
        compute_dtype = torch.get_autocast_dtype(device_type)
    else:
        compute_dtype = torch.promote_types(hidden.dtype, weight.dtype)
    if row_weights is not None and row_weights.shape != targets.shape:
        raise ValueError(
            f"row_weights shape {tuple(row_weights.shape)} must equal targets shape {tuple(targets.shape)}"
        )
    grad = torch.is_grad_enabled()  # no gradients are computed under torch.no_grad()
    needs = [
        grad and hidden.requires_grad,
        grad and weight.requires_grad,
        grad and bias is not None and bias.requires_grad,
    ]
    return _linear_cross_entropy_op(hidden, weight, bias, targets, row_weights, compute_dtype, needs)[0]


class VocabProjection(nn.Linear):
    """`nn.Linear(H, V)` whose forward can also return the summed cross-entropy against targets.

    The loss is computed inside this module's own forward so that frameworks which gather
    parameters around a module's forward (DeepSpeed ZeRO-3) see the weight used.
    """

    def forward(
        self, hidden: torch.Tensor, targets: torch.Tensor | None = None, row_weights: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`hidden [...,H]` → logits `[...,V]`; with `targets [L]` (and `hidden [L,H]`, optional
        `row_weights [L]`) → (weighted) summed CE `[]`."""
        if targets is None:
            return F.linear(hidden, self.weight, self.bias)
        return linear_cross_entropy(hidden, self.weight, self.bias, targets, row_weights)
