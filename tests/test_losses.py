"""Concept losses: known values, spread < collapsed, finite gradients; their weighting into the loss and checkpointing."""

import math
import warnings

import concept_cases
import pytest
import torch

from concept_encoder.concepts.losses import (
    CONCEPT_LOSSES,
    covariance_loss,
    nearest_neighbour_spread_loss,
    orthogonality_loss,
    soft_orthogonality_loss,
    uniformity_loss,
    variance_loss,
    vicreg_loss,
)
from concept_encoder.concepts.weighting import ConceptRegularizedLoss

B, C, H = 16, 8, 16


def orthonormal(batch: int = B, concept_num: int = C, hidden: int = H, seed: int = 0) -> torch.Tensor:
    return concept_cases.orthonormal(batch, concept_num, hidden, seed)


def spread(seed: int = 0) -> torch.Tensor:
    """Orthonormal concepts scaled by sqrt(H), so each coordinate has about unit variance (VICReg's scale)."""
    return orthonormal(seed=seed) * math.sqrt(H)


def identical(batch: int = B, concept_num: int = C, hidden: int = H, seed: int = 0) -> torch.Tensor:
    return concept_cases.identical(batch, concept_num, hidden, seed)


def collapsed(seed: int = 0) -> torch.Tensor:
    """Every concept of every sample on one line: `a·ones + noise`, a in [1,3] (varies, so VICReg sees covariance)."""
    g = torch.Generator().manual_seed(seed)
    scale = 1.0 + 2.0 * torch.rand(B, C, 1, generator=g)
    return scale * torch.ones(H) + 1e-3 * torch.randn(B, C, H, generator=g)


def random_concepts(seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, C, H, generator=g)


# ---------------------------------------------------------------- known values


def test_orthogonality_known_values():
    assert orthogonality_loss(orthonormal()).item() == pytest.approx(0.0, abs=1e-6)
    assert orthogonality_loss(identical()).item() == pytest.approx(1.0, abs=1e-5)
    # Two concepts at 60 degrees: cos = 0.5, both ordered pairs give 0.25.
    x = torch.tensor([[[1.0, 0.0], [0.5, math.sqrt(3) / 2]]])
    assert orthogonality_loss(x).item() == pytest.approx(0.25, abs=1e-6)


def test_soft_orthogonality_known_values():
    assert soft_orthogonality_loss(orthonormal()).item() == pytest.approx(0.0, abs=1e-6)
    assert soft_orthogonality_loss(identical(), threshold=0.1).item() == pytest.approx(0.81, abs=1e-5)
    x = torch.tensor([[[1.0, 0.0], [0.5, math.sqrt(3) / 2]]])  # |cos| = 0.5
    assert soft_orthogonality_loss(x, threshold=0.3).item() == pytest.approx(0.04, abs=1e-6)
    assert soft_orthogonality_loss(x, threshold=0.6).item() == 0.0


def test_uniformity_known_values():
    # Orthonormal: every ||z_i - z_j||^2 = 2, so log mean exp(-2t) = -2t.
    assert uniformity_loss(orthonormal(), temperature=2.0).item() == pytest.approx(-4.0, abs=1e-4)
    assert uniformity_loss(orthonormal(), temperature=0.5).item() == pytest.approx(-1.0, abs=1e-4)
    assert uniformity_loss(identical()).item() == pytest.approx(0.0, abs=1e-5)


def test_nn_spread_known_values():
    assert nearest_neighbour_spread_loss(orthonormal()).item() == pytest.approx(-math.sqrt(2), abs=1e-4)
    # Distances come from 2 - 2cos in float32, so a true 0 reads as ~1e-4 after the sqrt.
    assert nearest_neighbour_spread_loss(identical()).item() == pytest.approx(0.0, abs=1e-3)
    # Three unit vectors: e1, e2 and a near-copy of e1; nearest distances are 0.1ish, sqrt(2)-ish, 0.1ish.
    x = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 0.0, 0.1]]])
    z = torch.nn.functional.normalize(x, dim=-1)[0]
    d02 = (z[0] - z[2]).norm().item()
    d01, d12 = (z[0] - z[1]).norm().item(), (z[1] - z[2]).norm().item()
    expected = -(d02 + min(d01, d12) + d02) / 3
    assert nearest_neighbour_spread_loss(x).item() == pytest.approx(expected, abs=1e-5)


