"""Concept regularisation losses and `LossManager`, which adds them to the MLM loss.

Every loss takes the final concepts `concepts [B,C,H]` (B samples, C = concept_num, H = hidden_size)
and returns a scalar `[]` float32 tensor: lower means more spread-out concepts. Inputs in bf16/fp16
are upcast and autocast is switched off inside, because cosines near ±1 and small variances lose
most of their digits in half precision.

Pairwise losses (orthogonality, soft_orthogonality, uniformity, nn_spread) act within each sample on
its C×C concept pairs, then average over the batch. VICReg terms (variance, covariance) act across the
flattened concept vectors `[B*C,H]`, i.e. they look at how each hidden dimension is used batch-wide.

Combining with the MLM loss::

    manager = LossManager(["orthogonality"], concept_num=C, hidden_size=H, concept_loss_weight=0.1, warmup_steps=1000)
    total, terms = manager(out.loss, out.concepts, step)   # total [], terms: name -> detached [] float32
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "CONCEPT_LOSSES",
    "ORTHOGONALITY_LOSSES",
    "WEIGHTING_MODES",
    "LossManager",
    "check_concepts",
    "covariance_loss",
    "nearest_neighbour_spread_loss",
    "orthogonality_loss",
    "pairwise_cosine",
    "soft_orthogonality_loss",
    "uniformity_loss",
    "variance_loss",
    "vicreg_loss",
]


def check_concepts(concepts: torch.Tensor, caller: str) -> torch.Tensor:
    """Validate `concepts [B,C,H]` (floating point) and return it as float32."""
    if not isinstance(concepts, torch.Tensor):
        raise TypeError(f"{caller}: concepts must be a torch.Tensor [B,C,H], got {type(concepts).__name__}")
    if concepts.dim() != 3 or concepts.numel() == 0:
        raise ValueError(
            f"{caller}: concepts must be a non-empty [B,C,H] tensor (batch, concept_num, hidden_size), got shape "
            f"{tuple(concepts.shape)}; pass the model output's `concepts` (or the backbone's last_hidden_state), "
            "and add a batch dimension with concepts.unsqueeze(0) for a single sample"
        )
    if not concepts.is_floating_point():
        raise TypeError(f"{caller}: concepts must be a floating-point tensor, got dtype {concepts.dtype}")
    return concepts.float()


@contextlib.contextmanager
def full_precision(device: torch.device) -> Iterator[None]:
    """Switch autocast off so float32 inputs stay float32 inside a bf16/fp16 autocast region."""
    with torch.autocast(device_type=device.type, enabled=False):
        yield


def pairwise_cosine(concepts: torch.Tensor) -> torch.Tensor:
    """`concepts [B,C,H]` float → cosine similarities `[B,C,C]` (an all-zero concept has cosine 0 with everything)."""
    unit = F.normalize(concepts, dim=-1, eps=1e-8)
    return unit @ unit.transpose(1, 2)


def _offdiag_mask(concept_num: int, device: torch.device) -> torch.Tensor:
    """`[C,C]` bool, True off the diagonal."""
    return ~torch.eye(concept_num, dtype=torch.bool, device=device)


def _zero(concepts: torch.Tensor) -> torch.Tensor:
    """A `[]` zero still connected to the graph (DDP/ZeRO expect a gradient, even a zero one)."""
    return concepts.sum() * 0.0


def orthogonality_loss(concepts: torch.Tensor) -> torch.Tensor:
    """Mean squared off-diagonal cosine similarity.

    `concepts [B,C,H]` → `[]`::

        L = 1/B Σ_b  1/(C(C-1)) Σ_{i≠j} cos(c_bi, c_bj)²

    0 when each sample's concepts are mutually orthogonal (possible only when C ≤ H), 1 when they are
    all parallel. 0 for C = 1 (no pairs).
    """
    with full_precision(concepts.device):
        x = check_concepts(concepts, "orthogonality_loss")
        if x.shape[1] < 2:
            return _zero(x)
        cos = pairwise_cosine(x)  # [B,C,C]
        return cos[:, _offdiag_mask(x.shape[1], x.device)].pow(2).mean()


def soft_orthogonality_loss(concepts: torch.Tensor, threshold: float = 0.1) -> torch.Tensor:
    """Squared excess of |cosine| over a tolerance, so near-orthogonal pairs cost nothing.

    `concepts [B,C,H]` → `[]`::

        L = 1/B Σ_b  1/(C(C-1)) Σ_{i≠j} relu(|cos(c_bi, c_bj)| - threshold)²

    Unlike `orthogonality_loss` this can reach 0 with C > H when `threshold` is large enough for C
    almost-orthogonal directions to exist in H dimensions.
    """
    if not 0.0 <= threshold < 1.0:
        raise ValueError(f"soft_orthogonality_loss: threshold={threshold} must be in [0, 1); typical values 0.05-0.3")
    with full_precision(concepts.device):
        x = check_concepts(concepts, "soft_orthogonality_loss")
        if x.shape[1] < 2:
            return _zero(x)
        cos = pairwise_cosine(x)[:, _offdiag_mask(x.shape[1], x.device)]  # [B,C(C-1)]
        return F.relu(cos.abs() - threshold).pow(2).mean()


def uniformity_loss(concepts: torch.Tensor, temperature: float = 2.0) -> torch.Tensor:
    """Uniformity on the unit hypersphere (Wang & Isola, 2020), per sample, averaged over the batch.

    `concepts [B,C,H]` → `[]`, with z = c / ||c|| and t = `temperature`::

        L = 1/B Σ_b  log( 1/(C(C-1)) Σ_{i≠j} exp(-t ||z_bi - z_bj||²) )

    0 when all concepts of a sample coincide, -2t when they are mutually orthogonal (||z_i - z_j||² = 2),
    lower still when they spread beyond orthogonal (possible for C > H). 0 for C = 1 (no pairs).
    """
    if temperature <= 0:
        raise ValueError(f"uniformity_loss: temperature={temperature} must be > 0; Wang & Isola use t=2")
    with full_precision(concepts.device):
        x = check_concepts(concepts, "uniformity_loss")
        c = x.shape[1]
        if c < 2:
            return _zero(x)
        # ||z_i - z_j||² = 2 - 2 cos for unit vectors: no cdist, whose sqrt has no gradient at 0.
        sq_dist = (2.0 - 2.0 * pairwise_cosine(x)).clamp(min=0.0)  # [B,C,C]
        logits = (-temperature * sq_dist).masked_fill(~_offdiag_mask(c, x.device), float("-inf"))
        per_sample = torch.logsumexp(logits.flatten(1), dim=1) - math.log(c * (c - 1))  # [B]
        return per_sample.mean()


def variance_loss(concepts: torch.Tensor, gamma: float = 1.0, eps: float = 1e-4) -> torch.Tensor:
    """VICReg variance term over the flattened concepts `[B*C,H]`.

    `concepts [B,C,H]` → `[]`, with Var the unbiased variance of hidden dimension d over all B*C vectors::

        L = 1/H Σ_d relu(gamma - sqrt(Var_d + eps))

    Pushes every hidden dimension to a standard deviation of at least `gamma`; ≈ gamma when all
    concepts are identical. Needs B*C ≥ 2.
    """
    with full_precision(concepts.device):
        x = check_concepts(concepts, "variance_loss").flatten(0, 1)  # [B*C,H]
        if x.shape[0] < 2:
            raise ValueError(
                f"variance_loss needs at least 2 concept vectors (B*C >= 2), got B*C={x.shape[0]}; "
                "use a larger batch or concept_num"
            )
        std = torch.sqrt(x.var(dim=0) + eps)  # [H]
        return F.relu(gamma - std).mean()


def covariance_loss(concepts: torch.Tensor) -> torch.Tensor:
    """VICReg covariance term over the flattened concepts `[B*C,H]`.

    `concepts [B,C,H]` → `[]`, with Cov the unbiased `[H,H]` covariance of the B*C vectors::

        L = 1/H Σ_{d≠e} Cov_{de}²

    Decorrelates hidden dimensions, so concepts do not collapse onto a few directions. Needs B*C ≥ 2.
    """
    with full_precision(concepts.device):
        x = check_concepts(concepts, "covariance_loss").flatten(0, 1)  # [B*C,H]
        n, h = x.shape
        if n < 2:
            raise ValueError(
                f"covariance_loss needs at least 2 concept vectors (B*C >= 2), got B*C={n}; "
                "use a larger batch or concept_num"
            )
        centred = x - x.mean(dim=0, keepdim=True)
        cov = centred.T @ centred / (n - 1)  # [H,H]
        return cov[_offdiag_mask(h, x.device)].pow(2).sum() / h


def vicreg_loss(concepts: torch.Tensor, gamma: float = 1.0, eps: float = 1e-4) -> torch.Tensor:
    """VICReg regulariser without the invariance term: `variance_loss + covariance_loss` (each weight 1).

    `concepts [B,C,H]` → `[]`.
    """
    return variance_loss(concepts, gamma=gamma, eps=eps) + covariance_loss(concepts)


def nearest_neighbour_spread_loss(concepts: torch.Tensor) -> torch.Tensor:
    """Negative mean distance from each concept to its nearest other concept of the same sample.

    `concepts [B,C,H]` → `[]`, with z = c / ||c||::

        L = -1/B Σ_b  1/C Σ_i  min_{j≠i} ||z_bi - z_bj||

    0 when some concepts coincide, -sqrt(2) when all are mutually orthogonal. Only the closest pair
    of each concept gets a gradient, so it targets duplicates directly. 0 for C = 1 (no pairs).
    """
    with full_precision(concepts.device):
        x = check_concepts(concepts, "nearest_neighbour_spread_loss")
        c = x.shape[1]
        if c < 2:
            return _zero(x)
        sq_dist = (2.0 - 2.0 * pairwise_cosine(x)).masked_fill(~_offdiag_mask(c, x.device), float("inf"))
        nearest_sq = sq_dist.min(dim=-1).values  # [B,C]
        # The clamp keeps sqrt's gradient finite when two concepts coincide.
        return -nearest_sq.clamp(min=1e-12).sqrt().mean()


CONCEPT_LOSSES: dict[str, Callable[..., torch.Tensor]] = {
    "orthogonality": orthogonality_loss,
    "soft_orthogonality": soft_orthogonality_loss,
    "uniformity": uniformity_loss,
    "variance": variance_loss,
    "covariance": covariance_loss,
    "vicreg": vicreg_loss,
    "nn_spread": nearest_neighbour_spread_loss,
}

# Losses whose optimum needs C mutually orthogonal vectors in H dimensions: unreachable for C > H.
ORTHOGONALITY_LOSSES = frozenset({"orthogonality", "soft_orthogonality"})

WEIGHTING_MODES = ("fixed", "learnable", "kendall_gal")


class LossManager(nn.Module):
    """MLM loss plus weighted concept regularisers.

    Weighting modes, for the terms L_0 = MLM and L_1..L_K = the concept losses in the given order:

    - `fixed`: `total = L_0 + Σ_k w·r(step)·L_k`, with `w = concept_loss_weight` and the linear warm-up
      `r(step) = min(1, step / warmup_steps)` (`r = 1` when `warmup_steps == 0`).
    - `learnable`: `total = Σ_i w_i L_i` with `w = (K+1)·softmax(weight_logits)`, so the K+1 weights sum
      to K+1 and all start at 1. Minimising this jointly drifts weight towards the smallest term; it is
      offered for comparison, `kendall_gal` is the principled variant.
    - `kendall_gal`: uncertainty weighting (Kendall, Gal & Cipolla, 2018),
      `total = Σ_i exp(-s_i) L_i + s_i`, with learnable log-variances `s = log_vars`, initialised to 0.

    The learnable `weight_logits [K+1]` / `log_vars [K+1]` are `nn.Parameter`s, so they are in
    `state_dict()`; give `manager.parameters()` to the optimizer and pass the manager to
    `accelerator.prepare` (or `accelerator.register_for_checkpointing`) so `save_state` keeps them.
    `concept_loss_weight` and `warmup_steps` apply to `fixed` only. With no concept losses the MLM
    loss passes through unchanged in every mode and there are no parameters.

    Args:
        concept_losses: names from `CONCEPT_LOSSES`, e.g. `["orthogonality", "uniformity"]`.
        concept_num: C, the number of concepts (checked against the concepts passed to `forward`).
        hidden_size: H, the concept width (checked likewise).
        weighting: one of `WEIGHTING_MODES`.
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
        if isinstance(concept_losses, str):
            concept_losses = [concept_losses]
        names = list(concept_losses)
        valid = ", ".join(CONCEPT_LOSSES)
        unknown = [name for name in names if name not in CONCEPT_LOSSES]
        if unknown:
            raise ValueError(f"unknown concept loss(es) {unknown}; valid names: {valid}")
        duplicates = sorted({name for name in names if names.count(name) > 1})
        if duplicates:
            raise ValueError(f"concept loss(es) {duplicates} listed more than once; list each loss once")
        if weighting not in WEIGHTING_MODES:
            raise ValueError(f"unknown weighting {weighting!r}; valid modes: {', '.join(WEIGHTING_MODES)}")
        if concept_num < 1 or hidden_size < 1:
            raise ValueError(f"concept_num={concept_num} and hidden_size={hidden_size} must both be >= 1")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps} must be >= 0 (0 = full concept loss weight from step 0)")
        if concept_loss_weight < 0:
            raise ValueError(f"concept_loss_weight={concept_loss_weight} must be >= 0")
        if warmup_steps > 0 and weighting != "fixed":
            raise ValueError(
                f"warmup_steps={warmup_steps} applies to weighting='fixed' only; with weighting={weighting!r} "
                "the weights are learned, so set warmup_steps=0"
            )
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
        self.weighting = weighting
        self.concept_loss_weight = float(concept_loss_weight)
        self.warmup_steps = int(warmup_steps)
        self.loss_kwargs = loss_kwargs
        self.weight_logits: nn.Parameter | None = None
        self.log_vars: nn.Parameter | None = None
        if names and weighting == "learnable":
            self.weight_logits = nn.Parameter(torch.zeros(len(names) + 1))
        if names and weighting == "kendall_gal":
            self.log_vars = nn.Parameter(torch.zeros(len(names) + 1))

    def warmup_factor(self, step: int) -> float:
        """`min(1, step / warmup_steps)`, or 1 when `warmup_steps == 0`."""
        if step < 0:
            raise ValueError(f"step={step} must be >= 0 (the optimizer step count)")
        if self.warmup_steps == 0:
            return 1.0
        return min(1.0, step / self.warmup_steps)

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
                f"hidden_size={self.hidden_size}]; build the LossManager from the model config's concept_num "
                "and hidden_size"
            )

        values = []
        for name in self.concept_losses:
            value = CONCEPT_LOSSES[name](concepts, **self.loss_kwargs.get(name, {}))
            terms[name] = value.detach()
            values.append(value)
        mlm32 = mlm_loss.float()

        if self.weighting == "fixed":
            weight = self.concept_loss_weight * self.warmup_factor(step)
            total = mlm32 + weight * torch.stack(values).sum()
            terms["weight/mlm"] = torch.tensor(1.0, device=mlm32.device)
            for name in self.concept_losses:
                terms[f"weight/{name}"] = torch.tensor(weight, device=mlm32.device)
            return total, terms

        losses = torch.stack([mlm32, *values])  # [K+1]
        all_names = ["mlm", *self.concept_losses]
        if self.weighting == "learnable":
            weights = len(all_names) * self.weight_logits.float().softmax(dim=0)  # [K+1], sums to K+1
            total = (weights * losses).sum()
        else:  # kendall_gal
            log_vars = self.log_vars.float()
            weights = torch.exp(-log_vars)
            total = (weights * losses + log_vars).sum()
            for name, log_var in zip(all_names, log_vars.detach(), strict=True):
                terms[f"log_var/{name}"] = log_var
        for name, weight in zip(all_names, weights.detach(), strict=True):
            terms[f"weight/{name}"] = weight
        return total, terms

    def extra_repr(self) -> str:
        return (
            f"concept_losses={self.concept_losses}, weighting={self.weighting!r}, concept_num={self.concept_num}, "
            f"hidden_size={self.hidden_size}, concept_loss_weight={self.concept_loss_weight}, "
            f"warmup_steps={self.warmup_steps}"
        )
