"""Linear probes: what a model's frozen features already hold, without the fine-tuning optimiser's confound.

The encoder of the fine-tuning classifier (`model.base_model`, pretrained or `--from_scratch`) runs once over
each split with no gradient; a linear model (`concept_encoder.tasks.linear.fit_linear`, C chosen on dev,
features standardised on train) is fitted on the features. Feature sets:

- any Hugging Face encoder: `hidden mean`, the mean of the last hidden states over non-padding tokens;
- a Concept Encoder: `concepts mean`, the mean of its output concepts `[B,C,H] → [B,H]`, and `embeddings
  mean`, the mean of its input word embeddings over non-padding tokens: the bag of embeddings the concept
  bottleneck starts from, so the probe shows whether the concepts keep more or less than that bag.
"""

from __future__ import annotations

import inspect

import numpy as np
import torch

from ..accounting.architectures import CONCEPT_MODEL_TYPE
from ..tasks.linear import fit_linear, label_arrays


def masked_mean(states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`states [B,N,H]`, `mask [B,N]` (1 = real token) → the mean over real tokens `[B,H]`."""
    weights = mask.to(states.dtype).unsqueeze(-1)  # [B,N,1]
    return (states * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)


@torch.inference_mode()
def frozen_features(model, loader, device: torch.device) -> dict[str, np.ndarray]:
    """Feature set name → `[n,H]` array over `loader`'s batches (in order), from `model.base_model` in eval mode."""
    base = model.base_model
    was_training = base.training
    base.eval()
    accepted = set(inspect.signature(base.forward).parameters)
    concept = model.config.model_type == CONCEPT_MODEL_TYPE
    chunks: dict[str, list[np.ndarray]] = {}
    for batch in loader:
        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items() if k in accepted}
        mask = inputs.get("attention_mask", torch.ones_like(inputs["input_ids"]))  # [B,N]
        hidden = base(**inputs).last_hidden_state  # concept: [B,C,H]; token encoder: [B,N,H]
        if concept:
            found = {
                "concepts mean": hidden.mean(dim=1),  # [B,H]
                "embeddings mean": masked_mean(base.get_input_embeddings()(inputs["input_ids"]), mask),  # [B,H]
            }
        else:
            found = {"hidden mean": masked_mean(hidden, mask)}  # [B,H]
        for name, values in found.items():
            chunks.setdefault(name, []).append(values.float().cpu().numpy())
    base.train(was_training)
    return {name: np.concatenate(parts) for name, parts in chunks.items()}


def linear_probe(model, loaders: dict, splits: dict, task, device: torch.device) -> dict[str, dict]:
    """Feature set name → `fit_linear`'s result (grid of C on dev, chosen C, dev and validation metrics).

    `loaders`: split → an unshuffled loader over `splits[split]` (the encoded `train`, `dev`, `validation`)."""
    labels = label_arrays(splits)
    per_split = {name: frozen_features(model, loader, device) for name, loader in loaders.items()}
    feature_sets = per_split["train"].keys()
    return {
        name: fit_linear(
            task.task_type,
            task.metric_names,
            {s: per_split[s][name] for s in per_split},
            labels,
            standardize=True,
            positions=task.validation_positions,  # the linear probe of the concepts for the needle's class
        )
        for name in feature_sets
    }


def describe_pooling(model, chunk_length: int | None = None, pooling: str = "auto") -> str:
    """How the fine-tuning classifier turns an encoder's output into one vector (a confound of any
    comparison between architectures, so the report names it); `chunk_length`: read in chunks (`chunked.py`),
    `pooling` `mean` for a token encoder: its mean token state."""
    config = model.config
    if chunk_length:
        return f"mean token state of each {chunk_length}-token chunk, mean over chunks → pooler dense+tanh"
    if config.model_type == CONCEPT_MODEL_TYPE:
        how = {"weighted": "learned softmax weights over concepts", "mean": "mean of concepts",
               "cls": "[CLS] token refined by the concepts"}  # fmt: skip
        return f"{how.get(config.classifier_pooling, config.classifier_pooling)} → dense+tanh"
    if getattr(model.base_model, "pooler", None) is not None:
        return f"{'mean token state' if pooling == 'mean' else '[CLS]'} → pooler dense+tanh"
    return f"{type(model).__name__}'s own head"
