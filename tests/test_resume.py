"""Resuming a run: exact continuation from its own or another run's checkpoint, a rollback that sets the
later history aside, the run's own tokenizer kept, the checkpoint `auto` picks (the highest intact step),
and resumes that cannot continue refused before anything is written."""

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from loop_runs import (  # noqa: F401 (fixtures)
    finished_run,
    fresh_accelerate,
    records,
    run,
    train_losses,
    workdir,
)

from concept_encoder.checkpoints.checkpoint import CheckpointError, resolve_resume
from concept_encoder.common.faults import RunFolderError

pytestmark = pytest.mark.loop


def tree_digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def test_resuming_another_runs_checkpoint_continues_in_the_new_run_and_leaves_it_untouched(finished_run):
    before = tree_digest(finished_run)
    run("--run_name", "b", "--max_steps", "6", "--save_steps", "2", "--save_total_limit", "1",
        "--resume_from_checkpoint", str(finished_run / "checkpoints/step_0000004"))  # fmt: skip
    assert tree_digest(finished_run) == before
    assert [r["step"] for r in records("b", "train")] == [5, 6]
    assert train_losses("b") == train_losses("a")[4:]  # exact continuation
    assert (Path("runs/b/final/model.safetensors")).exists()
    assert [p.name for p in Path("runs/b/checkpoints").iterdir()] == ["step_0000006"]


def test_a_resumed_run_counts_its_earlier_invocations_wall_clock_and_cpu_threads(finished_run, tmp_path, capsys):
    """A checkpoint keeps the run's wall-clock so far (`seconds`) and a resume adds its own time to it: the summary's
    `train_seconds` is the whole run's, not the last invocation's. It keeps the CPU threads each invocation ran with
    as well: a resume under another count (CPU sums round differently) is warned about and recorded as both."""
    from concept_encoder.checkpoints.checkpoint import write_manifest

    threads = torch.get_num_threads()
    assert json.loads(Path("runs/a/summary.json").read_text())["cpu_threads"] == threads  # one count: the number
    source = finished_run / "checkpoints/step_0000004"
    state = json.loads((source / "train_state.json").read_text())
    assert state["seconds"] > 0 and state["cpu_threads"] == [threads]
    earlier = tmp_path / "earlier" / "checkpoints" / "step_0000004"  # as if the first 4 steps had taken 10,000 s
    shutil.copytree(source, earlier)  # ... with one thread more
    (earlier / "train_state.json").write_text(json.dumps({**state, "seconds": 10000.0, "cpu_threads": [threads + 1]}))
    write_manifest(earlier)
    run("--run_name", "later", "--max_steps", "6", "--save_steps", "6", "--resume_from_checkpoint", str(earlier))
    summary = json.loads(Path("runs/later/summary.json").read_text())
    assert 10000 <= summary["train_seconds"] < 10000 + 600
    assert json.loads(Path("runs/a/summary.json").read_text())["train_seconds"] < 600
    assert summary["cpu_threads"] == [threads + 1, threads]
    assert f"resumed with {threads} CPU thread(s) where the run ran with {threads + 1} until step 4" in (
        capsys.readouterr().out)  # fmt: skip
    assert json.loads((Path("runs/later/checkpoints/step_0000006/train_state.json")).read_text())["cpu_threads"] == [
        threads + 1, threads]  # fmt: skip


def test_cpu_threads_are_recorded_once_per_count_and_warned_about_on_the_cpu_only(caplog):
    from concept_encoder.checkpoints.checkpoint import TrainState, record_cpu_threads

    threads = torch.get_num_threads()
    state = TrainState()
    assert record_cpu_threads(state, "cpu") == threads  # a fresh run
    state.step = 8
    assert record_cpu_threads(state, "cpu") == threads and state.cpu_threads == [threads]  # resumed, same count
    assert not caplog.records
    moved = TrainState(step=8, cpu_threads=[threads + 1])
    assert record_cpu_threads(moved, "cuda") == [threads + 1, threads] and not caplog.records  # GPU math: no warning
    legacy = TrainState(step=8)  # a checkpoint written before counts were kept: its invocations' count unknown
    assert record_cpu_threads(legacy, "cpu") == [None, threads] and not caplog.records  # nothing known to differ
    assert record_cpu_threads(moved, "cpu") == [threads + 1, threads]  # already recorded: not added twice
    assert not caplog.records  # warned about when the count changes, i.e. at the resume that changed it only


