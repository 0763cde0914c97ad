"""Concept-health metrics on constructed concepts with known answers."""

import math

import concept_cases
import pytest
import torch

from concept_encoder.concepts.health import (
    HEALTH_KEYS,
    batch_mean_effective_rank,
    collapsed_dimensions,
    concept_health,
    effective_rank,
    effective_rank_fraction,
    format_health_table,
    max_offdiag_cosine,
    mean_offdiag_cosine,
    participation_ratio,
)

B, C, H = 4, 8, 16


def orthonormal(batch: int = B, concept_num: int = C, hidden: int = H, seed: int = 0) -> torch.Tensor:
    return concept_cases.orthonormal(batch, concept_num, hidden, seed)


def identical(batch: int = B, concept_num: int = C, hidden: int = H, seed: int = 0) -> torch.Tensor:
    return concept_cases.identical(batch, concept_num, hidden, seed)


def test_identical_concepts_are_rank_one():
    x = identical()
    assert effective_rank(x) == pytest.approx(1.0, abs=1e-4)
    assert effective_rank_fraction(x) == pytest.approx(1.0 / C, abs=1e-4)
    assert batch_mean_effective_rank(x) == pytest.approx(1.0, abs=1e-4)
    assert participation_ratio(x) == pytest.approx(1.0, abs=1e-4)
    assert max_offdiag_cosine(x) == pytest.approx(1.0, abs=1e-5)
    assert mean_offdiag_cosine(x) == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize(("concept_num", "hidden"), [(C, H), (H, H)])
def test_orthonormal_concepts_have_full_rank(concept_num, hidden):
    x = orthonormal(concept_num=concept_num, hidden=hidden)
    assert effective_rank(x) == pytest.approx(concept_num, abs=1e-4)
    assert effective_rank_fraction(x) == pytest.approx(1.0, abs=1e-5)
    assert participation_ratio(x) == pytest.approx(concept_num, abs=1e-3)
    assert mean_offdiag_cosine(x) == pytest.approx(0.0, abs=1e-5)
    assert max_offdiag_cosine(x) == pytest.approx(0.0, abs=1e-5)


def test_identity_concepts_shared_by_the_batch():
    x = torch.eye(H)[:C].expand(B, C, H)  # the same orthonormal set in every sample
    assert batch_mean_effective_rank(x) == pytest.approx(C, abs=1e-4)
    assert effective_rank(x) == pytest.approx(C, abs=1e-4)


def test_effective_rank_of_known_spectrum():
    x = torch.zeros(1, 3, 5)
    x[0, 0, 0], x[0, 1, 1] = 3.0, 1.0  # singular values 3, 1, 0 -> p = 0.75, 0.25, 0
    entropy = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert effective_rank(x) == pytest.approx(math.exp(entropy), abs=1e-5)
    assert effective_rank_fraction(x) == pytest.approx(math.exp(entropy) / 3, abs=1e-5)
    assert batch_mean_effective_rank(x) == pytest.approx(4.0 / 3.0, abs=1e-5)  # nuclear 4 / spectral 3
    assert participation_ratio(x) == pytest.approx((9 + 1) ** 2 / (81 + 1), abs=1e-5)


def test_effective_rank_averages_over_samples():
    x = torch.cat([orthonormal(batch=1), identical(batch=1)])  # ranks C and 1
    assert effective_rank(x) == pytest.approx((C + 1) / 2, abs=1e-4)


def test_fraction_uses_min_of_concepts_and_hidden():
    x = torch.randn(2, 12, 4)  # C > H: at most H = 4 directions
    assert effective_rank_fraction(x) == pytest.approx(effective_rank(x) / 4, abs=1e-6)
    assert effective_rank(x) <= 4 + 1e-4


def test_cosines_are_signed():
    v = torch.randn(H)
    x = torch.stack([v, -v]).unsqueeze(0)  # anti-parallel pair
    assert mean_offdiag_cosine(x) == pytest.approx(-1.0, abs=1e-5)
    assert max_offdiag_cosine(x) == pytest.approx(-1.0, abs=1e-5)
    y = torch.tensor([[[1.0, 0.0], [0.6, 0.8], [0.0, 1.0]]])  # cosines 0.6, 0, 0.8 (each twice)
    assert mean_offdiag_cosine(y) == pytest.approx((0.6 + 0.0 + 0.8) / 3, abs=1e-5)
    assert max_offdiag_cosine(y) == pytest.approx(0.8, abs=1e-5)


