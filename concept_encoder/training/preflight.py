"""Step 4's preflight: what can be checked from the arguments fails here, in about a second, before
the data and the model are built (types and ranges are already checked by the argument dataclasses)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from .plan import output_dir_problem


def effective_precision(mixed_precision: str | None) -> str:
    """`--mixed_precision`, else the one `accelerate launch` passes on (its config or flag), else no."""
    return mixed_precision or os.environ.get("ACCELERATE_MIXED_PRECISION") or "no"


def preflight(model_args, data_args, training_args, device) -> None:
    """ValueError naming the first argument this run cannot work with on `device`."""
    if problem := output_dir_problem(training_args.output_dir):
        raise ValueError(f"{problem}; choose another --output_dir")
    precision = effective_precision(training_args.mixed_precision)
    if precision == "fp16" and device.type != "cuda":
        raise ValueError(
            f"mixed precision fp16 needs a CUDA GPU and this run is on {device.type}; "
            "use --mixed_precision bf16 (supported on CPU) or no"
        )
    if precision == "bf16" and device.type == "cuda":
        import torch

        if not torch.cuda.is_bf16_supported():
            raise ValueError("this GPU does not support bf16 (compute capability < 8.0); use --mixed_precision fp16")
    if model_args.model_name_or_path:
        config_path = Path(model_args.model_name_or_path) / "config.json"
        if not config_path.is_file():
            raise ValueError(
                f"--model_name_or_path {model_args.model_name_or_path} holds no config.json; "
                "pass a folder written by save_pretrained (e.g. Cache/runs/<run>/final)"
            )
        positions = json.loads(config_path.read_text()).get("max_position_embeddings")
        if positions is not None and data_args.max_seq_length > positions:
            raise ValueError(
                f"max_seq_length={data_args.max_seq_length} exceeds the model's max_position_embeddings="
                f"{positions}; lower --max_seq_length"
            )