def test_a_rollback_sets_the_later_history_aside_and_the_run_keeps_one_history(workdir, capsys):
    os.chdir(workdir)
    common = [
        "--run_name",
        "h",
        "--max_steps",
        "6",
        "--save_steps",
        "2",
        "--save_total_limit",
        "3",
        "--eval_steps",
        "3",
    ]
    run(*common)
    before = tree_digest(Path("runs/h"))
    first_losses = train_losses("h")
    run(*common, "--resume_from_checkpoint", "runs/h/checkpoints/step_0000002")  # back to step 2
    [aside] = Path("runs/h/abandoned").iterdir()
    out = capsys.readouterr()
    assert aside.name.startswith("from-step-2-") and f"moved to runs/h/abandoned/{aside.name}" in out.out + out.err
    kept = tree_digest(aside)  # the abandoned branch, whole: later checkpoints, final model, summary, metrics
    for name in ("checkpoints/step_0000004/model.safetensors", "checkpoints/step_0000006/model.safetensors",
                 "final/model.safetensors", "summary.json", "metrics.jsonl"):  # fmt: skip
        assert kept[name] == before[name], name
    steps = [r["step"] for r in records("h", "train")]
    assert steps == sorted(set(steps)) == [1, 2, 3, 4, 5, 6]  # one history: no step logged twice
    assert train_losses("h") == first_losses  # the new branch (exact resume) retraced the old one
    assert sorted(p.name for p in Path("runs/h/checkpoints").iterdir()) == ["step_0000002", "step_0000004",
                                                                           "step_0000006"]  # fmt: skip
    assert resolve_resume("auto", "runs", "h").name == "step_0000006"  # auto never looks in abandoned/
    run(*common, "--resume_from_checkpoint", "auto")  # finished: nothing set aside, nothing changed
    assert len(list(Path("runs/h/abandoned").iterdir())) == 1


def test_a_resume_keeps_the_runs_tokenizer_whatever_happens_to_the_cache(workdir, capsys):
    from concept_encoder.data import load_tokenizer
    from concept_encoder.data.tokenizer import vocab_digest

    os.chdir(workdir)
    common = ["--run_name", "tok", "--max_steps", "4", "--save_steps", "2", "--save_total_limit", "2"]
    run(*common)
    first_losses = train_losses("tok")
    own = load_tokenizer("runs/tok/tokenizer")
    [cache] = [p for p in Path("Cache/tokenizers").glob("wordpiece-2000-*") if p.is_dir()]
    assert vocab_digest(load_tokenizer(str(cache))) == vocab_digest(own)
    try:
        swap_the_cache_and_resume(workdir, cache, common, first_losses)
    finally:  # the module's later runs share this cache: give them the original back
        shutil.rmtree(cache, ignore_errors=True)
        own.save_pretrained(cache)


def swap_the_cache_and_resume(workdir, cache: Path, common: list[str], first_losses: list[float]) -> None:
    from concept_encoder.data import load_tokenizer

    # another training of the same spec lands in the cache (trainings differ): the resume must not notice it
    other = load_tokenizer("train:wordpiece:2000", texts=iter(["entirely different words here"] * 50),
                           corpus_id="other", cache_dir=workdir / "elsewhere")  # fmt: skip
    shutil.rmtree(cache)
    other.save_pretrained(cache)
    run(*common, "--max_steps", "4", "--resume_from_checkpoint", "runs/tok/checkpoints/step_0000002")
    assert train_losses("tok") == first_losses  # continued with its own ids, exactly
    shutil.rmtree("runs/tok/tokenizer")  # a run without its own copy (older runs): the digest refuses the cache's
    with pytest.raises(CheckpointError, match="data.vocab_sha256: checkpoint .* the tokenizer cache holds a different"):
        run(*common, "--resume_from_checkpoint", "runs/tok/checkpoints/step_0000002")


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (["--preset", "tiny"], "model.hidden_size: checkpoint 64, this run 128"),
        (["--per_device_train_batch_size", "4"], "per_device_train_batch_size: checkpoint 8, this run 4"),
        (["--max_seq_length", "32"], "data.max_seq_length: checkpoint 64, this run 32"),
        (["--torch_compile"], "torch_compile: checkpoint False, this run True"),  # compiled weights are renamed
        # what decides training: config.json would claim the new value while the restored state kept the old one
        (["--learning_rate", "0.05"], "args.learning_rate: checkpoint 0.0005, this run 0.05"),
        (["--seed", "7"], "args.seed: checkpoint 42, this run 7"),
        (["--mlm_probability", "0.3"], "args.mlm_probability: checkpoint 0.15, this run 0.3"),
        (["--concept_losses", "none"], "args.concept_losses: checkpoint"),
        (["--max_grad_norm", "0"], "args.max_grad_norm: checkpoint 1.0, this run 0.0"),
        (
            [],
            "schedule: the checkpoint ran cosine decay to 0 of the peak at step 6 after a warm-up of 0 steps, this "
            "run plans cosine decay to 0 of the peak at step 8 after a warm-up of 0 steps; their rates differ from "
            "step 1 on",
        ),  # fmt: skip
    ],
)
def test_a_resume_that_cannot_continue_is_refused_before_anything_is_written(finished_run, change, named):
    before = tree_digest(finished_run)
    with pytest.raises(CheckpointError, match="cannot resume") as error:
        run("--run_name", "a", "--max_steps", "8", "--resume_from_checkpoint", "auto", *change)
    assert named in str(error.value)
    assert tree_digest(finished_run) == before


