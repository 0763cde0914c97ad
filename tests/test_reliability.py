"""Faults and bad inputs (issue 13): no run writes into another, damaged checkpoints, changed data,
preemption through the launcher, early validation, clear messages, divergence, a travelling model."""

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from loop_runs import (  # noqa: F401 (fixtures)
    COMMON,
    ROOT,
    fresh_accelerate,
    load_without_the_package,
    records,
    run,
    train_losses,
    workdir,
)

from concept_encoder.training.checkpoint import CheckpointError, resolve_resume
from concept_encoder.training.runs import RunFolderError


def tree_digest(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


@pytest.fixture(scope="module")
def finished_run(workdir):
    """Run `a`: 6 steps, checkpoints at 2, 4, 6 (all kept), finished."""
    os.chdir(workdir)
    run("--run_name", "a", "--max_steps", "6", "--save_steps", "2", "--save_total_limit", "3", "--eval_steps", "3")
    return workdir / "runs" / "a"


# ---------------------------------------------------------------- 1. a run never writes into another run


def test_resuming_another_runs_checkpoint_continues_in_the_new_run_and_leaves_it_untouched(finished_run):
    before = tree_digest(finished_run)
    run("--run_name", "b", "--max_steps", "6", "--save_steps", "2", "--save_total_limit", "1",
        "--resume_from_checkpoint", str(finished_run / "checkpoints/step_0000004"))  # fmt: skip
    assert tree_digest(finished_run) == before
    assert [r["step"] for r in records("b", "train")] == [5, 6]
    assert train_losses("b") == train_losses("a")[4:]  # exact continuation
    assert (Path("runs/b/final/model.safetensors")).exists()
    assert [p.name for p in Path("runs/b/checkpoints").iterdir()] == ["step_0000006"]


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


def test_a_damaged_tokenizer_cache_entry_is_named_and_rebuilt(tmp_path, monkeypatch):
    from concept_encoder.data import tokenizer as tokenizers

    warnings = []
    monkeypatch.setattr(tokenizers.logger, "warning", lambda text, *args: warnings.append(text % args))
    texts = ["alpha beta gamma delta", "epsilon zeta eta theta"] * 20
    path = tmp_path / "wordpiece-300-x"
    first = tokenizers.cached_trained_tokenizer(path, "train:wordpiece:300", "wordpiece", 300, iter(texts))
    (path / "tokenizer.json").write_text("{ not json")
    again = tokenizers.cached_trained_tokenizer(path, "train:wordpiece:300", "wordpiece", 300, iter(texts))
    assert len(warnings) == 1 and warnings[0].startswith(f"tokenizer cache {path} does not load (")
    assert warnings[0].endswith("rebuilding it") and len(again) == len(first)  # retrained: ids may differ (README)
    reread = tokenizers.cached_trained_tokenizer(path, "train:wordpiece:300", "wordpiece", 300, None)  # no training
    assert reread.get_vocab() == again.get_vocab()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["wordpiece-300-x", "wordpiece-300-x.lock"]  # no partials


def test_steps_without_a_masked_token_are_warned_about_and_never_logged_as_loss_0(workdir, capsys):
    import math

    os.chdir(workdir)
    run("--run_name", "sparse", "--max_steps", "4", "--mlm_probability", "0.0005", "--concept_losses", "none")
    out = capsys.readouterr()
    assert "about 78.0% of micro-batches will have no masked token" in out.out + out.err  # (1 - 0.0005) ** (8 * 62)
    losses = train_losses("sparse")
    summary = json.loads(Path("runs/sparse/summary.json").read_text())
    empty = summary["steps_without_masked_tokens"]
    assert empty >= 1 and sum(math.isnan(x) for x in losses) == empty and 0.0 not in losses


def test_compare_shows_an_unfinished_run_and_a_cut_metrics_line_is_named_not_fatal(finished_run, tmp_path, monkeypatch):
    from concept_encoder.compare import compare
    from concept_encoder.training import tracking

    warnings = []
    monkeypatch.setattr(tracking.logger, "warning", lambda text, *args: warnings.append(text % args))
    going = tmp_path / "going"
    going.mkdir()
    shutil.copy(finished_run / "config.json", going / "config.json")
    lines = (finished_run / "metrics.jsonl").read_text().splitlines()
    (going / "metrics.jsonl").write_text("\n".join(lines[:-1]) + '\n{"kind": "train", "step": 6, "lo')  # cut short
    result = compare([finished_run, going], report_dir=tmp_path / "reports")
    last_step = max(json.loads(line)["step"] for line in lines[:-1])
    assert f"going (running / unfinished, step {last_step})" in result["text"]
    assert result["metrics"]["eval_loss"][1] == [json.loads(x) for x in lines[:-1] if '"eval"' in x][-1]["eval_loss"]
    assert warnings == [f"{going / 'metrics.jsonl'} line {len(lines)} is not a metrics record (cut short?): skipped"]
    tracking.MetricsWriter(going / "metrics.jsonl").drop_after(3)  # what a resume does: the cut line goes too
    assert [r["step"] for r in tracking.read_metrics(going / "metrics.jsonl")] == [
        json.loads(x)["step"] for x in lines[:-1] if json.loads(x)["step"] <= 3
    ]


@pytest.mark.parametrize(
    ("tool", "argv", "message"),
    [
        ("check_health", ["some/model", "--batches", "0"], "argument --batches: 0 is below 1"),
        ("check_health", ["some/model", "--batch_size", "two"], "argument --batch_size: 'two' is not a whole number"),
        ("data", ["--seed", "-1"], "argument --seed: -1 is below 0"),
        ("ablate", ["--vary", "a=1,2", "--decide", "eval_loss", "--num_processes", "0"], "--num_processes: 0 is below"),
        ("zero_compare", ["--steps", "0"], "argument --steps: 0 is below 1"),
        ("check_plan", ["--num_processes", "0"], "argument --num_processes: 0 is below 1"),
    ],
)
def test_every_tool_range_checks_its_numbers_in_one_line(tool, argv, message, capsys):
    import importlib

    modules = {"check_health": "concept_encoder.check_health", "data": "concept_encoder.data.__main__",
               "ablate": "concept_encoder.ablate", "zero_compare": "launch.zero_compare", "check_plan": "launch.check_plan"}  # fmt: skip
    with pytest.raises(SystemExit) as stopped:
        importlib.import_module(modules[tool]).main(argv)
    assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_a_ds_config_out_of_range_is_one_line_for_the_plan_checker_and_the_loop(tmp_path, monkeypatch, capsys):
    from launch import check_plan

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"zero_optimization": {"stage": 4, "offload_param": {"device": "gpu"}},
                               "train_micro_batch_size_per_gpu": 0}))  # fmt: skip
    assert check_plan.main(["--profile", "cpu", "--ds_config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "zero_optimization.stage=4 must be 0, 1, 2 or 3" in err and "offload_param.device='gpu'" in err
    assert "train_micro_batch_size_per_gpu=0 must be a number >= 1" in err
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")  # what `accelerate launch --deepspeed_config_file` sets
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(bad))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ValueError, match="the DeepSpeed config of this launch is out of range: zero_optimization.stage=4"
    ):
        run("--run_name", "bad-ds")
    assert not Path("runs/bad-ds").exists()


