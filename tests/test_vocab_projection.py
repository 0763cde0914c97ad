"""`linear_cross_entropy`: equal to `cross_entropy(linear(h), t, reduction="sum")` in value and gradients."""

import pytest
import torch
import torch.nn.functional as F

from concept_encoder.model import vocab_projection
from concept_encoder.model.vocab_projection import VocabProjection, linear_cross_entropy

L, H, V = 29, 16, 53


def inputs(bias: bool = True, rows: int = L):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(rows, H, generator=g, requires_grad=True)
    weight = torch.randn(V, H, generator=g).mul_(0.3).requires_grad_()
    b = torch.randn(V, generator=g).requires_grad_() if bias else None
    targets = torch.randint(0, V, (rows,), generator=g)
    return hidden, weight, b, targets


def loss_and_grads(fn, hidden, weight, bias, targets, autocast: bool = False):
    params = [p for p in (hidden, weight, bias) if p is not None]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = fn(hidden, weight, bias, targets)
    return loss, torch.autograd.grad(loss, params)


def reference(hidden, weight, bias, targets):
    return F.cross_entropy(F.linear(hidden, weight, bias).float(), targets, reduction="sum")


@pytest.mark.parametrize("bias", [True, False])
def test_equals_cross_entropy_of_linear_in_float32(bias):
    args = inputs(bias)
    loss, grads = loss_and_grads(linear_cross_entropy, *args)
    ref_loss, ref_grads = loss_and_grads(reference, *args)
    assert loss.shape == () and loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref_loss)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("chunk_elements", [V, 7 * V, 2**24])  # 1-row chunks, 7-row chunks (uneven), one chunk
def test_chunked_under_bf16_autocast_matches_autocast_cross_entropy(monkeypatch, chunk_elements):
    monkeypatch.setattr(vocab_projection, "VOCAB_CHUNK_ELEMENTS", chunk_elements)
    args = inputs()
    loss, grads = loss_and_grads(linear_cross_entropy, *args, autocast=True)
    ref_loss, ref_grads = loss_and_grads(reference, *args, autocast=True)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-3, atol=1e-3)
    for got, want, param in zip(grads, ref_grads, args[:3], strict=True):
        assert got.dtype == param.dtype  # gradients come back in each input's own dtype
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_no_rows_gives_zero_loss_and_zero_gradients():
    hidden, weight, bias, targets = inputs(rows=0)
    loss, (g_hidden, g_weight, g_bias) = loss_and_grads(linear_cross_entropy, hidden, weight, bias, targets)
    assert loss.item() == 0.0 and g_hidden.shape == (0, H)
    assert g_weight.shape == (V, H) and not g_weight.any() and not g_bias.any()


def test_vocab_projection_is_a_linear_layer_with_a_loss_path():
    torch.manual_seed(0)
    layer = VocabProjection(H, V)
    hidden, _, _, targets = inputs()
    torch.testing.assert_close(layer(hidden), F.linear(hidden, layer.weight, layer.bias))
    torch.testing.assert_close(layer(hidden, targets), reference(hidden, layer.weight, layer.bias, targets))
    assert set(layer.state_dict()) == {"weight", "bias"}  # checkpoints are those of nn.Linear


def test_no_gradients_are_computed_under_no_grad():
    from torch.utils.flop_counter import FlopCounterMode

    hidden, weight = torch.randn(6, 8, requires_grad=True), torch.randn(20, 8, requires_grad=True)
    targets = torch.randint(0, 20, (6,))
    with FlopCounterMode(display=False) as training:
        linear_cross_entropy(hidden, weight, None, targets)
    with torch.no_grad(), FlopCounterMode(display=False) as inference:
        loss = linear_cross_entropy(hidden, weight, None, targets)
    assert inference.get_total_flops() == 2 * 6 * 8 * 20 and training.get_total_flops() == 3 * 2 * 6 * 8 * 20
    assert not loss.requires_grad


def test_under_fp16_a_rare_tokens_gradient_survives_until_the_loss_scale_multiplies_it():
    """fp16's GradScaler multiplies the gradient in backward; the gradients computed in forward must not have
    flushed the small softmax entries of a large vocabulary to zero first (they are computed in float32)."""
    g = torch.Generator().manual_seed(0)
    vocab = 4096
    hidden = torch.randn(8, H, generator=g, requires_grad=True)
    weight = torch.randn(vocab, H, generator=g).mul_(0.3)
    weight[:8] *= 30  # eight tokens take almost all the probability: the other rows' softmax entries are tiny
    weight.requires_grad_()
    targets = torch.arange(8)
    scale = 2.0**16
    with torch.autocast("cpu", dtype=torch.float16):
        loss = linear_cross_entropy(hidden, weight, None, targets)
    (scaled,) = torch.autograd.grad(loss * scale, [weight])  # what the scaler's backward computes
    (want,) = torch.autograd.grad(reference(hidden, weight, None, targets), [weight])  # float32, unscaled
    rare = want[8:].abs().amax(dim=1) > 0  # rows with a gradient in float32
    small = want[8:].abs().amax(dim=1) < 6e-8  # below float16's smallest subnormal before scaling
    assert (rare & small).sum() > 100  # the case exists in this example
    assert (scaled[8:].abs().amax(dim=1)[rare] > 0).all()  # every rare row keeps a gradient
    ratio = (scaled[8:][rare] / scale).norm(dim=1) / want[8:][rare].norm(dim=1)
    assert ratio.min() > 0.9 and ratio.max() < 1.1  # and of the right size (fp16 logits: a few % off)