def test_variance_and_covariance_known_values():
    # Rows [1,1] and [-1,-1]: per-dim unbiased variance 2, covariance [[2,2],[2,2]].
    x = torch.tensor([[[1.0, 1.0]], [[-1.0, -1.0]]])  # [B=2,C=1,H=2]
    assert variance_loss(x).item() == 0.0  # std = sqrt(2) > gamma = 1
    assert variance_loss(x, gamma=2.0).item() == pytest.approx(2.0 - math.sqrt(2.0 + 1e-4), abs=1e-6)
    assert covariance_loss(x).item() == pytest.approx(2 * 2.0**2 / 2, abs=1e-5)
    everything_equal = torch.ones(2, 3, 4)
    assert variance_loss(everything_equal).item() == pytest.approx(1.0 - math.sqrt(1e-4), abs=1e-6)
    assert vicreg_loss(x, gamma=2.0).item() == pytest.approx(variance_loss(x, gamma=2.0).item() + 4.0, abs=1e-5)


def test_single_concept_has_no_pairs():
    x = torch.randn(3, 1, H, requires_grad=True)
    for fn in (orthogonality_loss, soft_orthogonality_loss, uniformity_loss, nearest_neighbour_spread_loss):
        value = fn(x)
        assert value.item() == 0.0
        value.backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


# ---------------------------------------------------------------- every registered loss


@pytest.mark.parametrize("name", list(CONCEPT_LOSSES))
def test_spread_concepts_score_lower_than_collapsed(name):
    fn = CONCEPT_LOSSES[name]
    low, high = fn(spread()).item(), fn(collapsed()).item()
    assert low < high, f"{name}: spread {low:.4g} should be < collapsed {high:.4g}"
    # Random Gaussian concepts are also far from collapse.
    assert fn(random_concepts()).item() < high


@pytest.mark.parametrize("name", list(CONCEPT_LOSSES))
@pytest.mark.parametrize("case", ["random", "identical", "bf16"])
def test_gradients_are_finite(name, case):
    if case == "random":
        x = random_concepts().requires_grad_()
    elif case == "identical":
        x = identical().requires_grad_()
    else:
        x = random_concepts().to(torch.bfloat16).requires_grad_()
    value = CONCEPT_LOSSES[name](x)
    assert value.shape == () and value.dtype == torch.float32
    assert torch.isfinite(value)
    value.backward()
    assert x.grad is not None and x.grad.shape == x.shape
    assert torch.isfinite(x.grad.float()).all()
    if case == "random":
        assert x.grad.abs().sum() > 0, f"{name} gives no gradient on random concepts"


def test_bad_shapes_and_arguments_raise():
    with pytest.raises(ValueError, match=r"\[B,C,H\]"):
        orthogonality_loss(torch.randn(C, H))
    with pytest.raises(TypeError, match="floating-point"):
        orthogonality_loss(torch.ones(2, C, H, dtype=torch.long))
    with pytest.raises(ValueError, match="B\\*C >= 2"):
        variance_loss(torch.randn(1, 1, H))
    with pytest.raises(ValueError, match="temperature"):
        uniformity_loss(random_concepts(), temperature=0.0)
    with pytest.raises(ValueError, match="threshold"):
        soft_orthogonality_loss(random_concepts(), threshold=1.5)


def test_losses_are_float32_under_bf16_autocast():
    x = random_concepts()
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        value = orthogonality_loss(x)
    assert value.dtype == torch.float32
    assert value.item() == pytest.approx(orthogonality_loss(x).item(), rel=1e-6)


# ---------------------------------------------------------------- ConceptRegularizedLoss


