"""Shared by the loop's test modules: the tiny run's arguments, in-process runs, their records, a finished run."""

import itertools
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate.state import AcceleratorState, GradientState

import loops.finetune as finetune
import loops.mlm as mlm
from concept_encoder.common.metrics_log import read_metrics

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


@pytest.fixture
def in_process(tmp_path, monkeypatch):
    """A driver's loops run in this process, in `tmp_path` (`launch_in_process`); yields the commands launched, and
    resets accelerate's singletons afterwards."""
    from concept_encoder.decide import experiments

    monkeypatch.chdir(tmp_path)
    commands = []
    monkeypatch.setattr(experiments, "run_command", launch_in_process(commands))
    yield commands
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(scope="module")
def finished_run(workdir):
    """Run `a`: 6 steps, checkpoints at 2, 4, 6 (all kept), finished."""
    os.chdir(workdir)
    run("--run_name", "a", "--max_steps", "6", "--save_steps", "2", "--save_total_limit", "3", "--eval_steps", "3")
    return workdir / "runs" / "a"


def run(*extra: str) -> int:
    return mlm.main([*COMMON, "--output_dir", "runs", *extra])


def launch_in_process(commands: list):
    """A stand-in for `experiments.run_command`: the loop an `accelerate launch` command names runs in this process
    (seconds saved per run), and every command is kept in `commands`."""
    from concept_encoder.decide import experiments

    def in_process(command):
        from concept_encoder.training.args import FINETUNE_ARGUMENT_CLASSES, FINETUNE_DEFAULTS
        from concept_encoder.training.preflight import fail_fast

        commands.append(command)
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        script = next(c for c in command if c.endswith(".py"))
        loop = mlm if script == str(experiments.MLM_SCRIPT) else finetune
        argv = command[command.index(script) + 1 :]
        try:  # the script's own check before torch loads, as the launched script runs it
            fail_fast(argv) if loop is mlm else fail_fast(argv, FINETUNE_ARGUMENT_CLASSES, FINETUNE_DEFAULTS)
        except SystemExit as stop:
            return stop.code
        # `env NAME=value ... <launcher>`: the launch's own environment, this run's alone
        pinned = dict(c.split("=", 1) for c in itertools.takewhile(lambda c: "=" in c, command[1:])) if (
            command[0] == "env") else {}  # fmt: skip
        saved, threads = {name: os.environ.get(name) for name in pinned}, torch.get_num_threads()
        os.environ.update(pinned)
        try:
            return 1 if loop.main(argv) else 0  # as `accelerate launch` reports it
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name)
                else:
                    os.environ[name] = value
            torch.set_num_threads(threads)  # a count pinned for the run ends with it

    return in_process


class TwoAtATime:
    """A stand-in for `experiments.run_command` under a driver's `--jobs 2`: each fine-tuning launch waits (up to
    10 s) for a second one running beside it, and keeps how many ran at once (`most`) and the `CPU_THREADS` it was
    given (`threads`); it rewrites the newest report of its `--report_dir` (as the launch writes it again: a point
    measured anew from runs that finished before). Other launches go to `fallback`."""

    def __init__(self, fallback):
        import threading

        self.fallback, self.running, self.most, self.threads = fallback, [], [], []
        self.together = threading.Condition()

    def __call__(self, command: list[str]) -> int:
        import time

        from concept_encoder.decide import experiments

        if str(experiments.FINETUNE_SCRIPT) not in command:
            return self.fallback(command)
        with self.together:
            self.running.append(command)
            self.most.append(len(self.running))
            self.together.notify_all()
            self.together.wait_for(lambda: len(self.running) >= 2, timeout=10)
        self.threads.append(os.environ["CPU_THREADS"])
        reports = Path(command[command.index("--report_dir") + 1])
        report = max(reports.glob("finetune_*.json"), key=lambda p: p.stat().st_mtime_ns)
        time.sleep(0.01)  # a modification time of its own: this launch's report
        report.write_text(report.read_text())
        with self.together:
            self.running.remove(command)
        return 0