def test_a_setting_given_twice_in_a_yaml_config_is_refused_naming_it(tmp_path):
    from concept_encoder.training.args import parse_args

    config = yaml_file(tmp_path, "learning_rate: 1e-3\nmax_steps: 10\nlearning_rate: 5e-4\n")
    with pytest.raises(ValueError, match="duplicate key 'learning_rate': give each setting once"):
        parse_args(["--config", str(config)])


@pytest.mark.parametrize("error", [OSError(28, "No space left on device"),
                                   RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 960 vs 888")])  # fmt: skip
def test_a_full_disk_at_the_final_save_removes_the_partial_model_and_names_the_last_checkpoint(workdir, monkeypatch,
                                                                                                error):  # fmt: skip
    import transformers.modeling_utils

    from concept_encoder.training.checkpoint import DiskFullError

    os.chdir(workdir)

    def full(*args, **kwargs):
        raise error

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    name = f"full-{type(error).__name__}"
    with pytest.raises(DiskFullError, match=f"while saving the model runs/{name}/final .* the last intact checkpoint "
                                            f"is runs/{name}/checkpoints/step_0000002"):  # fmt: skip
        run("--run_name", name, "--max_steps", "2", "--save_steps", "2")
    assert not Path(f"runs/{name}/final").exists() and not list(Path(f"runs/{name}").glob("final.partial*"))


def test_written_aside_moves_a_whole_file_or_folder_into_place_and_removes_a_failed_one(tmp_path):
    from concept_encoder.paths import written_aside

    target = tmp_path / "config.json"
    target.write_text("old")
    with pytest.raises(OSError, match="no space"), written_aside(target) as partial:
        partial.write_text("half")
        raise OSError(28, "no space left on device")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]
    with written_aside(target) as partial:
        partial.write_text("new")
        assert target.read_text() == "old"  # readers see the old file until the block completes
    assert target.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]

    folder = tmp_path / "final"
    folder.mkdir()
    (folder / "old.bin").write_bytes(b"1")
    with pytest.raises(OSError), written_aside(folder) as partial:  # an existing folder is kept unless asked
        partial.mkdir()
    assert (folder / "old.bin").exists() and not list(tmp_path.glob("final.partial*"))
    with pytest.raises(KeyboardInterrupt), written_aside(folder, replace_existing=True) as partial:
        partial.mkdir()
        raise KeyboardInterrupt
    assert (folder / "old.bin").exists() and not list(tmp_path.glob("final.partial*"))
    with written_aside(folder, replace_existing=True) as partial:
        partial.mkdir()
        (partial / "model.safetensors").write_bytes(b"2")
    assert sorted(p.name for p in folder.iterdir()) == ["model.safetensors"]
    assert not list(tmp_path.glob("final.partial*"))


