"""The analytic FLOP formula equals PyTorch's own count of the model's training step."""

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from concept_encoder import ConceptEncoderForMaskedLM, config_from_preset
from concept_encoder.accounting.flops import mlm_training_flops


@pytest.mark.parametrize(
    ("decoder", "decoder_layers"), [("perceiver", 1), ("perceiver", 2), ("posonly", 1), ("weighted", 1)]
)
def test_formula_equals_flop_counter_of_a_training_step(decoder, decoder_layers):
    config = config_from_preset("micro", vocab_size=500, decoder_type=decoder, num_decoder_layers=decoder_layers)
    model = ConceptEncoderForMaskedLM(config)
    batch, seq_len, masked = 2, 100, 10
    ids = torch.randint(5, 500, (batch, seq_len))
    labels = torch.full_like(ids, -100)
    labels[:, :masked] = ids[:, :masked]  # exactly p·N labelled positions per sequence
    # The math SDPA backend runs attention as matmuls the counter sees (fused kernels are opaque to it).
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(ids, labels=labels, return_logits=False).loss.backward()
    assert counter.get_total_flops() == mlm_training_flops(config.to_dict(), batch, seq_len, masked / seq_len)


def test_flops_are_affine_in_sequence_length():
    config = config_from_preset("small", vocab_size=30522).to_dict()
    f1, f2, f3 = (mlm_training_flops(config, 1, n) for n in (1024, 2048, 3072))
    assert f3 - f2 == pytest.approx(f2 - f1) and f2 > f1  # no N² term