def sigterm_after(monkeypatch, calls: int):
    real = mlm.train_step
    count = {"n": 0}

    def step_then_signal(*args, **kwargs):
        out = real(*args, **kwargs)
        count["n"] += 1
        if count["n"] == calls:
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(mlm, "train_step", step_then_signal)
    return real


def tiny_teacher(folder: Path) -> Path:
    """A distillation teacher: a 2-layer BERT of width 32 with its own WordPiece vocabulary (400 tokens, not the
    student's), saved in `folder`."""
    from transformers import BertConfig, BertModel

    from concept_encoder.data.sources import embedded_documents
    from concept_encoder.data.tokenizer import train_tokenizer

    tokenizer = train_tokenizer("wordpiece", 400, iter(embedded_documents()))
    tokenizer.save_pretrained(folder)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128)  # fmt: skip
    BertModel(config).save_pretrained(folder)
    return folder


def records(run_name: str, kind: str) -> list[dict]:
    return [r for r in read_metrics(Path("runs") / run_name / "metrics.jsonl") if r["kind"] == kind]


def train_losses(run_name: str) -> list[float]:
    return [r["loss"] for r in records(run_name, "train")]


WITHOUT_THE_PACKAGE = """
import sys
root, trust = sys.argv[2], sys.argv[3] == "trust"
sys.path = [p for p in sys.path if p.rstrip("/") != root and p not in ("", ".")]
sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]  # the editable install's finder
import importlib.util
assert importlib.util.find_spec("concept_encoder") is None, "the package is still importable"
import torch
from transformers import AutoModelForMaskedLM
model = AutoModelForMaskedLM.from_pretrained(sys.argv[1], trust_remote_code=trust).eval()
with torch.no_grad():
    logits = model(input_ids=torch.arange(5, 21)[None]).logits
print("LOADED", type(model).__name__, type(model).__module__, float(logits.double().sum()))
"""


def load_without_the_package(final: Path, tmp_path: Path, trust_remote_code: bool) -> tuple[str, str, float]:
    """Load `final` with `AutoModelForMaskedLM` in a fresh interpreter that cannot import this package:
    (class name, its module, the logits' sum on ids 5..20)."""
    out = subprocess.run(
        [sys.executable, "-c", WITHOUT_THE_PACKAGE, str(final), str(ROOT), "trust" if trust_remote_code else "plain"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    name, module, logits_sum = out.stdout.split("LOADED")[1].split()
    return name, module, float(logits_sum)


def fp16_scaler_on_cpu(monkeypatch, loop) -> list:
    """The loop's `Accelerator` as accelerate builds it for fp16 on a GPU, on the CPU: fp16 autocast around the
    model's forward, a real `torch.amp.GradScaler` (scale 2^16, halved on an overflow) that `backward` scales by,
    `clip_grad_norm_` unscales through and `optimizer.step()` steps through. accelerate builds the scaler on CUDA
    only, so it is patched in before `prepare`. Returns the list the accelerators built are appended to."""
    real, made = loop.Accelerator, []

    def with_scaler(*args, **kwargs):
        kwargs.pop("mixed_precision", None)  # the state's first precision is "no"; patched to fp16 below
        accelerator = real(*args, **kwargs)
        accelerator.state._mixed_precision = "fp16"  # what unscale_gradients and the autocast wrapper read
        accelerator.native_amp = True
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
        made.append(accelerator)
        return accelerator

    monkeypatch.setattr(loop, "Accelerator", with_scaler)
    return made


def overflowing_once(parameter: torch.nn.Parameter) -> None:
    """`parameter`'s gradient is infinite in the first backward pass only: an fp16 overflow, once."""
    calls = {"n": 0}

    def first_backward_overflows(grad):
        calls["n"] += 1
        return grad + math.inf if calls["n"] == 1 else grad

    parameter.register_hook(first_backward_overflows)
