"""AdamW with no-decay groups and a warmup schedule counted in optimizer steps."""

from __future__ import annotations

import logging
import math

import torch
from torch import nn
from transformers import get_scheduler

from ..common.faults import NonFiniteLossError

logger = logging.getLogger("concept_encoder")


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


# `--lr_scheduler_type` → transformers' `get_scheduler` name (wsd: warm-up, a constant stable phase, then a decay of
# `--decay_steps` to `--min_lr_ratio` of the peak at the last step; cosine with a floor: `cosine_with_min_lr`)
SCHEDULER_NAMES = {"cosine": "cosine", "linear": "linear", "constant": "constant_with_warmup",
                   "wsd": "warmup_stable_decay"}  # fmt: skip


def scheduler_for(optimizer: torch.optim.Optimizer, schedule: dict):
    """transformers' scheduler for `schedule` (`TrainingArguments.schedule`: type, warm-up steps, the step its
    decay ends at, and for wsd its decay's steps, shape and floor). A checkpoint's older record (no decay
    settings) means what it meant when written: no floor, decay to `decays_to_step`."""
    kind, floor = schedule["lr_scheduler_type"], schedule.get("min_lr_ratio") or 0.0
    name, extra = SCHEDULER_NAMES[kind], {}
    if kind == "wsd":
        extra = {
            "num_decay_steps": schedule["decay_steps"],
            "decay_type": schedule["decay_type"],
            "min_lr_ratio": floor,
        }
    elif kind == "cosine" and floor:
        name, extra = "cosine_with_min_lr", {"min_lr_rate": floor}
    return get_scheduler(name, optimizer, num_warmup_steps=schedule["warmup_steps"],
                         num_training_steps=schedule["decays_to_step"], scheduler_specific_kwargs=extra)  # fmt: skip


def build_scheduler(optimizer: torch.optim.Optimizer, args):
    """Stepped once per optimizer step by the loop itself (not by accelerate, which would step it
    once per process), so warmup and decay are in optimizer steps whatever the world size."""
    return scheduler_for(optimizer, args.schedule)


def rate_factors(schedule: dict, last_step: int) -> list[float]:
    """The fraction of the peak rate `schedule` gives at steps 0..`last_step` (the scheduler's own function)."""
    factor = scheduler_for(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), schedule).lr_lambdas[0]
    return [float(factor(step)) for step in range(last_step + 1)]


def describe_schedule(schedule: dict) -> str:
    """`schedule` in words, e.g. `wsd: warm-up 10, stable to step 900, 1-sqrt decay to 0 of the peak at step 1000`."""
    kind, warmup, end = schedule["lr_scheduler_type"], schedule["warmup_steps"], schedule["decays_to_step"]
    if kind == "constant":
        return f"constant after a warm-up of {warmup} steps"
    floor = schedule.get("min_lr_ratio") or 0
    if kind == "wsd":
        return (f"wsd: warm-up {warmup}, stable to step {end - schedule['decay_steps']}, {schedule['decay_type']} "
                f"decay to {floor:g} of the peak at step {end}")  # fmt: skip
    return f"{kind} decay to {floor:g} of the peak at step {end} after a warm-up of {warmup} steps"


def schedule_problem(saved: dict, current: dict, step: int) -> str | None:
    """Why a run resumed at `step` under `current` is not the run `current` would have been from its start: the
    rates the checkpoint's schedule `saved` gave up to `step` (the rate of the next update is in the optimizer's
    state) differ from `current`'s. None when they agree, so a constant or wsd run may be extended (or a wsd
    decay branched from a constant run) while it is in its stable phase, and a decaying schedule may not be
    lengthened. The first step that differs is named."""
    ran, planned = rate_factors(saved, step), rate_factors(current, step)
    for at, (was, would) in enumerate(zip(ran, planned, strict=True)):
        if abs(was - would) > 1e-9:
            return (
                f"schedule: the checkpoint ran {describe_schedule(saved)}, this run plans {describe_schedule(current)}; "
                f"their rates differ from step {at} on ({was:.4g} against {would:.4g} of the peak), before the "
                f"checkpoint's step {step}, so the resumed run would not be the run this plan makes from its start. "
                "A run meant to be trained further takes --lr_scheduler_type constant --warmup_steps N, or wsd "
                "(extendable while its stable phase lasts: before step max_steps - decay_steps)"
            )
    return None