def test_single_concept_cosines_are_nan():
    x = torch.randn(2, 1, H)
    assert math.isnan(mean_offdiag_cosine(x)) and math.isnan(max_offdiag_cosine(x))


def test_collapsed_dimensions_counts_constant_dims():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, C, H, generator=g)
    x[..., :3] = 0.7  # three dead dimensions
    x[..., 3] = 0.5 + 1e-4 * torch.randn(B, C, generator=g)  # a fourth, barely varying
    assert collapsed_dimensions(x) == 4
    assert collapsed_dimensions(x, threshold=1e-6) == 3
    assert collapsed_dimensions(identical()) == 0  # samples differ, so every dimension varies
    assert collapsed_dimensions(torch.ones(B, C, H)) == H


def test_concept_health_bundles_every_metric():
    x = orthonormal().requires_grad_()
    health = concept_health(x)
    assert (
        tuple(health)
        == HEALTH_KEYS
        == (
            "effective_rank",
            "effective_rank_fraction",
            "batch_mean_effective_rank",
            "participation_ratio",
            "mean_cosine",
            "max_cosine",
            "collapsed_dims",
        )
    )
    assert isinstance(health["collapsed_dims"], int)
    assert all(isinstance(value, float) for key, value in health.items() if key != "collapsed_dims")
    assert health["effective_rank"] == pytest.approx(C, abs=1e-4)
    assert health["effective_rank_fraction"] == pytest.approx(1.0, abs=1e-5)
    assert health["max_cosine"] == pytest.approx(0.0, abs=1e-5)
    assert health["batch_mean_effective_rank"] == pytest.approx(batch_mean_effective_rank(x))
    collapsed = concept_health(identical())
    assert collapsed["effective_rank"] == pytest.approx(1.0, abs=1e-4)
    assert collapsed["max_cosine"] == pytest.approx(1.0, abs=1e-5)


def test_bf16_input_matches_float32():
    x = orthonormal()
    low = concept_health(x.to(torch.bfloat16))
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        autocast = effective_rank(x)
    assert low["effective_rank"] == pytest.approx(C, abs=0.05)
    assert autocast == pytest.approx(C, abs=1e-4)


def test_format_health_table():
    table = format_health_table(concept_health(orthonormal()))
    assert format_health_table({"x": 0.123456, "n": 3}).splitlines()[2:] == ["| x | 0.1235 |", "| n | 3 |"]
    lines = table.splitlines()
    assert lines[:2] == ["| metric | value |", "|---|---|"]
    assert len(lines) == 2 + len(HEALTH_KEYS)
    assert "| effective_rank | 8 |" in lines  # 4 significant digits: 7.99999 prints as 8
    assert "| effective_rank_fraction | 1 |" in lines
    assert "| collapsed_dims | 0 |" in lines
    with pytest.raises(ValueError, match="empty"):
        format_health_table({})


def test_bad_input_raises():
    with pytest.raises(ValueError, match=r"\[B,C,H\]"):
        effective_rank(torch.randn(C, H))
    with pytest.raises(ValueError, match="threshold"):
        collapsed_dimensions(orthonormal(), threshold=0.0)


@pytest.mark.parametrize("shape", [(3, 8, 16), (2, 16, 8), (1, 5, 5)])
def test_singular_values_from_the_gram_matrix_equal_svdvals(shape):
    """The metrics take singular values from the smaller Gram matrix (fast on CPU); they must be svdvals'."""
    from concept_encoder.concepts.health import _singular_values

    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x[0, 1] = x[0, 0]  # a repeated concept: rank C-1 when C <= H
    expected = torch.linalg.svdvals(x).float()
    got = _singular_values(x, "test")
    assert got.shape == (shape[0], min(shape[1:]))
    assert torch.allclose(got, expected, atol=1e-5 * expected.max().item())
    if shape[1] <= shape[2]:
        assert got[0, -1].item() == pytest.approx(0.0, abs=1e-4)
