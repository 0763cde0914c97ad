"""The training loss: the MLM loss plus weighted concept regularisers, one small class per weighting.

For the terms L_0 = MLM and L_1..L_K = the concept losses in the order given:

- `fixed` (`FixedWeighting`): `total = L_0 + Σ_k w·r(step)·L_k`, with `w = concept_loss_weight` and the
  linear warm-up `r(step) = min(1, step / warmup_steps)` (`r = 1` when `warmup_steps == 0`).
- `learnable` (`LearnableWeighting`): `total = Σ_i w_i L_i` with `w = (K+1)·softmax(weight_logits)`, so the
  K+1 weights sum to K+1 and all start at 1. Minimising this jointly drifts weight towards the smallest
  term; it is offered for comparison, `kendall_gal` is the principled variant.
- `kendall_gal` (`KendallGalWeighting`): uncertainty weighting (Kendall, Gal & Cipolla, 2018),
  `total = Σ_i exp(-s_i) L_i + s_i`, with learnable log-variances `s = log_vars`, initialised to 0.

Usage::

    loss = ConceptRegularizedLoss(["orthogonality"], concept_num=C, hidden_size=H, concept_loss_weight=0.1)
    total, terms = loss(out.loss, out.concepts, step)   # total [], terms: name -> detached [] float32
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from ..constants import LOSS_WEIGHTING_NAMES, check_concept_loss_settings, check_table_covers
from .losses import CONCEPT_LOSSES

# Losses whose optimum needs C mutually orthogonal vectors in H dimensions: unreachable for C > H.
ORTHOGONALITY_LOSSES = frozenset({"orthogonality", "soft_orthogonality"})


class FixedWeighting(nn.Module):
    """`losses [K+1]` (MLM first) → `L_0 + w·r(step)·Σ_k L_k`; no parameters."""

    def __init__(self, num_concept_losses: int, concept_loss_weight: float = 0.1, warmup_steps: int = 0):
        super().__init__()
        self.concept_loss_weight = float(concept_loss_weight)
        self.warmup_steps = int(warmup_steps)

    def warmup_factor(self, step: int) -> float:
        """`min(1, step / warmup_steps)`, or 1 when `warmup_steps == 0`."""
        if step < 0:
            raise ValueError(f"step={step} must be >= 0 (the optimizer step count)")
        return 1.0 if self.warmup_steps == 0 else min(1.0, step / self.warmup_steps)

    def forward(self, losses: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """`losses [K+1]` float32 → (total `[]`, weights `[K+1]` detached, extra logged terms)."""
        weight = self.concept_loss_weight * self.warmup_factor(step)
        total = losses[0] + weight * losses[1:].sum()
        weights = torch.cat([losses.new_ones(1), losses.new_full((len(losses) - 1,), weight)])  # no host copy
        return total, weights, {}

    def extra_repr(self) -> str:
        return f"concept_loss_weight={self.concept_loss_weight}, warmup_steps={self.warmup_steps}"


class LearnableWeighting(nn.Module):
    """`losses [K+1]` → `Σ_i w_i L_i`, `w = (K+1)·softmax(weight_logits [K+1])`."""

    def __init__(self, num_concept_losses: int, **_unused_fixed_settings):
        super().__init__()
        self.weight_logits = nn.Parameter(torch.zeros(num_concept_losses + 1))

    def forward(self, losses: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
        weights = len(losses) * self.weight_logits.float().softmax(dim=0)  # [K+1], sums to K+1
        return (weights * losses).sum(), weights.detach(), {}


class KendallGalWeighting(nn.Module):
    """`losses [K+1]` → `Σ_i exp(-s_i) L_i + s_i`, `s = log_vars [K+1]`; logs each `log_var/<name>`."""

    def __init__(self, num_concept_losses: int, **_unused_fixed_settings):
        super().__init__()
        self.log_vars = nn.Parameter(torch.zeros(num_concept_losses + 1))

    def forward(self, losses: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor, dict]:
        log_vars = self.log_vars.float()
        weights = torch.exp(-log_vars)
        return (weights * losses + log_vars).sum(), weights.detach(), {"log_var": log_vars.detach()}


LOSS_WEIGHTINGS: dict[str, type[nn.Module]] = {
    "fixed": FixedWeighting,
    "learnable": LearnableWeighting,
    "kendall_gal": KendallGalWeighting,
}
check_table_covers(LOSS_WEIGHTINGS, LOSS_WEIGHTING_NAMES, "LOSS_WEIGHTINGS")


class ConceptRegularizedLoss(nn.Module):
    """MLM loss plus the named concept regularisers, combined by one weighting of `LOSS_WEIGHTINGS`.

    The learnable weights (`weighting.weight_logits` / `weighting.log_vars`, `[K+1]`) are parameters of
    `weighting`, so they are in `state_dict()`. With no concept losses the MLM loss passes through
    unchanged and there are no parameters. `concept_loss_weight` and `warmup_steps` apply to `fixed` only.

    Args:
        concept_losses: names from `CONCEPT_LOSSES`, e.g. `["orthogonality", "uniformity"]`.
        concept_num: C, the number of concepts (checked against the concepts passed to `forward`).
        hidden_size: H, the concept width (checked likewise).
        weighting: a name of `LOSS_WEIGHTINGS`.
        concept_loss_weight: w in `fixed` mode, the weight of each concept loss after warm-up.
        warmup_steps: steps of the linear warm-up of the concept weights in `fixed` mode.
        loss_kwargs: optional keyword arguments per loss name, e.g. `{"uniformity": {"temperature": 1.0}}`.
    """

    def __init__(
        self,
        concept_losses: Sequence[str] = (),
        *,
        concept_num: int,
        hidden_size: int,
        weighting: str = "fixed",
        concept_loss_weight: float = 0.1,
        warmup_steps: int = 0,
        loss_kwargs: Mapping[str, Mapping[str, float]] | None = None,
    ):
        super().__init__()
        names = [concept_losses] if isinstance(concept_losses, str) else list(concept_losses)
        check_concept_loss_settings(names, weighting, concept_loss_weight, warmup_steps)
        if concept_num < 1 or hidden_size < 1:
            raise ValueError(f"concept_num={concept_num} and hidden_size={hidden_size} must both be >= 1")
        loss_kwargs = {name: dict(kwargs) for name, kwargs in (loss_kwargs or {}).items()}
        stray = [name for name in loss_kwargs if name not in names]
        if stray:
            raise ValueError(f"loss_kwargs given for {stray}, which are not in concept_losses={names}")
        for name in ORTHOGONALITY_LOSSES.intersection(names):
            if concept_num > hidden_size:
                warnings.warn(
                    f"concept loss {name!r} with concept_num={concept_num} > hidden_size={hidden_size}: at most "
                    f"{hidden_size} vectors can be mutually orthogonal, so it cannot reach 0 and keeps pushing; "
                    "use concept_num <= hidden_size, or a loss without that limit (uniformity, nn_spread)",
                    UserWarning,
                    stacklevel=2,
                )
        self.concept_losses = names
        self.concept_num = concept_num
        self.hidden_size = hidden_size
        self.weighting_name = weighting
        self.loss_kwargs = loss_kwargs
        self.weighting = LOSS_WEIGHTINGS[weighting if names else "fixed"](
            len(names), concept_loss_weight=concept_loss_weight, warmup_steps=warmup_steps
        )

    def forward(
        self, mlm_loss: torch.Tensor, concepts: torch.Tensor | None, step: int
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Combine the MLM loss with the concept losses.

        Args:
            mlm_loss: `[]` MLM loss of this (micro-)batch.
            concepts: `[B,C,H]` final concepts (may be None when there are no concept losses).
            step: optimizer step count, for the `fixed` warm-up.

        Returns:
            `(total [], terms)`: `terms` maps `"mlm"` and each concept loss name to its unweighted value,
            and `"weight/<name>"` to the weight applied to it (plus `"log_var/<name>"` for `kendall_gal`);
            all are detached `[]` float32 tensors.
        """
        terms: dict[str, torch.Tensor] = {"mlm": mlm_loss.detach().float()}
        if not self.concept_losses:
            return mlm_loss, terms
        if concepts is None:
            raise ValueError(f"concepts [B,C,H] are required for the concept losses {self.concept_losses}")
        if concepts.dim() != 3 or tuple(concepts.shape[1:]) != (self.concept_num, self.hidden_size):
            raise ValueError(
                f"concepts shape {tuple(concepts.shape)} does not match [B, concept_num={self.concept_num}, "
                f"hidden_size={self.hidden_size}]; build the loss from the model config's concept_num "
                "and hidden_size"
            )
        values = [CONCEPT_LOSSES[name](concepts, **self.loss_kwargs.get(name, {})) for name in self.concept_losses]
        terms.update({name: value.detach() for name, value in zip(self.concept_losses, values, strict=True)})
        total, weights, extra = self.weighting(torch.stack([mlm_loss.float(), *values]), step)  # [K+1] in
        all_names = ["mlm", *self.concept_losses]
        for key, per_term in extra.items():
            terms.update({f"{key}/{name}": value for name, value in zip(all_names, per_term, strict=True)})
        terms.update({f"weight/{name}": weight for name, weight in zip(all_names, weights, strict=True)})
        return total, terms

    def extra_repr(self) -> str:
        return (
            f"concept_losses={self.concept_losses}, weighting={self.weighting_name!r}, "
            f"concept_num={self.concept_num}, hidden_size={self.hidden_size}"
        )
