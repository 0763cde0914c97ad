"""W&B set-up never prompts: offline without credentials, online with them, off with --report_to none;
the divergence monitor reports a loss far above its running minimum once, not a spike."""

import sys
import types
from pathlib import Path

import pytest
from accelerate import PartialState

from concept_encoder.training.args import TrainingArguments
from concept_encoder.training.runs import init_wandb


@pytest.fixture
def fake_wandb(monkeypatch):
    calls = []
    module = types.SimpleNamespace(
        init=lambda **kwargs: calls.append(kwargs) or types.SimpleNamespace(finish=lambda: None),
        Settings=lambda **kwargs: kwargs,
    )
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


@pytest.fixture
def no_credentials(monkeypatch, tmp_path):
    for name in ("WANDB_API_KEY", "WANDB_MODE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "missing-netrc"))


def test_offline_without_credentials_and_config_passed_as_given(fake_wandb, no_credentials, tmp_path):
    config = {"training_args": {"learning_rate": 1e-3}}
    run = init_wandb(TrainingArguments(report_to="wandb"), Path(tmp_path / "run-a"), config, PartialState())
    assert run is not None
    [kwargs] = fake_wandb
    assert kwargs["mode"] == "offline" and kwargs["config"] == config and kwargs["id"] == "run-a"


def test_online_with_an_api_key_and_the_key_is_not_logged(fake_wandb, no_credentials, monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_API_KEY", "secret-key-123")
    init_wandb(TrainingArguments(report_to="wandb"), tmp_path / "run-b", {"a": 1}, PartialState())
    [kwargs] = fake_wandb
    assert kwargs["mode"] == "online"
    assert "secret-key-123" not in repr(kwargs)


def test_report_to_none_never_imports_wandb(fake_wandb, tmp_path):
    assert init_wandb(TrainingArguments(report_to="none"), tmp_path, {}, PartialState()) is None
    assert fake_wandb == []


def test_divergence_monitor_needs_several_records_far_above_the_minimum():
    from concept_encoder.training.tracking import DivergenceMonitor

    monitor = DivergenceMonitor()
    noisy = [7.6, 7.0, 6.5, 11.0, 6.4, 6.3, float("nan"), 6.2]  # one spike and a NaN: not a divergence
    assert [monitor.update(step, loss) for step, loss in enumerate(noisy, start=1)] == [None] * len(noisy)
    found = [monitor.update(step, loss) for step, loss in [(9, 30.0), (10, 80.0), (11, 158.0), (12, 160.0)]]
    assert found == [None, None, {"step": 11, "loss": 158.0, "running_min": 6.2}, None]  # reported once
