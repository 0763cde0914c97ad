"""What GPU users of the loop expect: a warm-up-stable-decay schedule that can be extended while it is stable,
a wall-clock budget that stops with a checkpoint that resumes exactly, TF32 where the hardware has it, and a
non-finite gradient norm skipped like a non-finite loss."""

import json
import math
from pathlib import Path

import pytest
import torch
from loop_runs import (  # noqa: F401 (fixtures)
    fp16_scaler_on_cpu,
    fresh_accelerate,
    overflowing_once,
    run,
    train_losses,
    workdir,
)
from safetensors.torch import load_file

import loops.mlm as mlm
from concept_encoder.checkpoints.checkpoint import CheckpointError
from concept_encoder.training.args import parse_args, parse_duration
from concept_encoder.training.optim import build_scheduler, rate_factors, schedule_problem
from concept_encoder.training.runtime import set_tf32

WSD = ["--lr_scheduler_type", "wsd", "--warmup_steps", "1", "--decay_steps", "2", "--save_steps", "2",
       "--save_total_limit", "4"]  # fmt: skip


def training_args(*flags: str):
    return parse_args(list(flags))[2]


def rates(args, steps: int) -> list[float]:
    """The learning rate of each of the first `steps` optimizer steps, as the loop's scheduler gives them."""
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=args.learning_rate)
    scheduler, seen = build_scheduler(optimizer, args), []
    for _ in range(steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen


def test_wsd_warms_up_holds_the_peak_then_decays_to_its_floor_at_the_last_step():
    args = training_args("--lr_scheduler_type", "wsd", "--learning_rate", "1e-3", "--warmup_steps", "4",
                         "--decay_steps", "4", "--max_steps", "12", "--decay_type", "linear", "--min_lr_ratio", "0.1")  # fmt: skip
    got = rates(args, 13)
    warmup = [0.1 + 0.9 * step / 4 for step in range(4)]  # transformers' wsd warms up from the floor
    decay = [0.1 + 0.9 * (1 - step / 4) for step in range(4)]
    assert got == pytest.approx([r * 1e-3 for r in [*warmup, *[1.0] * 4, *decay, 0.1]], abs=1e-12)
    sqrt = rates(training_args("--lr_scheduler_type", "wsd", "--learning_rate", "1e-3", "--warmup_steps", "0",
                               "--decay_steps", "4", "--max_steps", "8"), 9)  # the default shape: 1-sqrt  # fmt: skip
    assert sqrt[:4] == [1e-3] * 4 and sqrt[6] == pytest.approx(1e-3 * (1 - math.sqrt(0.5))) and sqrt[8] == 0
    floor = rates(training_args("--learning_rate", "1e-3", "--min_lr_ratio", "0.2", "--max_steps", "10",
                                "--warmup_steps", "0"), 11)  # cosine with a floor  # fmt: skip
    assert floor[0] == 1e-3 and floor[10] == pytest.approx(2e-4) and min(floor) == pytest.approx(2e-4)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--lr_scheduler_type", "wsd"], "wsd needs --decay_steps N >= 1"),
        (["--lr_scheduler_type", "wsd", "--decay_steps", "590", "--warmup_steps", "20"],
         "warm-up 20 \\+ decay_steps 590 exceed max_steps 600"),
        (["--decay_steps", "10"], "--decay_steps applies to --lr_scheduler_type wsd only \\(this run: cosine\\)"),
        (["--lr_scheduler_type", "linear", "--min_lr_ratio", "0.1"], "--min_lr_ratio applies to --lr_scheduler_type wsd or cosine only"),
        (["--min_lr_ratio", "1"], "min_lr_ratio=1.0 must be in \\[0, 1\\)"),
        (["--lr_scheduler_type", "wsd", "--decay_steps", "5", "--decay_type", "exp"], "decay_type='exp' is unknown"),
        (["--lr_scheduler_type", "step"], "lr_scheduler_type='step' is unknown"),
        (["--max_time", "soon"], "max_time='soon' is no duration > 0: write e.g. 2h, 90m"),
        (["--max_time", "0m"], "max_time='0m' is no duration"),
    ],
)  # fmt: skip
def test_schedule_and_budget_settings_are_checked_before_anything_runs(flags, message):
    with pytest.raises(ValueError, match=message):
        training_args(*flags)