def mlm() -> torch.Tensor:
    return torch.tensor(2.5, requires_grad=True)


def test_empty_loss_list_returns_mlm_loss():
    for weighting in ("fixed", "learnable", "kendall_gal"):
        manager = ConceptRegularizedLoss([], concept_num=C, hidden_size=H, weighting=weighting)
        loss = mlm()
        total, terms = manager(loss, None, step=0)
        assert total is loss
        assert list(terms) == ["mlm"] and terms["mlm"].item() == 2.5
        assert list(manager.parameters()) == []


@pytest.mark.parametrize(("step", "factor"), [(0, 0.0), (50, 0.5), (100, 1.0), (200, 1.0)])
def test_fixed_weights_warm_up_linearly(step, factor):
    manager = ConceptRegularizedLoss(
        ["orthogonality"], concept_num=C, hidden_size=H, concept_loss_weight=0.4, warmup_steps=100
    )
    total, terms = manager(mlm(), identical(), step=step)  # orthogonality of identical concepts = 1
    assert terms["weight/orthogonality"].item() == pytest.approx(0.4 * factor)
    assert terms["orthogonality"].item() == pytest.approx(1.0, abs=1e-5)
    assert total.item() == pytest.approx(2.5 + 0.4 * factor, abs=1e-5)


def test_fixed_without_warmup_is_full_weight_from_step_0():
    manager = ConceptRegularizedLoss(
        ["orthogonality", "uniformity"], concept_num=C, hidden_size=H, concept_loss_weight=0.5
    )
    x = random_concepts()
    total, terms = manager(mlm(), x, step=0)
    expected = 2.5 + 0.5 * (orthogonality_loss(x) + uniformity_loss(x)).item()
    assert total.item() == pytest.approx(expected, abs=1e-5)
    assert set(terms) == {
        "mlm",
        "orthogonality",
        "uniformity",
        "weight/mlm",
        "weight/orthogonality",
        "weight/uniformity",
    }
    assert all(not t.requires_grad and t.dtype == torch.float32 for t in terms.values())


def test_loss_kwargs_reach_the_loss():
    x = random_concepts()
    manager = ConceptRegularizedLoss(
        ["uniformity"], concept_num=C, hidden_size=H, loss_kwargs={"uniformity": {"temperature": 0.5}}
    )
    _, terms = manager(mlm(), x, step=0)
    assert terms["uniformity"].item() == pytest.approx(uniformity_loss(x, temperature=0.5).item(), abs=1e-6)
    assert terms["uniformity"].item() != pytest.approx(uniformity_loss(x).item(), abs=1e-3)


def test_unknown_names_raise_with_the_valid_ones():
    with pytest.raises(ValueError, match="orthogonalty") as info:
        ConceptRegularizedLoss(["orthogonalty"], concept_num=C, hidden_size=H)
    assert "soft_orthogonality" in str(info.value) and "nn_spread" in str(info.value)
    with pytest.raises(ValueError, match="'softmax'.*fixed, learnable, kendall_gal"):
        ConceptRegularizedLoss(["uniformity"], concept_num=C, hidden_size=H, weighting="softmax")
    with pytest.raises(ValueError, match="more than once"):
        ConceptRegularizedLoss(["uniformity", "uniformity"], concept_num=C, hidden_size=H)
    with pytest.raises(ValueError, match="weighting='fixed' only"):
        ConceptRegularizedLoss(["uniformity"], concept_num=C, hidden_size=H, weighting="kendall_gal", warmup_steps=10)
    with pytest.raises(ValueError, match="not in concept_losses"):
        ConceptRegularizedLoss(["uniformity"], concept_num=C, hidden_size=H, loss_kwargs={"variance": {"gamma": 2.0}})


def test_concepts_must_match_constructor_shape():
    manager = ConceptRegularizedLoss(["uniformity"], concept_num=C, hidden_size=H)
    with pytest.raises(ValueError, match=f"concept_num={C}"):
        manager(mlm(), torch.randn(2, C + 1, H), step=0)
    with pytest.raises(ValueError, match="required"):
        manager(mlm(), None, step=0)


