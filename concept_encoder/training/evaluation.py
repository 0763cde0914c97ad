"""Evaluation of a masked-LM Concept Encoder: masked-token loss, accuracy and concept health.

Shared by the loop (every `--eval_steps`) and `python -m concept_encoder check_health`, so a model
checked after training is measured exactly as the loop measured it.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from accelerate.utils import send_to_device

from ..concepts.health import HEALTH_KEYS, concept_health
from ..data.objectives import model_inputs, prepare_batch
from ..model.constants import IGNORE_INDEX


@torch.no_grad()
def most_frequent_token(split, tokenizer) -> int:
    """The id that occurs most often in `split`'s `input_ids`, special tokens left out: the unigram baseline
    ("always guess the text's most frequent token") a language model must beat on that text."""
    import collections

    specials = set(tokenizer.all_special_ids)
    counts: collections.Counter = collections.Counter()
    from datasets import Dataset

    rows = split["input_ids"] if isinstance(split, Dataset) else (example["input_ids"] for example in split)
    for ids in rows:
        counts.update(i for i in ids if i not in specials)
    if not counts:
        raise ValueError(
            "the evaluation text holds no token but special ones ([UNK], [CLS], ...): the tokenizer does not cover "
            "it; use a tokenizer trained on text like it, or other text"
        )
    return counts.most_common(1)[0][0]


@torch.no_grad()  # without it every batch's graph hangs on `totals`: memory grows with the batches evaluated
def evaluate(
    accelerator,
    model,
    loader,
    eval_collator,
    collator_state: dict,
    max_batches: int | None,
    health: bool = True,
    unigram_id: int | None = None,
) -> dict:
    """Loss, perplexity and masked-token accuracy over `loader`, weighted by masked-token count and
    gathered across ranks (duplicate samples that even out the last batch are dropped), plus the
    concept-health metrics (`concept_encoder.concepts.health`) averaged over batches and ranks (when
    `health` and the model has concepts). `eval_collator` may be any corruption of
    `concept_encoder.data.objectives` (e.g. diffusion at a fixed rate): the loss is then the plain
    cross-entropy at its labelled positions.
    `eval_collator` masks each padded batch, restarting from `collator_state`, so every evaluation
    sees the same masks. With `unigram_id` (`most_frequent_token`), the unigram baseline is scored on the
    same masked positions: `eval_unigram_accuracy` and `eval_accuracy_over_unigram` (the ratio)."""
    eval_collator.load_state_dict(collator_state)
    was_training = model.training
    model.eval()
    totals = torch.zeros(4, dtype=torch.float64, device=accelerator.device)
    health_sum = torch.zeros(len(HEALTH_KEYS), dtype=torch.float64, device=accelerator.device)
    has_concepts = False
    batches = 0
    for i, batch in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        batch, _, _ = model_inputs(send_to_device(prepare_batch(eval_collator.mask(batch)), accelerator.device))
        batch.pop("label_weights", None)  # evaluation reports the plain cross-entropy
        out = model(**batch)  # logits [L,V] at the L labelled positions
        labelled = batch["labels"] != IGNORE_INDEX  # [B,N]
        targets = batch["labels"][labelled]  # [L]
        ce = F.cross_entropy(out.logits.float(), targets, reduction="none")  # [L]
        correct = (out.logits.argmax(dim=-1) == targets).double()
        guessed = (targets == (-1 if unigram_id is None else unigram_id)).double()  # [L] the unigram baseline
        per_sample = torch.zeros(labelled.shape[0], 4, dtype=torch.float64, device=accelerator.device)  # [B,4]
        rows = labelled.nonzero()[:, 0]  # sample of each labelled position, matching the logits' order
        per_sample.index_add_(0, rows, torch.stack([ce.double(), torch.ones_like(ce).double(), correct, guessed], 1))
        totals += accelerator.gather_for_metrics(per_sample).sum(dim=0)
        if health and out.concepts is not None:
            values = concept_health(out.concepts)
            health_sum += torch.tensor(
                [float(values[k]) for k in HEALTH_KEYS], dtype=torch.float64, device=health_sum.device
            )
            has_concepts = True
        batches += 1
    health_sum = accelerator.reduce(health_sum / max(batches, 1), reduction="mean")
    model.train(was_training)
    loss = (totals[0] / totals[1].clamp(min=1)).item()
    return {
        "eval_loss": loss,
        "eval_perplexity": math.exp(min(loss, 50.0)),
        "eval_accuracy": (totals[2] / totals[1].clamp(min=1)).item(),
        "eval_masked_tokens": int(totals[1].item()),
        **({} if unigram_id is None else unigram_scores(totals)),
        **(
            {f"health/{k}": round(float(v), 6) for k, v in zip(HEALTH_KEYS, health_sum, strict=True)}
            if has_concepts
            else {}
        ),
    }


def unigram_scores(totals: torch.Tensor) -> dict[str, float]:
    """The unigram baseline's accuracy on the masked positions and the model's accuracy as a multiple of it."""
    unigram = (totals[3] / totals[1].clamp(min=1)).item()
    accuracy = (totals[2] / totals[1].clamp(min=1)).item()
    return {"eval_unigram_accuracy": unigram, "eval_accuracy_over_unigram": accuracy / unigram if unigram else math.nan}


@torch.no_grad()
def predict(accelerator, model, loader) -> tuple[np.ndarray, np.ndarray]:
    """`(logits [n,K], labels [n] or [n,K])` over `loader`, gathered across ranks (padding duplicates dropped)."""
    was_training = model.training
    model.eval()
    logits, labels = [], []
    for batch in loader:
        batch = send_to_device(batch, accelerator.device)
        out = model(**{k: v for k, v in batch.items() if k != "labels"})
        gathered_logits, gathered_labels = accelerator.gather_for_metrics((out.logits.float(), batch["labels"]))
        logits.append(gathered_logits.cpu().numpy())
        labels.append(gathered_labels.cpu().numpy())
    model.train(was_training)
    return np.concatenate(logits), np.concatenate(labels)