def test_durations_read_as_people_write_them():
    assert [parse_duration(t, "max_time") for t in ("2h", "90m", "1h30m", "45s", "3600", "1.5h")] == [
        7200, 5400, 5400, 45, 3600, 5400,
    ]  # fmt: skip


def test_a_schedule_may_change_only_where_the_rates_so_far_stay_the_same():
    def schedule(*flags):
        return training_args("--warmup_steps", "10", *flags).schedule

    stable = schedule("--lr_scheduler_type", "wsd", "--decay_steps", "100", "--max_steps", "1000")
    longer = schedule("--lr_scheduler_type", "wsd", "--decay_steps", "100", "--max_steps", "2000")
    constant = schedule("--lr_scheduler_type", "constant")
    assert schedule_problem(stable, longer, 900) is None  # still stable at step 900: it may be extended
    assert "their rates differ from step 901 on" in schedule_problem(stable, longer, 950)  # decaying: it may not
    assert schedule_problem(constant, stable, 900) is None  # a decay branched from a constant run
    cosine = schedule("--max_steps", "1000"), schedule("--max_steps", "2000")
    assert schedule_problem(*cosine, 10) is None  # still warming up: both plans agree so far
    assert "differ from step 11 on" in schedule_problem(*cosine, 20)  # decaying to another end
    old_record = {"lr_scheduler_type": "cosine", "warmup_steps": 0, "decays_to_step": 6}  # before decay settings
    assert rate_factors(old_record, 6) == rate_factors(
        training_args("--max_steps", "6", "--warmup_steps", "0").schedule, 6
    )


@pytest.mark.loop
def test_an_extended_wsd_run_equals_the_run_planned_that_long():
    run("--run_name", "wsd6", "--max_steps", "6", *WSD)
    run("--run_name", "wsd8", "--max_steps", "8", *WSD)
    with pytest.raises(CheckpointError, match="their rates differ from step 5 on"):  # step 6 has decayed
        run("--run_name", "wsd6", "--max_steps", "8", *WSD, "--resume_from_checkpoint", "auto")
    stable = "runs/wsd6/checkpoints/step_0000004"  # the last step of its stable phase
    assert run("--run_name", "wsd6", "--max_steps", "8", *WSD, "--resume_from_checkpoint", stable) == 0
    assert train_losses("wsd6") == train_losses("wsd8")
    extended, planned = (load_file(f"runs/{name}/final/model.safetensors") for name in ("wsd6", "wsd8"))
    assert extended.keys() == planned.keys() and all(torch.equal(extended[k], planned[k]) for k in extended)
    assert sorted(p.name for p in Path("runs/wsd6/abandoned").iterdir())[0].startswith("from-step-4")


@pytest.mark.loop
def test_max_time_stops_with_a_checkpoint_and_a_final_model_that_resume_exactly():
    run("--run_name", "whole", "--max_steps", "3", "--save_steps", "0")
    assert run("--run_name", "timed", "--max_steps", "3", "--save_steps", "0", "--max_time", "0.001s") == 0
    summary = json.loads(Path("runs/timed/summary.json").read_text())
    assert summary["steps"] == 1 and summary["max_time"]["stopped_by_max_time"] is True
    assert summary["max_time"]["budget_s"] == 0.001 and not summary["preempted"]
    assert Path("runs/timed/final/model.safetensors").is_file()
    assert [p.name for p in Path("runs/timed/checkpoints").iterdir()] == ["step_0000001"]
    assert run("--run_name", "timed", "--max_steps", "3", "--save_steps", "0", "--resume_from_checkpoint", "auto") == 0
    assert train_losses("timed") == train_losses("whole")  # bitwise: the stop changed nothing
    assert json.loads(Path("runs/timed/summary.json").read_text())["steps"] == 3


