"""AdamW with no-decay groups and a warmup schedule counted in optimizer steps."""

from __future__ import annotations

import torch
from torch import nn
from transformers import get_scheduler


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: biases, norm weights, embeddings and the concept vectors are not decayed."""
    decay, no_decay, seen = [], [], set()
    for _, module in model.named_modules():
        for name, param in module.named_parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue  # a tied weight is grouped where it is first met (the input embedding)
            seen.add(id(param))
            ndim = len(getattr(param, "ds_shape", param.shape))  # a ZeRO-3 partition is a flat shard
            is_matrix = ndim >= 2 and not isinstance(module, nn.Embedding) and name != "concepts"
            (decay if is_matrix else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(
    model: nn.Module, args, extra_params: list[nn.Parameter] | None = None, adamw=torch.optim.AdamW
) -> torch.optim.Optimizer:
    """AdamW over the decay/no-decay groups (`adamw`: the class, e.g. DeepSpeed's CPU Adam under offload)."""
    groups = parameter_groups(model, args.weight_decay)
    if extra_params:
        groups.append({"params": list(extra_params), "weight_decay": 0.0})
    return adamw(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)


def build_scheduler(optimizer: torch.optim.Optimizer, args):
    """Stepped once per optimizer step by the loop itself (not by accelerate, which would step it
    once per process), so warmup and decay are in optimizer steps whatever the world size."""
    name = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup"}[args.lr_scheduler_type]
    return get_scheduler(name, optimizer, num_warmup_steps=args.num_warmup_steps, num_training_steps=args.max_steps)
