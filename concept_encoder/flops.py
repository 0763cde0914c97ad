"""Analytic FLOPs of an MLM training step, for throughput (TFLOP/s, MFU) and the benchmarks.

Torch-free, like `memory.py`. Matmuls only (norms, softmax and optimizer are not counted), a
multiply-add is 2 FLOPs, and a training step is 3 × forward (backward computes two products per
forward matmul). The latent layers are counted on their C concept rows, not the N tokens:

    per encoder layer   4·N·H²      token keys/values (the only H² term linear in N)
                        4·C·N·H     concepts attending to the tokens (scores and values)
                        4·C·H²      concept queries and output projection
                        8·C·H² + 4·C²·H   concept self-attention
                        6·C·H·I     gated FFN on the concepts
    decoder, M = p·N masked positions:
        perceiver/posonly, per layer   2·M·H² + 4·C·H² + 4·M·C·H + 2·M·H² + 6·M·H·I
        weighted                       2·M·C·H
    head                2·M·H² + 2·M·H·V   transform and vocabulary projection at the masked positions
"""

from __future__ import annotations

from collections.abc import Mapping


def mlm_forward_flops(config: Mapping, seq_len: int, mlm_probability: float = 0.15) -> float:
    """Matmul FLOPs of one sequence's forward pass (`config`: a `ConceptEncoderConfig.to_dict()` or preset)."""
    H, L, C, V = (config[k] for k in ("hidden_size", "num_hidden_layers", "concept_num", "vocab_size"))
    inner = config["intermediate_size"]
    N, M = seq_len, mlm_probability * seq_len
    layer = 4 * N * H * H + 4 * C * N * H + 4 * C * H * H + 8 * C * H * H + 4 * C * C * H + 6 * C * H * inner
    if config.get("decoder_type", "perceiver") == "weighted":
        decoder = 2 * M * C * H
    else:
        decoder_layer = 2 * M * H * H + 4 * C * H * H + 4 * M * C * H + 2 * M * H * H + 6 * M * H * inner
        decoder = config.get("num_decoder_layers", 1) * decoder_layer
    head = 2 * M * H * H + 2 * M * H * V
    return L * layer + decoder + head


def mlm_training_flops(config: Mapping, batch_size: int, seq_len: int, mlm_probability: float = 0.15) -> float:
    """Matmul FLOPs of one training step (forward + backward) on `batch_size` sequences of `seq_len`."""
    return 3 * batch_size * mlm_forward_flops(config, seq_len, mlm_probability)
