"""Concept regularisation losses, by name in `CONCEPT_LOSSES` (weighted into the training loss by
`concept_encoder.concepts.weighting`).

Every loss takes the final concepts `concepts [B,C,H]` (B samples, C = concept_num, H = hidden_size)
and returns a scalar `[]` float32 tensor: lower means more spread-out concepts. Inputs in bf16/fp16
are upcast and autocast is switched off inside, because cosines near ±1 and small variances lose
most of their digits in half precision.

Pairwise losses (orthogonality, soft_orthogonality, uniformity, nn_spread) act within each sample on
its C×C concept pairs, then average over the batch. VICReg terms (variance, covariance) act across the
flattened concept vectors `[B*C,H]`, i.e. they look at how each hidden dimension is used batch-wide.

Combining with the MLM loss: `concept_encoder.concepts.weighting.ConceptRegularizedLoss`.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from ..constants import CONCEPT_LOSS_NAMES, check_table_covers

__all__ = [
    "CONCEPT_LOSSES",
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


def _offdiagonal(matrices: torch.Tensor) -> torch.Tensor:
    """`[...,C,C]` → its off-diagonal entries `[...,C(C-1)]`, row by row: what indexing with `_offdiag_mask` gives,
    gathered by indices made on the device (a boolean index runs `nonzero` on a GPU, a host sync in the step)."""
    c = matrices.shape[-1]
    k = torch.arange(c * (c - 1), device=matrices.device)  # the k-th off-diagonal entry: row k // (C-1)
    row, column = k // (c - 1), k % (c - 1)
    column = column + (column >= row).long()  # skip the diagonal
    return matrices.flatten(-2).index_select(-1, row * c + column)


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
        return _offdiagonal(cos).pow(2).mean()


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
        cos = _offdiagonal(pairwise_cosine(x))  # [B,C(C-1)]
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
        return _offdiagonal(cov).pow(2).sum() / h


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
check_table_covers(CONCEPT_LOSSES, CONCEPT_LOSS_NAMES, "CONCEPT_LOSSES")