def test_a_checkpoint_written_before_arguments_were_recorded_is_checked_against_the_runs_config(finished_run):
    import json

    from concept_encoder.checkpoints.checkpoint import write_manifest

    old = finished_run.parent / "old-format"
    shutil.copytree(finished_run, old)
    for checkpoint in (old / "checkpoints").iterdir():  # as checkpoints were written before args.* existed
        path = checkpoint / "resume_settings.json"
        path.write_text(
            json.dumps({k: v for k, v in json.loads(path.read_text()).items() if not k.startswith("args.")})
        )
        write_manifest(checkpoint)
    with pytest.raises(CheckpointError, match="args.learning_rate: checkpoint 0.0005, this run 0.05"):
        run(
            "--run_name",
            "old-format",
            "--max_steps",
            "6",
            "--resume_from_checkpoint",
            "auto",
            "--learning_rate",
            "0.05",
        )


def test_auto_on_a_finished_run_says_so_and_changes_nothing(finished_run, capsys):
    before = tree_digest(finished_run)
    assert run("--run_name", "a", "--max_steps", "6", "--resume_from_checkpoint", "auto") == 0
    assert "already finished at step 6" in capsys.readouterr().out
    assert tree_digest(finished_run) == before


def test_auto_past_a_finished_run_without_checkpoints_is_refused_and_changes_nothing(finished_run):
    target = finished_run.parent / "kept-none"
    shutil.copytree(finished_run, target)
    shutil.rmtree(target / "checkpoints")  # as a run with --save_steps 0 leaves it
    before = tree_digest(target)
    with pytest.raises(RunFolderError, match="ended at step 6 and kept no checkpoint to continue from .*step 8"):
        run("--run_name", "kept-none", "--max_steps", "8", "--resume_from_checkpoint", "auto")
    assert tree_digest(target) == before  # a fresh start would have replaced its final model


def copy_run(source: Path, name: str) -> Path:
    target = source.parent / name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(source, target)
    (target / "summary.json").unlink()
    return target


def test_auto_picks_the_highest_intact_step_and_names_damage(finished_run, caplog):
    copy_run(finished_run, "damaged")
    checkpoints = Path("runs/damaged/checkpoints")
    time.sleep(0.01)
    os.utime(checkpoints / "step_0000002")  # the newest folder time: `auto` must still go by step
    assert resolve_resume("auto", "runs", "damaged") == checkpoints / "step_0000006"
    model = checkpoints / "step_0000006" / "model.safetensors"
    model.write_bytes(model.read_bytes()[:100])
    assert resolve_resume("auto", "runs", "damaged") == checkpoints / "step_0000004"
    assert "model.safetensors is truncated or changed (100 of" in caplog.text
    with pytest.raises(CheckpointError, match="model.safetensors is truncated.*newest intact checkpoint"):
        resolve_resume(str(checkpoints / "step_0000006"), "runs", None)
    (checkpoints / "step_0000004" / "random_states_0.pkl").unlink()
    with pytest.raises(CheckpointError, match="random_states_0.pkl is missing"):
        resolve_resume(str(checkpoints / "step_0000004"), "runs", None)
    assert resolve_resume("auto", "runs", "damaged") == checkpoints / "step_0000002"
    run("--run_name", "damaged", "--max_steps", "6", "--resume_from_checkpoint", "auto")
    assert [r["step"] for r in records("damaged", "train")] == [1, 2, 3, 4, 5, 6]  # each step once
    assert train_losses("damaged") == train_losses("a")


def test_another_process_count_is_refused_where_the_state_cannot_move(tmp_path):
    from concept_encoder.checkpoints.checkpoint import TrainState, resharded_position
    from concept_encoder.training.resume import split_processes

    saved = {
        "world_size": 2,
        "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 1,
        "data.streaming": False,
    }
    one = {**saved, "world_size": 1, "gradient_accumulation_steps": 2}
    assert split_processes(saved, one, tmp_path)[2] is None  # the same global batch: it may move
    four = {**saved, "world_size": 4}
    assert "use a process count that divides 2" in split_processes(saved, four, tmp_path)[2]
    (tmp_path / "pytorch_model").mkdir()
    shard = tmp_path / "pytorch_model" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": {"zero_stage": 2}}, shard)
    assert split_processes(saved, one, tmp_path)[2] is None  # ZeRO-1/2: through a universal checkpoint
    torch.save({"optimizer_state_dict": {"zero_stage": 3}}, shard)
    assert (
        "(a ZeRO-3 checkpoint: its weights are partitioned over 2 ranks; resume it with 2 processes, or export"
        in split_processes(saved, one, tmp_path)[2]
    )
    streamed = {**saved, "data.streaming": True}
    assert "--streaming" in split_processes(streamed, {**one, "data.streaming": True}, tmp_path / "none")[2]
    assert resharded_position(TrainState(batches_in_epoch=3), 2, 1).batches_in_epoch == 6
    with pytest.raises(CheckpointError, match="3 batches into its epoch, which 2 processes cannot share"):
        resharded_position(TrainState(batches_in_epoch=3), 1, 2)
