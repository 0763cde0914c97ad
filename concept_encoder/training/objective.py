"""The loop's view of the concept regularisers: a `ConceptRegularizedLoss` plus an optimizer for its own weights."""

from __future__ import annotations

import logging

import torch

from ..concepts.weighting import ConceptRegularizedLoss

logger = logging.getLogger("concept_encoder")


def step_own_parameters(accelerator, parameters, optimizer, apply: bool, loss_scale: float = 1.0) -> None:
    """Step parameters a loss owns outside the model (DDP and DeepSpeed average and step the model's only): their
    gradients averaged over ranks and divided by `loss_scale` (fp16's GradScaler multiplied the loss by it, and it
    unscales only the model's optimizer: `optim.loss_scale`), then `optimizer` stepped when `apply` (the model's
    step was applied) and, under fp16 (where an overflow may reach these gradients alone), they are finite;
    gradients cleared."""
    grads = []
    for param in parameters:
        if param.grad is not None:
            param.grad = accelerator.reduce(param.grad, reduction="mean") / loss_scale
            grads.append(param.grad)
    overflowed = loss_scale != 1.0 and grads and not bool(torch.stack([g.isfinite().all() for g in grads]).all())
    if apply and not overflowed:  # (checked under fp16 only: one host sync a step)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class ConceptObjective:
    """Adds the concept losses to each micro-batch objective and trains the learned loss weights.

    The `learnable` and `kendall_gal` weights belong to the loss, not to the model, so
    neither DDP nor DeepSpeed (which own the model's parameters only) would average or step them.
    They get their own small AdamW here, stepped with the model's optimizer after their gradients
    are averaged over ranks. `state_dict()` covers both, for `register_for_checkpointing`.
    """

    def __init__(self, loss: ConceptRegularizedLoss, learning_rate: float, device: torch.device):
        self.loss = loss.to(device)
        params = list(loss.parameters())
        self.optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0) if params else None

    @property
    def active(self) -> bool:
        return bool(self.loss.concept_losses)

    def __call__(self, objective: torch.Tensor, concepts: torch.Tensor, step: int):
        """`objective []` (the micro-batch's scaled MLM term), `concepts [B,C,H]` → (total [], terms)."""
        return self.loss(objective, concepts, step)

    def step(self, accelerator, apply: bool, loss_scale: float = 1.0) -> None:
        if self.optimizer is not None:
            step_own_parameters(accelerator, self.loss.parameters(), self.optimizer, apply, loss_scale)

    def state_dict(self) -> dict:
        # "manager" holds the weighting's own parameters under their plain names ("log_vars", ...):
        # the checkpoint format of the first release, kept so its checkpoints still resume.
        return {
            "manager": self.loss.weighting.state_dict(),
            "optimizer": None if self.optimizer is None else self.optimizer.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.loss.weighting.load_state_dict(state["manager"])
        if self.optimizer is not None and state["optimizer"] is not None:
            self.optimizer.load_state_dict(state["optimizer"])


OBJECTIVE_LOSSES = {
    "mlm": "sparse masked-token cross-entropy (mean over the masked tokens of each optimizer step)",
    "diffusion": "masked diffusion, rates t ~ U({t_min}, 1), cross-entropy at the masked tokens weighted "
    "{diffusion_weighting} (elbo: 1/t, divided by the eligible tokens of the step)",
    "tsdae": "TSDAE: {deletion_rate:.0%} of tokens deleted, cross-entropy of every token of the original "
    "(mean over the step's tokens)",
    "distill": "{mlm_weight:g} x sparse masked-token cross-entropy + {distill_weight:g} x distillation ({distill_loss}) "
    "of the pooled student, projected, to {teacher}'s sentence embeddings",
}


def build_concept_objective(args, model_config, device) -> ConceptObjective:
    """Step 7's loss config: `--concept_losses`, `--loss_weighting`, weights and warm-up; logged."""
    loss = ConceptRegularizedLoss(
        args.concept_loss_names,
        concept_num=getattr(model_config, "concept_num", 1),  # BERT has none (and no concept losses)
        hidden_size=model_config.hidden_size,
        weighting=args.loss_weighting,
        concept_loss_weight=args.concept_loss_weight,
        warmup_steps=args.concept_loss_warmup_steps,
    )
    if loss.concept_losses and model_config.hidden_dropout_prob > 0:
        logger.warning(
            "concept losses with hidden_dropout_prob=%s: the model can satisfy them with dropout noise alone "
            "(concepts spread in training, collapsed in eval; seen on the embedded corpus). "
            "Consider --hidden_dropout_prob 0 and read the eval health metrics, which run without dropout.",
            model_config.hidden_dropout_prob,
        )
    logger.info(
        "loss: %s%s",
        OBJECTIVE_LOSSES[getattr(args, "objective", "mlm")].format(**vars(args)),
        f" + concept losses {loss.concept_losses} weighted {loss.weighting_name!r} ({loss.weighting.extra_repr()})"
        if loss.concept_losses
        else "",
    )
    return ConceptObjective(loss, args.learning_rate, device)