def mount_tmpfs(folder: Path, options: str) -> str | None:
    """Mount a tmpfs at `folder`; None when mounted, else why not (not root, no mount command, no permission)."""
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True,
                              text=True, timeout=30)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as error:
        return str(error)
    return None if done.returncode == 0 else (done.stderr.strip() or f"mount exited {done.returncode}")


@pytest.fixture
def read_only_folder(tmp_path):
    """A read-only tmpfs mounted at a fresh folder (root on Linux); the test is skipped, saying why, elsewhere."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    if problem := mount_tmpfs(folder, "ro,size=1m"):
        pytest.skip(f"cannot mount a read-only tmpfs here ({problem})")
    yield folder
    subprocess.run(["umount", str(folder)], check=False)


def test_a_real_full_disk_at_a_checkpoint_is_one_line_and_leaves_no_partial_files(tmp_path, monkeypatch):
    from concept_encoder.training.checkpoint import DiskFullError

    disk = tmp_path / "small-disk"  # 3 MB: the run folder fits, a micro model's checkpoint (~4 MB) does not
    disk.mkdir()
    if problem := mount_tmpfs(disk, "size=3m"):
        pytest.skip(f"cannot mount a small tmpfs here ({problem})")
    try:
        monkeypatch.chdir(tmp_path)
        with pytest.raises(DiskFullError, match="no space left on the disk of .*small-disk/runs/full while saving the "
                                                "checkpoint of step 2 .* the last intact checkpoint is none"):  # fmt: skip
            run("--run_name", "full", "--output_dir", str(disk / "runs"), "--max_steps", "4", "--save_steps", "2")
        assert not list((disk / "runs" / "full" / "checkpoints").iterdir())  # the partial checkpoint is gone
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_read_only_output_and_cache_folders_are_one_line_before_any_model(tmp_path, read_only_folder, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(
        ValueError, match=f"--output_dir {read_only_folder}/runs is not writable .*Read-only file system"
    ):
        run("--run_name", "ro", "--output_dir", str(read_only_folder / "runs"))
    project = tmp_path / "project"
    project.mkdir()
    (project / "Cache").symlink_to(read_only_folder)
    monkeypatch.chdir(project)
    with pytest.raises(ValueError, match="the cache folder .* Cache is not writable .*run from a folder whose Cache"):
        run("--run_name", "ro")
    assert not Path("runs").exists()


def test_a_run_folder_deleted_while_training_ends_the_run_in_one_line(workdir, monkeypatch):
    import loops.mlm as mlm
    from concept_encoder.training.runs import RunFolderError

    os.chdir(workdir)
    original, calls = mlm.train_step, []

    def delete_then_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            shutil.rmtree("runs/gone")
        return original(*args, **kwargs)

    monkeypatch.setattr(mlm, "train_step", delete_then_step)
    with pytest.raises(RunFolderError, match="run folder runs/gone disappeared while training"):
        run("--run_name", "gone", "--max_steps", "4")
    assert not Path("runs/gone").exists()  # not silently recreated


class CreatesAFile:
    """Pickled, it names `Path.touch` as the function to call on loading: code run from a checkpoint."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