@pytest.mark.loop
def test_a_non_finite_gradient_with_a_finite_loss_skips_the_update(monkeypatch, capsys):
    real = mlm.build_model

    def with_one_infinite_gradient(*args, **kwargs):
        model = real(*args, **kwargs)
        calls = {"n": 0}

        def first_backward_overflows(grad):
            calls["n"] += 1
            return grad + math.inf if calls["n"] == 1 else grad

        model.get_input_embeddings().weight.register_hook(first_backward_overflows)
        return model

    monkeypatch.setattr(mlm, "build_model", with_one_infinite_gradient)
    assert run("--run_name", "inf", "--max_steps", "3") == 0
    assert "non-finite gradient norm at step 1 (update skipped)" in capsys.readouterr().out
    weights = load_file("runs/inf/final/model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())  # applied, the clip would have written NaNs
    logged = [json.loads(line) for line in Path("runs/inf/metrics.jsonl").read_text().splitlines()]
    # the rate logged after a step is the next one's: after the skipped step 1 the scheduler has not advanced
    assert [r["lr"] for r in logged if r["kind"] == "train"] == pytest.approx([5e-4, 5e-4 * 0.75, 5e-4 * 0.25])


def test_tf32_is_turned_on_where_the_gpu_has_it_and_off_on_request(monkeypatch):
    from types import SimpleNamespace

    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        assert set_tf32(True, SimpleNamespace(device=torch.device("cpu"))) == "not available (cpu)"
        assert torch.get_float32_matmul_precision() == "highest"
        gpu = SimpleNamespace(device=torch.device("cuda", 0))
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (8, 6))  # an RTX 3080/3090
        assert set_tf32(True, gpu) == "on" and torch.get_float32_matmul_precision() == "high"
        assert torch.backends.cudnn.allow_tf32
        assert set_tf32(False, gpu) == "off (--no_tf32)" and torch.get_float32_matmul_precision() == "highest"
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (7, 5))
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device: "Tesla T4")
        assert set_tf32(True, gpu) == "not available (Tesla T4)"
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]
    assert training_args("--no_tf32").tf32 is False and training_args().tf32 is True


@pytest.mark.loop
def test_an_fp16_overflow_backs_the_loss_scale_off_and_the_run_goes_on(monkeypatch, capsys):
    """fp16 without DeepSpeed: the skipped step still reaches the GradScaler (else the next clip raises "unscale_()
    has already been called"), whose scale halves; the next steps apply."""
    made = fp16_scaler_on_cpu(monkeypatch, mlm)
    real = mlm.build_model

    def with_one_overflow(*args, **kwargs):
        model = real(*args, **kwargs)
        overflowing_once(model.get_input_embeddings().weight)
        return model

    monkeypatch.setattr(mlm, "build_model", with_one_overflow)
    assert run("--run_name", "fp16", "--max_steps", "3", "--concept_losses", "none") == 0
    assert "non-finite gradient norm at step 1 (update skipped)" in capsys.readouterr().out
    [accelerator] = made
    assert accelerator.scaler.get_scale() == 2.0**15  # halved once; no growth within 3 steps
    logged = [json.loads(line) for line in Path("runs/fp16/metrics.jsonl").read_text().splitlines()]
    norms = [r["grad_norm"] for r in logged if r["kind"] == "train"]
    assert norms[0] is None and all(math.isfinite(n) and n > 0 for n in norms[1:])  # inf: null; steps 2, 3 applied
    assert [r["lr"] for r in logged if r["kind"] == "train"] == pytest.approx([5e-4, 5e-4 * 0.75, 5e-4 * 0.25])
    weights = load_file("runs/fp16/final/model.safetensors")
    assert all(w.dtype == torch.float32 and torch.isfinite(w).all() for w in weights.values())
