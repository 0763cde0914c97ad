"""Analytic FLOPs of an MLM training step, for throughput (TFLOP/s, MFU) and the benchmarks.

Torch-free, like `memory.py`. Matmuls only (norms, softmax and optimizer are not counted), a
multiply-add is 2 FLOPs, and a training step is 3 × forward (backward computes two products per
forward matmul). The latent layers are counted on their C concept rows, not the N tokens:

    per encoder layer   4·N·H²      token keys/values (the only H² term linear in N; once per group of
                                    layers under `token_kv_sharing`: G·4·N·H² in all, G = 1 for `all`)
                        4·C·N·H     concepts attending to the tokens (scores and values)
                        4·C·H²      concept queries and output projection
                        8·C·H² + 4·C²·H   concept self-attention
                        6·C·H·I     gated FFN on the concepts
    local mixer (`local_mixer` conv)  2·N·H·w   the depthwise convolution of width w (H channels, one w-tap
                                    filter each), once (`local_mixer_placement` first) or in each of the L layers
                                    (every). `FlopCounterMode` counts its forward so, but drops `groups` in the
                                    backward: it counts the weight gradient as a dense conv's, H times 2·N·H·w;
                                    this count keeps the true 3 × 2·N·H·w (tests/test_local_mixer.py)
    token refinement (`token_refinement`), per refining layer (all but the last, whose update nothing reads,
    unless the refined tokens are an output: `cls` pooling):
                        4·N·H² + 4·C·H² + 4·N·C·H + 6·N·H·I   token queries and output, concept keys/values,
                                    tokens attending to the concepts, the tokens' gated FFN
    decoder, M = p·N masked positions:
        perceiver/posonly, per layer   2·M·H² + 4·C·H² + 4·M·C·H + 2·M·H² + 6·M·H·I
        weighted                       2·M·C·H
    head                2·M·H² + 2·M·H·V   transform and vocabulary projection at the masked positions

BERT (`model_type` "bert", the baseline), per layer 8·N·H² (queries, keys, values, output) + 4·N²·H
(scores and values) + 4·N·H·I (FFN), and the same head at the masked positions. The other token encoders with
plain self-attention (`architectures.TOKEN_ENCODERS`: RoBERTa, DistilBERT, MPNet, ...) have BERT's encoder and
classifier count; their MLM heads (every position, not the masked ones) are not modelled.

A sequence classifier (`classifier_forward_flops`) is the encoder without the MLM decoder and head, plus its
pooling head: 2·H² + 2·H·K for K labels (BERT's pooler and classifier; RoBERTa's and MPNet's dense and out_proj,
DistilBERT's pre_classifier and classifier; a Concept Encoder's dense and classifier, and 2·C·H for weighted
concept pooling).

An architecture outside these raises `UnmodelledArchitecture`, naming it: a count is never guessed.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..model.constants import local_mixer_count, refining_layers, token_kv_groups
from .architectures import CONCEPT_MODEL_TYPE, TOKEN_ENCODERS, UnmodelledArchitecture, token_encoder_sizes, unmodelled


def concept_config(config: Mapping, what: str = "the FLOPs") -> Mapping:
    """`config` when it is a Concept Encoder's (its `model_type`, or none: a preset's fields), else
    `UnmodelledArchitecture` naming what is not known of it."""
    if config.get("model_type", CONCEPT_MODEL_TYPE) != CONCEPT_MODEL_TYPE:
        raise UnmodelledArchitecture(unmodelled(config.get("model_type"), what))
    return config


def encoder_forward_flops(config: Mapping, seq_len: int, returns_tokens: bool = False) -> float:
    """Matmul FLOPs of one sequence's pass through the encoder alone (embeddings to the last layer);
    `returns_tokens`: the refined tokens are an output, so the last layer refines them too."""
    if config.get("model_type") in TOKEN_ENCODERS:
        sizes = token_encoder_sizes(config)
        H, L, N, inner = sizes["hidden_size"], sizes["num_hidden_layers"], seq_len, sizes["intermediate_size"]
        return L * (8 * N * H * H + 4 * N * N * H + 4 * N * H * inner)
    concept_config(config)
    H, L, N = config["hidden_size"], config["num_hidden_layers"], seq_len
    inner = config["intermediate_size"]
    C = config["concept_num"]
    groups = token_kv_groups(config.get("token_kv_sharing", "none"), L)
    layer = 4 * C * N * H + 4 * C * H * H + 8 * C * H * H + 4 * C * C * H + 6 * C * H * inner
    refining = refining_layers(config.get("token_refinement", False), L, returns_tokens)
    refinement = 4 * N * H * H + 4 * C * H * H + 4 * N * C * H + 6 * N * H * inner
    mixers = local_mixer_count(config.get("local_mixer", "none"), config.get("local_mixer_placement", "first"), L)
    mixer = mixers * 2 * N * H * config.get("local_mixer_width", 3)
    return groups * 4 * N * H * H + L * layer + refining * refinement + mixer


def classifier_forward_flops(config: Mapping, seq_len: int) -> float:
    """Matmul FLOPs of one sequence's forward pass through a sequence classifier (see the module doc)."""
    labels = len(config["id2label"]) if config.get("id2label") else config.get("num_labels", 2)
    if config.get("model_type") in TOKEN_ENCODERS:
        H = token_encoder_sizes(config)["hidden_size"]
        return encoder_forward_flops(config, seq_len) + 2 * H * H + 2 * H * labels
    H = concept_config(config)["hidden_size"]
    pooling = config.get("classifier_pooling", "weighted")
    weighted = 2 * config["concept_num"] * H if pooling == "weighted" else 0
    return (
        encoder_forward_flops(config, seq_len, returns_tokens=pooling == "cls") + 2 * H * H + 2 * H * labels + weighted
    )