@pytest.mark.parametrize(
    ("state_file", "content", "message"),
    [
        ("collator_rank0.pt", "pickle", "is not a state file this project writes .* nothing from it ran"),
        ("scheduler.pt", "pickle", "is not a state file this project writes .* nothing from it ran"),
        ("collator_rank0.pt", "no generator", "lacks \\['generator'\\]: resuming without them would not continue"),
    ],
)
def test_a_checkpoint_runs_no_code_and_lacks_no_state(finished_run, tmp_path, state_file, content, message):
    import torch

    from concept_encoder.training.checkpoint import write_manifest

    crafted = tmp_path / "crafted" / "checkpoints" / "step_0000004"
    shutil.copytree(finished_run / "checkpoints/step_0000004", crafted)
    marker = tmp_path / "code-ran"
    torch.save({"generator": CreatesAFile(marker)} if content == "pickle" else {}, crafted / state_file)
    write_manifest(crafted)  # the sizes agree: only the content is hostile
    with pytest.raises(CheckpointError, match=message):
        run("--run_name", f"crafted-{len(content)}", "--max_steps", "6", "--save_steps", "2",
            "--resume_from_checkpoint", str(crafted))  # fmt: skip
    assert not marker.exists()


def test_reports_of_invocations_started_in_the_same_second_never_collide(finished_run, tmp_path):
    from concept_encoder.compare import compare
    from concept_encoder.report_files import claim_report_folder
    from concept_encoder.training.finetune_report import write_report

    first, second = (compare([finished_run], report_dir=tmp_path) for _ in range(2))
    assert first["markdown"] != second["markdown"]  # e.g. compare_<time>.md and compare_<time>_02.md
    for result in (first, second):  # each report whole, with its own plot
        assert (
            Path(result["png"]).is_file() and f"]({Path(result['png']).name})" in Path(result["markdown"]).read_text()
        )
    run_result = {"model": "m", "method": "fine-tune", "task": "t", "seed": 1, "validation": {"accuracy": 0.5},
                  "seconds": 1, "learning_rate": 1e-3, "best_step": 2}  # fmt: skip
    reports = [write_report([run_result], {}, tmp_path, "title")["json"] for _ in range(3)]
    assert len(set(reports)) == 3 and all(json.loads(p.read_text())["runs"] == [run_result] for p in reports)
    assert sorted(reports) == reports  # claimed order is name order: the newest report sorts last
    folders = [claim_report_folder(tmp_path, "zero_compare") for _ in range(3)]
    assert len(set(folders)) == 3 and all(f.is_dir() and not any(f.iterdir()) for f in folders)
    assert sorted(folders) == folders


def test_a_log_file_that_cannot_be_written_is_one_line_not_a_traceback_per_record(tmp_path, capsys):
    import logging

    from concept_encoder.training.logs import LogFileHandler

    handler = LogFileHandler(tmp_path / "run.log")

    class FullDisk:
        def write(self, text):
            raise OSError(28, "No space left on device")

        def flush(self):
            pass

    handler.stream = FullDisk()
    log = logging.getLogger("full-disk-test")
    log.addHandler(handler)
    for i in range(3):
        log.warning("record %d", i)
    err = capsys.readouterr().err
    assert err.count("cannot be written") == 1 and "No space left on device" in err and "Traceback" not in err
    log.removeHandler(handler)


def test_deepspeed_state_files_are_checked_before_deepspeed_unpickles_them(tmp_path):
    import torch
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from concept_encoder.training.checkpoint import verify_deepspeed_states

    sound = tmp_path / "sound" / "pytorch_model"
    sound.mkdir(parents=True)  # what a ZeRO-3 checkpoint's optimizer file holds besides tensors
    torch.save({"zero_stage": ZeroStageEnum(3), "loss_scaler": LossScaler(1.0), "flat": torch.ones(4)},
               sound / "zero_pp_rank_0_mp_rank_00_optim_states.pt")  # fmt: skip
    verify_deepspeed_states(sound.parent)
    crafted = tmp_path / "crafted" / "pytorch_model"
    crafted.mkdir(parents=True)
    marker = tmp_path / "code-ran"
    torch.save({"optimizer_state_dict": CreatesAFile(marker)}, crafted / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(CheckpointError, match="optim_states.pt is not a state file this project writes"):
        verify_deepspeed_states(crafted.parent)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (["--preset", "tiny"], "model.hidden_size: checkpoint 64, this run 128"),
        (["--per_device_train_batch_size", "4"], "per_device_train_batch_size: checkpoint 8, this run 4"),
        (["--max_seq_length", "32"], "data.max_seq_length: checkpoint 64, this run 32"),
        (["--torch_compile"], "torch_compile: checkpoint False, this run True"),  # compiled weights are renamed
    ],
)
def test_a_resume_that_cannot_continue_is_refused_before_anything_is_written(finished_run, change, named):
    before = tree_digest(finished_run)
    with pytest.raises(CheckpointError, match="cannot resume") as error:
        run("--run_name", "a", "--max_steps", "8", "--resume_from_checkpoint", "auto", *change)
    assert named in str(error.value)
    assert tree_digest(finished_run) == before


