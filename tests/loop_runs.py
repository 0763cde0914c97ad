"""Shared by the loop's test modules: the tiny run's arguments, in-process runs, their records."""

from pathlib import Path

import pytest
from accelerate.state import AcceleratorState, GradientState

import loops.mlm as mlm
from concept_encoder.training.tracking import read_metrics

ROOT = Path(__file__).resolve().parents[1]
COMMON = [
    "--preset", "micro", "--max_seq_length", "64", "--tokenizer", "train:wordpiece:2000",
    "--report_to", "none", "--progress_bar", "false", "--per_device_train_batch_size", "8",
    "--logging_steps", "1", "--eval_steps", "0", "--save_steps", "0", "--max_eval_batches", "2",
]  # fmt: skip


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    """One working directory for the module: runs share the tokenizer/dataset cache, not the repo's Cache/."""
    return tmp_path_factory.mktemp("loop")


@pytest.fixture(autouse=True)
def fresh_accelerate(workdir, monkeypatch):
    """Run in the module's working directory with accelerate's singletons reset afterwards."""
    monkeypatch.chdir(workdir)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def run(*extra: str) -> int:
    return mlm.main([*COMMON, "--output_dir", "runs", *extra])


def records(run_name: str, kind: str) -> list[dict]:
    return [r for r in read_metrics(Path("runs") / run_name / "metrics.jsonl") if r["kind"] == kind]


def train_losses(run_name: str) -> list[float]:
    return [r["loss"] for r in records(run_name, "train")]
