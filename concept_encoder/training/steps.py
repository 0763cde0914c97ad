"""The optimizer steps of the two loops: pretraining's (`loops/mlm.py`) and fine-tuning's (`loops/finetune.py`),
here rather than in the loops so that tools can run them as the loops do (`benchmarks/host_syncs.py` counts
their host syncs). Each loop calls its step `train_step`.

Neither step waits for the device in a micro-batch: what the host must know of a batch was found on the CPU
before it moved (`data.objectives.prepare_batch`, `batches.unpadded_or_marked`), and a step reads the device
once, at its end, for the update decision and the logged values together (`optim.finish_step`).
"""

from __future__ import annotations

import torch

from ..data.objectives import model_inputs
from .distill import Distillation
from .objective import ConceptObjective
from .optim import finish_step, loss_scale


def pretraining_step(
    accelerator,
    model,
    optimizer,
    window: list[dict],
    max_grad_norm: float,
    concept: ConceptObjective | None = None,
    step: int = 0,
    distill: Distillation | None = None,
) -> dict:
    """One optimizer step over `window` (the corrupted micro-batches of one accumulation window).

    Each micro-batch's loss is its (weighted) CE *sum* divided by the loss normaliser of the whole
    window on all ranks (`objectives.model_inputs`: masked tokens, or diffusion's eligible tokens),
    times `world × accumulation` to undo the averaging that gradient accumulation and data
    parallelism apply; the gradient is then exactly that of the step's token-normalised loss. With `distill`, the
    MLM term is weighted and the distillation term (a mean over the micro-batch) added (`training/distill.py`).
    Returns global sums for logging.

    No micro-batch waits for the device: what the host must know of a batch (its counts, its labelled slots,
    whether it is padded) was found on the CPU before it moved (`objectives.prepare_batch`, in the loop's masking;
    a window of unprepared batches is prepared here, a host sync each on an accelerator), the counts enter the
    step as kernel arguments (`torch.full`, no host copy), and the logged values are read with the step's one
    host sync, the update decision (`optim.finish_step`).
    """
    window = [(batch, *model_inputs(batch)) for batch in window]  # [(batch, inputs, normaliser, tokens)]
    device = accelerator.device
    counts = torch.full((), float(sum(normalizer for _, _, normalizer, _ in window)), device=device)
    labelled = accelerator.reduce(counts, reduction="sum")  # 0 when no rank masked a token (reported as such)
    window_labelled = labelled.clamp(min=1)
    scale = accelerator.num_processes * len(window) / window_labelled
    loss_sum = torch.zeros((), device=device)
    tokens = torch.full((), float(sum(batch_tokens for *_, batch_tokens in window)), device=device)
    terms: dict[str, torch.Tensor] = {}
    for whole, batch, _, _ in window:
        with accelerator.accumulate(model):
            out = model(**batch, return_logits=False)  # loss without the [L,V] logits
            ce_sum = out.loss_sum.float()
            objective = ce_sum * scale
            micro_terms = {}
            if distill is not None:
                objective, distilled = distill(objective, out, whole)
                micro_terms.update({f"distill/{name}": value for name, value in distilled.items()})
            if concept is not None and concept.active:
                objective, regularised = concept(objective, out.concepts, step)
                micro_terms.update({f"concept/{name}": value for name, value in regularised.items() if name != "mlm"})
            for name, value in micro_terms.items():
                terms[name] = terms.get(name, 0.0) + value / len(window)
            accelerator.backward(objective)
            loss_sum += ce_sum.detach()
    totals = accelerator.reduce(torch.stack([loss_sum, tokens]), reduction="sum")
    names = sorted(terms)
    if terms:
        means = accelerator.reduce(torch.stack([terms[n].to(device) for n in names]), reduction="mean")
        terms = dict(zip(names, means, strict=True))
    loss = totals[0] / window_labelled
    scaled_by = loss_scale(accelerator)  # fp16: the side optimizers' gradients carry it too
    logged = {"loss": loss, "labelled": labelled, "tokens": totals[1], **terms}
    applied, grad_norm, values = finish_step(accelerator, model, optimizer, max_grad_norm, loss.isfinite(), logged)
    optimizer.zero_grad(set_to_none=True)
    if concept is not None:
        concept.step(accelerator, apply=applied, loss_scale=scaled_by)
    if distill is not None:
        distill.step(accelerator, apply=applied, loss_scale=scaled_by)
    return {
        "applied": applied,
        "terms": {name: values[name] for name in names},
        "loss": values["loss"],
        "labelled": int(values["labelled"]),
        "tokens": int(values["tokens"]),
        "grad_norm": grad_norm,
    }


def finetuning_step(accelerator, model, optimizer, window: list[dict], max_grad_norm: float) -> dict:
    """One optimizer step over the micro-batches of `window`: {"loss": the last micro-batch's, "applied",
    "what"}. A step whose loss is not finite on any rank (agreed across ranks, so all skip together) or whose
    gradient is not is skipped as pretraining skips it (`optim.finish_step`: fp16's loss scale backs off); the
    loop ends the run after `--max_bad_steps` in a row, before any NaN weights are saved or reported. The step's
    one host sync reads that verdict, the gradient norm and the loss together (`optim.finish_step`); a micro-batch
    has none (its padding was found on the CPU: `batches.unpadded_or_marked`)."""
    broken = torch.zeros((), device=accelerator.device)  # 1 once a micro-batch's loss is not finite
    applied, norm, values = True, None, None
    for batch in window:
        with accelerator.accumulate(model):
            out = model(**batch)
            broken = torch.maximum(broken, (~torch.isfinite(out.loss.detach())).float())
            accelerator.backward(out.loss)
            if accelerator.sync_gradients:  # the window's last micro-batch: one host sync a step
                if accelerator.num_processes > 1:  # any rank's (accelerate reduces by sum or max, not min)
                    broken = accelerator.reduce(broken, reduction="max")
                applied, norm, values = finish_step(accelerator, model, optimizer, max_grad_norm, broken == 0,
                                                    {"loss": out.loss})  # fmt: skip
            optimizer.zero_grad(set_to_none=True)  # a no-op until the accumulation window is complete
    what = "loss" if norm is None and not applied else "gradient norm"
    loss = out.loss.item() if values is None else values["loss"]  # a window accelerate did not end: read alone
    return {"loss": loss, "applied": applied, "what": what}