def test_auto_on_a_finished_run_says_so_and_changes_nothing(finished_run, capsys):
    before = tree_digest(finished_run)
    assert run("--run_name", "a", "--max_steps", "6", "--resume_from_checkpoint", "auto") == 0
    assert "already finished at step 6" in capsys.readouterr().out
    assert tree_digest(finished_run) == before


def test_a_fresh_start_into_a_used_folder_and_a_second_process_are_refused(finished_run):
    with pytest.raises(RunFolderError, match="already holds a run"):
        run("--run_name", "a", "--max_steps", "2")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from filelock import FileLock; lock = FileLock(sys.argv[1]); lock.acquire(); "
         "print('held', flush=True); time.sleep(120)", str(finished_run / ".lock")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderError, match="in use by another training process"):
            run("--run_name", "a", "--max_steps", "8", "--resume_from_checkpoint", "auto")
    finally:
        holder.kill()
        holder.wait()


# ---------------------------------------------------------------- 2. damaged checkpoints


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


# ---------------------------------------------------------------- 11. tests leave nothing running

LAUNCHER_WITH_RANKS = """
import subprocess, sys, time
ranks = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"]) for _ in range(2)]
print(" ".join(str(r.pid) for r in ranks), flush=True)
time.sleep(300)
"""


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().split()[2] if Path(f"/proc/{pid}/stat").exists() else "X"
    return state not in ("Z", "X")  # a zombie has ended


def test_a_timed_out_launch_ends_its_ranks_too():
    """What `subprocess.run(timeout=...)` gets wrong: it kills the launcher and orphans the ranks."""
    from concept_encoder import process_group

    launcher = process_group.start([sys.executable, "-c", LAUNCHER_WITH_RANKS], stdout=subprocess.PIPE, text=True)
    ranks = [int(pid) for pid in launcher.stdout.readline().split()]
    assert len(ranks) == 2 and all(pid_alive(pid) for pid in ranks)
    with pytest.raises(subprocess.TimeoutExpired):
        process_group.finish(launcher, timeout=1)
    deadline = time.time() + 10
    while any(pid_alive(pid) for pid in ranks) and time.time() < deadline:
        time.sleep(0.1)
    assert not any(pid_alive(pid) for pid in ranks), "ranks outlived the timed-out launch"


# ---------------------------------------------------------------- 4. preemption sent to the launcher


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return [int(x) for x in out.stdout.split()]


