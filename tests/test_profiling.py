"""`--profile_steps a:b` (a torch.profiler trace and the op table in the run folder) and `--dataloader_num_workers`
(workers collate, a background thread masks the next window during a step): the same losses and masks as the
loop without workers, the same checkpoints, and an exact resume."""

import json
import os
from pathlib import Path

import pytest
import torch
from loop_runs import fresh_accelerate, records, run, train_losses, workdir  # noqa: F401 (fixtures)

from concept_encoder.training.args import FINETUNE_ARGUMENT_CLASSES, parse_args

pytestmark = pytest.mark.loop
# 46 training blocks (2% of the documents): 2 windows of 2 × 8 an epoch, so 4 steps cross an epoch and step 2's
# checkpoint falls on its end, where masking ahead has already turned the loader to the next epoch
STEPS = ["--max_steps", "4", "--gradient_accumulation_steps", "2", "--save_steps", "2", "--save_total_limit", "2",
         "--validation_split_percentage", "98"]  # fmt: skip


@pytest.fixture(scope="module")
def without_workers(workdir):
    """Run `w0`: 4 steps of 2 micro-batches over 2 epochs, masked in the loop, checkpoints at 2 and 4."""
    os.chdir(workdir)
    run("--run_name", "w0", *STEPS)
    return workdir / "runs" / "w0"


def checkpoint_position(run_dir: Path, step: int) -> tuple[dict, torch.Tensor]:
    folder = run_dir / "checkpoints" / f"step_{step:07d}"
    state = json.loads((folder / "train_state.json").read_text())
    generator = torch.load(folder / "collator_rank0.pt", weights_only=True)["generator"]
    return {k: state[k] for k in ("step", "epoch", "batches_in_epoch")}, generator


def test_workers_mask_ahead_with_the_same_losses_checkpoints_and_an_exact_resume(without_workers, workdir):
    run("--run_name", "w2", *STEPS, "--dataloader_workers", "2")  # the alias of --dataloader_num_workers
    assert json.loads(Path("runs/w2/config.json").read_text())["training_args"]["dataloader_num_workers"] == 2
    assert train_losses("w2") == train_losses("w0")  # bitwise: the same batches, masks and dropout
    assert records("w2", "eval")[-1]["eval_loss"] == records("w0", "eval")[-1]["eval_loss"]
    for step in (2, 4):  # window 3 was masked ahead when step 2 saved: its checkpoint holds window 2's end
        (position, generator), (expected, expected_generator) = (
            checkpoint_position(Path("runs/w2"), step), checkpoint_position(without_workers, step)
        )  # fmt: skip
        assert position == expected and torch.equal(generator, expected_generator)
    assert checkpoint_position(Path("runs/w2"), 2)[0] == {"step": 2, "epoch": 0, "batches_in_epoch": 4}
    assert checkpoint_position(Path("runs/w2"), 4)[0] == {"step": 4, "epoch": 1, "batches_in_epoch": 4}
    run("--run_name", "w2-resumed", *STEPS, "--dataloader_num_workers", "2",
        "--resume_from_checkpoint", "runs/w2/checkpoints/step_0000002")  # fmt: skip
    assert [r["step"] for r in records("w2-resumed", "train")] == [3, 4]
    assert train_losses("w2-resumed") == train_losses("w0")[2:]  # exact continuation
    assert records("w2-resumed", "eval")[-1]["eval_loss"] == records("w0", "eval")[-1]["eval_loss"]


def test_profile_steps_write_a_trace_and_the_op_table_and_change_no_loss(without_workers, capsys):
    run("--run_name", "prof", *STEPS, "--profile_steps", "2:3")
    folder = Path("runs/prof/profile")
    assert sorted(p.name for p in folder.iterdir()) == ["ops.txt", "trace_step2-3.json"]
    events = json.loads((folder / "trace_step2-3.json").read_text())["traceEvents"]
    steps = sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})
    assert steps == ["ProfilerStep#1", "ProfilerStep#2"]  # the profiler's steps 1-2: optimizer steps 2 and 3
    assert any(e.get("name") == "aten::mm" for e in events) and len(events) > 100
    table = (folder / "ops.txt").read_text()
    assert "Self CPU" in table and "aten::" in table
    logged = "".join(capsys.readouterr())
    assert "profile of steps 2-3: runs/prof/profile/trace_step2-3.json" in logged and table.strip() in logged
    assert train_losses("prof") == train_losses("w0")  # recording changes nothing that is trained


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("3", "is not a step range a:b, e.g. 10:12"),
        ("2-3", "is not a step range a:b"),
        ("3:2", r"need 1 <= a <= b <= max_steps \(4\)"),
        ("0:2", r"need 1 <= a <= b <= max_steps \(4\); steps are 1-based optimizer steps"),
        ("3:5", r"need 1 <= a <= b <= max_steps \(4\)"),
    ],
)
def test_a_bad_profile_range_is_refused_with_what_to_give(value, message):
    with pytest.raises(ValueError, match=f"profile_steps='{value}'.*{message}"):
        parse_args(["--max_steps", "4", "--profile_steps", value])


def test_fine_tuning_refuses_profile_steps():
    with pytest.raises(ValueError, match=r"does not support \['--profile_steps'\]"):
        parse_args(["--model_name_or_path", "m", "--task", "embedded", "--profile_steps", "1:2"],
                   classes=FINETUNE_ARGUMENT_CLASSES)  # fmt: skip