def mlm_forward_flops(config: Mapping, seq_len: int, mlm_probability: float = 0.15) -> float:
    """Matmul FLOPs of one sequence's forward pass (`config`: a `ConceptEncoderConfig.to_dict()` or preset, or the
    BERT baseline's, whose head reads the masked positions only)."""
    bert = config.get("model_type") == "bert"
    if not bert and config.get("model_type") in TOKEN_ENCODERS:
        raise UnmodelledArchitecture(
            f"the MLM FLOPs of model_type {config['model_type']!r} are not modelled: its MLM head predicts every "
            "position, and this count has the Concept Encoder's decoders and the BERT baseline's head at the masked "
            "positions only (its encoder and classifier are counted: classifier_forward_flops)"
        )
    if not bert:
        concept_config(config)
    H, V = config["hidden_size"], config["vocab_size"]
    inner = config["intermediate_size"]
    M = mlm_probability * seq_len
    head = 2 * M * H * H + 2 * M * H * V
    if bert:
        return encoder_forward_flops(config, seq_len) + head
    C = config["concept_num"]
    if config.get("decoder_type", "perceiver") == "weighted":
        decoder = 2 * M * C * H
    else:
        decoder_layer = 2 * M * H * H + 4 * C * H * H + 4 * M * C * H + 2 * M * H * H + 6 * M * H * inner
        decoder = config.get("num_decoder_layers", 1) * decoder_layer
    return encoder_forward_flops(config, seq_len) + decoder + head


def mlm_training_flops(config: Mapping, batch_size: int, seq_len: int, mlm_probability: float = 0.15) -> float:
    """Matmul FLOPs of one training step (forward + backward) on `batch_size` sequences of `seq_len`."""
    return 3 * batch_size * mlm_forward_flops(config, seq_len, mlm_probability)


def training_flops_per_token(
    config: Mapping,
    seq_len: int,
    objective: str = "mlm",
    mlm_probability: float = 0.15,
    t_min: float = 0.1,
    deletion_rate: float = 0.6,
) -> float:
    """Expected training FLOPs per token of the original `seq_len`-token sequence under an objective.

    `mlm` decodes p·N positions; `diffusion` the mean rate (t_min + 1)/2 of N; `tsdae` encodes the
    (1 - deletion_rate)·N kept tokens and decodes all N positions.
    """
    if objective == "tsdae":
        kept = max(1, round((1 - deletion_rate) * seq_len))
        return mlm_training_flops(config, 1, kept, seq_len / kept) / seq_len
    rate = (t_min + 1) / 2 if objective == "diffusion" else mlm_probability
    return mlm_training_flops(config, 1, seq_len, rate) / seq_len