@pytest.mark.parametrize("processes", [1, 2])
def test_sigterm_to_the_launcher_checkpoints_every_rank(workdir, processes):
    """SIGTERM to `accelerate launch` (what a scheduler sends) ends with a checkpoint and no rank left."""
    from concept_encoder import process_group

    name = f"preempt{processes}"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes), "--num_machines", "1",
           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(29640 + processes)]  # fmt: skip
    cmd += ["--multi_gpu"] if processes > 1 else []
    cmd += [str(ROOT / "loops/mlm.py"), *COMMON, "--output_dir", "runs", "--run_name", name, "--max_steps", "100000"]
    launcher = process_group.start(cmd, cwd=workdir, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    metrics = workdir / "runs" / name / "metrics.jsonl"
    try:
        deadline = time.time() + 240
        while not (metrics.exists() and metrics.read_text().count("\n") >= 2) and time.time() < deadline:
            assert launcher.poll() is None, launcher.stderr.read()[-3000:]
            time.sleep(0.5)
        ranks = children_of(launcher.pid)
        assert len(ranks) >= 1
        launcher.send_signal(signal.SIGTERM)
        deadline = time.time() + 30
        while any(pid_alive(pid) for pid in ranks) and time.time() < deadline:
            time.sleep(0.2)
        assert not any(pid_alive(pid) for pid in ranks), "a rank was still training 30 s after the SIGTERM"
    finally:
        process_group.end_group(launcher)
    summary = json.loads((workdir / "runs" / name / "summary.json").read_text())
    checkpoints = list((workdir / "runs" / name / "checkpoints").glob("step_*"))
    assert summary["preempted"] and [p.name for p in checkpoints] == [f"step_{summary['steps']:07d}"]
    if processes > 1:
        assert {p.name for p in checkpoints[0].glob("collator_rank*.pt")} == {"collator_rank0.pt", "collator_rank1.pt"}


# ---------------------------------------------------------------- 10. no silent hang on a stale op lock


def test_a_stale_cpu_adam_lock_is_named_not_waited_on(workdir, tmp_path, monkeypatch, capsys):
    from concept_encoder import process_group
    from concept_encoder.extension_locks import stale_op_locks

    lock = tmp_path / "extensions" / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    with lock.open() as held:  # a live owner (a build in progress) is not stale
        assert held and stale_op_locks("cpu_adam", settle_s=0) == []
    assert stale_op_locks("cpu_adam", settle_s=0) == [lock]

    import launch.check_plan as check_plan

    assert check_plan.main(["--profile", "rtx3080_10gb"]) == 1
    assert f"rm {lock}" in capsys.readouterr().out

    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / "launch/cpu.yaml"),
           "--num_processes", "1", "--main_process_port", "29651",
           "--deepspeed_config_file", str(ROOT / "ds_configs/zero2_offload.json"),
           str(ROOT / "loops/mlm.py"), *COMMON, "--output_dir", "runs", "--run_name", "stale_lock", "--max_steps", "2"]  # fmt: skip
    out = process_group.run(
        cmd, 240, cwd=workdir, env={**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "extensions")}
    )
    assert out.returncode != 0
    assert "no process holds (left by a run interrupted" in out.stderr and f"rm {lock}" in out.stderr
    assert 'mlm.py", line' not in out.stderr  # one line from the loop (the launcher adds its own traceback)


# ---------------------------------------------------------------- 3. caches keyed on content


def write_corpus(path: Path, documents: int, seed: int) -> None:
    words = "alpha beta gamma delta epsilon zeta theta kappa lambda omicron sigma omega".split()
    paragraphs = [" ".join(words[(seed + i * 7 + j) % len(words)] for j in range(60)) for i in range(documents)]
    path.write_text("\n\n".join(paragraphs) + "\n")


def test_a_replaced_data_file_rebuilds_and_an_empty_split_is_never_cached(tmp_path):
    from concept_encoder.data import DataArguments, DataSourceError, prepare_data

    corpus = tmp_path / "corpus.txt"
    write_corpus(corpus, 40, seed=0)
    args = DataArguments(dataset=str(corpus), tokenizer="train:wordpiece:200", max_seq_length=32)
    first = prepare_data(args, cache_dir=tmp_path / "cache")
    assert first.stats["train"]["documents"] + first.stats["validation"]["documents"] == 40
    write_corpus(corpus, 80, seed=1)  # same path, new content
    second = prepare_data(args, cache_dir=tmp_path / "cache")
    assert second.stats["train"]["documents"] + second.stats["validation"]["documents"] == 80
    assert second.stats["cache_path"] != first.stats["cache_path"]

    tiny = tmp_path / "tiny.txt"
    write_corpus(tiny, 20, seed=2)
    for _ in range(2):  # the second attempt gives the same clear error: nothing empty was cached
        with pytest.raises(DataSourceError, match=r"the validation split yields no example: 1 documents, \d+ tokens"):
            prepare_data(DataArguments(dataset=str(tiny), tokenizer="train:wordpiece:200", max_seq_length=512),
                         cache_dir=tmp_path / "cache")  # fmt: skip
    assert len([p for p in (tmp_path / "cache" / "datasets").iterdir() if p.is_dir()]) == 2  # the two good builds


# ---------------------------------------------------------------- 9. plans that cannot run here


