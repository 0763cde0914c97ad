"""Exact parameter counts of a model or of every size preset.

Counts come from building the real modules on the `meta` device (no memory, no init
cost), so they can never drift from the code.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from ..common.cli_types import at_least
from .config import PRESETS, ConceptEncoderConfig, config_from_preset
from .heads import ConceptEncoderForMaskedLM


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Parameters by top-level component plus `total` and `trainable`; tied weights counted once.

    Components are the dotted prefixes one level under the backbone, e.g. `encoder.embeddings`,
    `encoder.layers`, `encoder.concepts`, `mlm_decoder`, `lm_head`.
    """
    counts: dict[str, int] = {}
    seen: set[int] = set()
    total = trainable = 0
    for name, param in model.named_parameters(remove_duplicate=True):
        if id(param) in seen:
            continue
        seen.add(id(param))
        parts = name.split(".")
        component = ".".join(parts[:2]) if parts[0] == "encoder" and len(parts) > 1 else parts[0]
        numel = getattr(param, "ds_numel", param.numel())  # a ZeRO-3 partitioned parameter's full size
        counts[component] = counts.get(component, 0) + numel
        total += numel
        trainable += numel if param.requires_grad else 0
    return {**counts, "total": total, "trainable": trainable}


def preset_parameter_counts(vocab_size: int = 30522, **overrides) -> dict[str, dict[str, int]]:
    """`{preset: parameter_counts(ConceptEncoderForMaskedLM(preset))}` at the given vocabulary size
    (and config `overrides`, e.g. `token_kv_sharing="all"`)."""
    out = {}
    for name in PRESETS:
        with torch.device("meta"):
            model = ConceptEncoderForMaskedLM(config_from_preset(name, vocab_size=vocab_size, **overrides))
        out[name] = parameter_counts(model)
    return out


def format_preset_table(vocab_size: int = 30522) -> str:
    """A markdown table of every preset's shape and exact parameter counts (MLM model, tied embeddings)."""
    counts = preset_parameter_counts(vocab_size)
    shared = preset_parameter_counts(vocab_size, token_kv_sharing="all")
    lines = [
        f"Concept Encoder presets (ConceptEncoderForMaskedLM, vocab_size={vocab_size}, tied embeddings)",
        "",
        "| preset | H | L | heads | I | C | max N | embeddings | encoder layers | decoder+head | total "
        "| total, token_kv_sharing=all |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, shape in PRESETS.items():
        c = counts[name]
        config = ConceptEncoderConfig(**shape, vocab_size=vocab_size)
        head = c["total"] - c["encoder.embeddings"] - c["encoder.layers"]
        lines.append(
            f"| {name} | {config.hidden_size} | {config.num_hidden_layers} | {config.num_attention_heads} "
            f"| {config.intermediate_size} | {config.concept_num} | {config.max_position_embeddings} "
            f"| {c['encoder.embeddings']:,} | {c['encoder.layers']:,} | {head:,} | {c['total']:,} "
            f"| {shared[name]['total']:,} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """`python -m concept_encoder presets [--vocab_size V]`: the preset table."""
    parser = argparse.ArgumentParser(prog="python -m concept_encoder presets", description=main.__doc__)
    parser.add_argument(
        "--vocab_size", type=at_least(1), default=30522, help="vocabulary size to count embeddings with"
    )
    print(format_preset_table(parser.parse_args(argv).vocab_size))
    return 0