def finish_step(
    accelerator, model, optimizer, max_grad_norm: float, loss_finite: torch.Tensor, logged: dict | None = None
) -> tuple[bool, float | None, dict[str, float]]:
    """The end of one optimizer step, after its backward passes: the gradient's norm (clipped to `max_grad_norm`
    when > 0), then the update, or none when the step's loss or gradient is not finite. `loss_finite` `[]` bool
    on the device says whether the loss is (agreed across ranks), `logged` maps names to `[]` tensors the loop
    logs. Returns (applied, norm, `logged` read as floats).

    One host sync: whether to update is the one thing the host must know of a step before the next (a skipped
    step's scheduler does not advance), so the loss's finiteness, the gradient norm and the logged values are read
    in one transfer (`read_on_host`); the norm is computed and the gradients clipped before it, whether or not the
    step is then applied (the clip of a skipped step's gradients changes nothing: they are cleared). Reading the
    logged values there costs nothing more: the host waits for the step anyway.

    Under fp16 without DeepSpeed, accelerate's `GradScaler` must see every step, skipped ones too: the clip
    unscales the gradients (`GradScaler.unscale_`, recorded per optimizer until `update()`), so a step that
    returned before `optimizer.step()` would leave that record and the next clip would raise "unscale_() has
    already been called". The dynamic scale starts at 2^16 and doubles after 2,000 clean steps, so every long fp16
    run overflows now and then, by design. So an overflowing gradient goes through `optimizer.step()` all the same:
    `GradScaler.step` sees the inf found while unscaling and skips the update, `update()` multiplies the scale by
    its backoff factor (0.5), and the run goes on (`--max_bad_steps` bounds how long). A non-finite loss whose
    gradient is finite (a cross-entropy's gradient does not depend on its value) is not stepped; the scale backs
    off by `update(new_scale)` (torch's public way, which leaves the count towards the next growth as it was, and
    clears the unscale record). The GradScaler reads its own values on the host (fp16 only: bf16 needs none).
    Under DeepSpeed its engine clips and its own fp16 loss scaler skips an overflow: only the norm is read."""
    from accelerate.utils import DistributedType

    logged = logged or {}
    scaler = getattr(accelerator, "scaler", None)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        values = read_on_host({"finite": loss_finite, **logged})
        if not values.pop("finite"):
            return False, None, values
        optimizer.step()
        norm = model.get_global_grad_norm()  # None where DeepSpeed computed none (ZeRO-0 without clipping)
        return True, None if norm is None else float(norm), values
    norm = accelerator.clip_grad_norm_(model.parameters(), max_grad_norm or math.inf)
    values = read_on_host({"finite": loss_finite, "norm": norm, **logged})
    finite, norm = values.pop("finite"), values.pop("norm")
    if not finite:
        if scaler is not None:
            scaler.update(scaler.get_scale() * scaler.get_backoff_factor())
        return False, None, values
    if not math.isfinite(norm):  # an Inf/NaN gradient with a finite loss: skipped like a non-finite loss
        if scaler is not None:
            optimizer.step()  # GradScaler skips it (the inf found while unscaling) and backs off
        return False, norm, values
    optimizer.step()
    return True, norm, values


def read_on_host(values: dict[str, torch.Tensor]) -> dict[str, float]:
    """`[]` tensors (one device) → their values as floats, read in one transfer: one host sync, not one each."""
    if not values:
        return {}
    stacked = torch.stack([value.detach().reshape(()).float() for value in values.values()])
    return dict(zip(values, stacked.tolist(), strict=True))


def loss_scale(accelerator) -> float:
    """The factor `accelerator.backward` multiplied the loss by (fp16's GradScaler), 1 without one: what
    gradients of parameters outside the model's optimizer must be divided by. Read before `finish_step`, whose
    `update()` may change it."""
    scaler = getattr(accelerator, "scaler", None)
    return 1.0 if scaler is None else float(scaler.get_scale())


def count_skipped_step(progress, applied: bool, what: str, max_bad_steps: int, advice: str) -> None:
    """`progress.bad_steps`: consecutive skipped steps; at `max_bad_steps` the run ends (`NonFiniteLossError`,
    one line naming `what` was not finite, the step, and `advice`), before anything is saved of them."""
    if applied:
        progress.bad_steps = 0
        return
    progress.bad_steps += 1
    logger.warning("non-finite %s at step %d (update skipped)", what, progress.step + 1)
    if progress.bad_steps >= max_bad_steps:
        raise NonFiniteLossError(
            f"the {what} was non-finite for {progress.bad_steps} consecutive steps, last at step {progress.step + 1}; "
            f"{advice}"
        )