def test_impossible_machines_are_errors_and_run_checks_the_machine_it_is_on(monkeypatch, capsys):
    import launch.check_plan as check_plan

    assert check_plan.main(["--profile", "rtx3080_10gb", "--gpus", "0"]) == 1
    assert "0 GPUs per machine, but the plan budgets 10 GiB per GPU" in capsys.readouterr().out
    for bad in (["--nodes", "0"], ["--num_processes", "0"], ["--gpus", "-1"]):
        with pytest.raises(SystemExit) as exit_info:
            check_plan.main(["--profile", "cpu", *bad])
        assert exit_info.value.code == 2 and "is below" in capsys.readouterr().err

    launched = []
    monkeypatch.setattr(check_plan.os, "execv", lambda *argv: launched.append(argv))
    monkeypatch.setattr(check_plan.os, "chdir", lambda path: None)
    monkeypatch.setattr(check_plan, "visible_gpus", lambda: [])
    assert check_plan.main(["--profile", "rtx3080_10gb", "--run"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "needs 1 GPU with 10 GB per machine; this machine has none" in err
    assert "on this machine: make train-cpu" in err and launched == []
    monkeypatch.setattr(
        check_plan, "visible_gpus", lambda: [{"name": "RTX 3090", "memory_gb": 24.0, "capability": 8.6}]
    )
    assert check_plan.main(["--profile", "rtx3080_10gb", "--run"]) == 0  # fits: launched
    assert launched and "loops/mlm.py" in launched[0][1]
    launched.clear()
    monkeypatch.setattr(check_plan, "visible_gpus", lambda: [{"name": "RTX 3070", "memory_gb": 8.0, "capability": 8.6}])
    assert check_plan.main(["--profile", "rtx3080_10gb", "--run"]) == 1 and not launched
    assert "this machine has 1 GPU with 8 GB; on this machine: make train-cpu" in capsys.readouterr().err


# ---------------------------------------------------------------- 5. validate before heavy work


@pytest.mark.parametrize(
    ("make_args", "message"),
    [
        (lambda t: ["--config", str(yaml_file(t, "max_steps: 3.7\n"))], "max_steps=3.7 must be an int"),
        (lambda t: ["--pad_to_multiple_of", "0"], "pad_to_multiple_of=0 must be >= 1"),
        (lambda t: ["--output_dir", str(yaml_file(t, "")) + "/runs"], "is a file, not a folder"),
        (lambda t: ["--mixed_precision", "fp16"], "fp16 needs a CUDA GPU and this run is on the CPU"),
        (
            lambda t: ["--model_name_or_path", str(t), "--max_seq_length", "64"],
            "exceeds the model's max_position_embeddings=32",
        ),
        (lambda t: ["--resume_from_checkpoint", str(t / "nothing")], "not a checkpoint folder"),
        (lambda t: ["--run_name", "../escaped"], "cannot be a run folder: a run name is one folder name under"),
        (lambda t: ["--run_name", str(t / "abs")], "cannot be a run folder"),
    ],
    ids=[
        "yaml-float-steps",
        "pad-multiple",
        "output-dir",
        "fp16-on-cpu",
        "positions",
        "resume-path",
        "run-name-up",
        "run-name-absolute",
    ],  # fmt: skip
)
def test_bad_arguments_fail_before_data_and_model_are_built(tmp_path, monkeypatch, make_args, message):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "concept_encoder", "max_position_embeddings": 32}))
    argv = make_args(tmp_path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        run("--run_name", "bad", *argv)
    assert not Path("Cache/datasets").exists() and not Path("Cache/tokenizers").exists()
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "abs").exists()


def yaml_file(folder: Path, text: str) -> Path:
    path = folder / "run.yaml"
    path.write_text(text)
    return path


# ---------------------------------------------------------------- 6. clear messages for data and disk