def test_orthogonality_with_more_concepts_than_dims_warns():
    with pytest.warns(UserWarning, match="concept_num=32 > hidden_size=16"):
        ConceptRegularizedLoss(["orthogonality"], concept_num=32, hidden_size=16)
    with pytest.warns(UserWarning, match="soft_orthogonality"):
        ConceptRegularizedLoss(["soft_orthogonality"], concept_num=32, hidden_size=16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ConceptRegularizedLoss(["orthogonality"], concept_num=16, hidden_size=16)
        ConceptRegularizedLoss(["uniformity", "nn_spread"], concept_num=32, hidden_size=16)


def test_learnable_weights_sum_to_number_of_terms():
    manager = ConceptRegularizedLoss(
        ["orthogonality", "uniformity"], concept_num=C, hidden_size=H, weighting="learnable"
    )
    assert manager.weighting.weight_logits.shape == (3,)
    with torch.no_grad():
        manager.weighting.weight_logits.copy_(torch.tensor([0.3, -1.0, 2.0]))
    x = random_concepts()
    total, terms = manager(mlm(), x, step=0)
    weights = torch.stack([terms["weight/mlm"], terms["weight/orthogonality"], terms["weight/uniformity"]])
    assert weights.sum().item() == pytest.approx(3.0, abs=1e-5)
    assert torch.allclose(weights, 3 * torch.tensor([0.3, -1.0, 2.0]).softmax(0))
    expected = (weights * torch.stack([terms["mlm"], terms["orthogonality"], terms["uniformity"]])).sum()
    assert total.item() == pytest.approx(expected.item(), abs=1e-5)
    total.backward()
    assert manager.weighting.weight_logits.grad is not None and manager.weighting.weight_logits.grad.abs().sum() > 0


def test_learnable_weights_start_equal():
    manager = ConceptRegularizedLoss(["variance"], concept_num=C, hidden_size=H, weighting="learnable")
    _, terms = manager(mlm(), random_concepts(), step=0)
    assert terms["weight/mlm"].item() == pytest.approx(1.0) and terms["weight/variance"].item() == pytest.approx(1.0)


def test_kendall_gal_formula():
    manager = ConceptRegularizedLoss(["orthogonality"], concept_num=C, hidden_size=H, weighting="kendall_gal")
    with torch.no_grad():
        manager.weighting.log_vars.copy_(torch.tensor([0.5, -0.25]))
    x = identical()  # orthogonality = 1
    total, terms = manager(mlm(), x, step=0)
    expected = math.exp(-0.5) * 2.5 + 0.5 + math.exp(0.25) * 1.0 - 0.25
    assert total.item() == pytest.approx(expected, abs=1e-5)
    assert terms["weight/orthogonality"].item() == pytest.approx(math.exp(0.25), abs=1e-6)
    assert terms["log_var/mlm"].item() == pytest.approx(0.5)


def test_kendall_gal_log_vars_survive_save_and_load(tmp_path):
    names = ["orthogonality", "uniformity"]
    manager = ConceptRegularizedLoss(names, concept_num=C, hidden_size=H, weighting="kendall_gal")
    assert "weighting.log_vars" in manager.state_dict()
    optimizer = torch.optim.SGD(manager.parameters(), lr=0.1)
    total, _ = manager(mlm(), random_concepts(), step=0)
    total.backward()
    optimizer.step()
    trained = manager.weighting.log_vars.detach().clone()
    assert trained.abs().min() > 0, "the optimizer step should have moved every log-variance"

    path = tmp_path / "concept_loss.pt"
    torch.save(manager.state_dict(), path)
    fresh = ConceptRegularizedLoss(names, concept_num=C, hidden_size=H, weighting="kendall_gal")
    assert not torch.equal(fresh.weighting.log_vars.detach(), trained)
    fresh.load_state_dict(torch.load(path, weights_only=True))
    assert torch.equal(fresh.weighting.log_vars.detach(), trained)
    x = random_concepts(seed=3)
    assert fresh(mlm(), x, step=5)[0].item() == manager(mlm(), x, step=5)[0].item()


def test_negative_step_raises():
    manager = ConceptRegularizedLoss(["uniformity"], concept_num=C, hidden_size=H, warmup_steps=10)
    with pytest.raises(ValueError, match="step=-1"):
        manager(mlm(), random_concepts(), step=-1)


@pytest.mark.parametrize(("weighting", "parameter"), [("learnable", "weight_logits"), ("kendall_gal", "log_vars")])
def test_loop_checkpoint_entry_keeps_the_first_release_format(weighting, parameter):
    """The loop saves {"manager": {<parameter>: tensor}, "optimizer": ...}, as before the weighting classes
    existed: a state in that format (written by hand here) loads and drives the loss to the same value."""
    from types import SimpleNamespace

    from concept_encoder.training.objective import build_concept_objective

    args = SimpleNamespace(
        concept_loss_names=["orthogonality"], loss_weighting=weighting, concept_loss_weight=0.1,
        concept_loss_warmup_steps=0, learning_rate=1e-3,
    )  # fmt: skip
    config = SimpleNamespace(concept_num=C, hidden_size=H, hidden_dropout_prob=0.0)
    objective = build_concept_objective(args, config, torch.device("cpu"))
    state = objective.state_dict()
    assert set(state) == {"manager", "optimizer"} and list(state["manager"]) == [parameter]
    first_release_state = {"manager": {parameter: torch.tensor([0.5, -0.25])}, "optimizer": state["optimizer"]}
    objective.load_state_dict(first_release_state)
    x = identical()  # orthogonality = 1
    total, _ = objective(mlm(), x, step=0)
    w = (2 * torch.tensor([0.5, -0.25]).softmax(0)).tolist()
    expected = {
        "learnable": w[0] * 2.5 + w[1] * 1.0,
        "kendall_gal": math.exp(-0.5) * 2.5 + 0.5 + math.exp(0.25) * 1.0 - 0.25,
    }[weighting]
    assert total.item() == pytest.approx(expected, abs=1e-5)


def test_the_default_recipe_warms_its_concept_losses_up_over_the_first_100_steps():
    """DEFAULT_RECIPE: orthogonality and uniformity at weight 1.0, reached linearly over the first 100 optimizer
    steps (chosen by the README's ablation); no warm-up where none applies, and none when asked for 0."""
    from types import SimpleNamespace

    from concept_encoder.training.args import DEFAULT_RECIPE, parse_args
    from concept_encoder.training.objective import build_concept_objective

    _, _, args = parse_args([])
    assert (args.concept_losses, args.loss_weighting, args.concept_loss_weight) == (
        "orthogonality,uniformity",
        "fixed",
        1.0,
    )
    assert args.concept_loss_warmup_steps == DEFAULT_RECIPE["concept_loss_warmup_steps"] == 100
    config = SimpleNamespace(concept_num=C, hidden_size=H, hidden_dropout_prob=0.0)
    objective = build_concept_objective(args, config, torch.device("cpu"))
    x = random_concepts()
    for step, weight in [(0, 0.0), (25, 0.25), (50, 0.5), (99, 0.99), (100, 1.0), (300, 1.0)]:
        total, terms = objective(mlm(), x, step=step)
        assert terms["weight/orthogonality"].item() == pytest.approx(weight)
        assert terms["weight/uniformity"].item() == pytest.approx(weight)
        expected = 2.5 + weight * (orthogonality_loss(x) + uniformity_loss(x)).item()
        assert total.item() == pytest.approx(expected, abs=1e-5)
    for argv in (["--architecture", "bert"], ["--loss_weighting", "kendall_gal"], ["--concept_losses", "none"],
                 ["--concept_loss_warmup_steps", "0"]):  # fmt: skip
        assert parse_args(argv)[2].concept_loss_warmup_steps == 0, argv