def test_unreadable_files_other_models_and_a_full_disk_are_named(tmp_path, monkeypatch, capsys):
    from accelerate import Accelerator

    from concept_encoder.check_health import main as check_health
    from concept_encoder.data import DataSourceError, load_raw_dataset
    from concept_encoder.training.checkpoint import DiskFullError

    undecodable = tmp_path / "latin1.txt"
    undecodable.write_bytes("first paragraph\n\ncaf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(DataSourceError, match=r"latin1.txt is not UTF-8 text \(byte 20, line 3\)"):
        load_raw_dataset(str(undecodable))
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "one"}\n{"text": "two"}\n{"text": three}\n')
    with pytest.raises(DataSourceError, match=r"broken.jsonl line 3 is not valid JSON"):
        load_raw_dataset(str(broken))

    other = tmp_path / "bert"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert check_health([str(other)]) == 2
    assert "holds a 'bert' model, not a Concept Encoder" in capsys.readouterr().err

    real_save = Accelerator.save_state
    saves = {"n": 0}

    def save_until_the_disk_is_full(self, *args, **kwargs):
        saves["n"] += 1
        if saves["n"] == 2:
            raise OSError(28, "No space left on device")
        return real_save(self, *args, **kwargs)

    monkeypatch.setattr(Accelerator, "save_state", save_until_the_disk_is_full)
    with pytest.raises(
        DiskFullError,
        match=r"step 4 \(the partial files were removed\); the last intact checkpoint is runs/full/checkpoints/step_0000002",
    ):
        run("--run_name", "full", "--max_steps", "6", "--save_steps", "2")
    assert [p.name for p in Path("runs/full/checkpoints").iterdir()] == ["step_0000002"]  # no half checkpoint


# ---------------------------------------------------------------- 7. silent divergence


def test_divergence_monitor_needs_several_records_far_above_the_minimum():
    from concept_encoder.training.tracking import DivergenceMonitor

    monitor = DivergenceMonitor()
    noisy = [7.6, 7.0, 6.5, 11.0, 6.4, 6.3, float("nan"), 6.2]  # one spike and a NaN: not a divergence
    assert [monitor.update(step, loss) for step, loss in enumerate(noisy, start=1)] == [None] * len(noisy)
    found = [monitor.update(step, loss) for step, loss in [(9, 30.0), (10, 80.0), (11, 158.0), (12, 160.0)]]
    assert found == [None, None, {"step": 11, "loss": 158.0, "running_min": 6.2}, None]  # reported once


def test_a_finite_blow_up_is_warned_about_and_recorded(capsys):
    run("--run_name", "blowup", "--max_steps", "30", "--learning_rate", "1.0", "--lr_scheduler_type", "constant",
        "--warmup_ratio", "0", "--max_grad_norm", "0")  # fmt: skip
    losses = train_losses("blowup")
    summary = json.loads(Path("runs/blowup/summary.json").read_text())
    assert max(losses) > 2 * min(losses), losses  # the run did blow up
    assert summary["divergence"]["loss"] > 1.5 * summary["divergence"]["running_min"]
    assert "the loss diverges" in capsys.readouterr().out


# ---------------------------------------------------------------- 8. a saved model that travels


def test_final_model_loads_without_the_package_and_carries_a_model_card(tmp_path):
    import torch

    from concept_encoder import ConceptEncoderForMaskedLM

    run("--run_name", "travel", "--max_steps", "3", "--eval_steps", "3")
    final = Path("runs/travel/final").resolve()
    assert {"config.py", "heads.py", "modeling.py", "attention.py", "README.md"} <= {p.name for p in final.iterdir()}
    _, module, remote_sum = load_without_the_package(final, tmp_path, trust_remote_code=True)
    local = ConceptEncoderForMaskedLM.from_pretrained(final).eval()
    with torch.no_grad():
        local_sum = float(local(input_ids=torch.arange(5, 21)[None]).logits.double().sum())
    assert module.startswith("transformers_modules") and remote_sum == pytest.approx(local_sum, rel=1e-6)
    card = (final / "README.md").read_text()
    summary = json.loads(Path("runs/travel/summary.json").read_text())
    assert "library_name: transformers" in card and "3 optimizer steps" in card
    assert f"{summary['eval_loss']:.4f}" in card and "| effective_rank |" in card
    assert "accelerate launch loops/mlm.py" in card and "--run_name travel" in card
    assert "| concept losses | orthogonality, uniformity (weight 1.0, warmed up over 100 steps) |" in card  # the recipe


def test_the_script_rejects_a_bad_argument_before_importing_torch(tmp_path):
    code = (
        "import runpy, sys\n"
        f"sys.argv = [{str(ROOT / 'loops/mlm.py')!r}, '--pad_to_multiple_of', '0']\n"
        "try:\n    runpy.run_path(sys.argv[0], run_name='__main__')\n"
        "except SystemExit as e:\n    print('EXIT', e.code, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert "EXIT 1 False" in out.stdout
    assert out.stderr.startswith("error: pad_to_multiple_of=0 must be >= 1") and "Traceback" not in out.stderr
