"""Faults met while training, each one line that names what to do: a full disk (simulated and real), a
read-only output or cache folder, a run folder deleted while training, a run folder already used or held by
another process, hostile or incomplete checkpoint state files, a log file that cannot be written,
unreadable data files, another kind of model, a stale DeepSpeed op lock."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from loop_runs import (  # noqa: F401 (fixtures)
    COMMON,
    ROOT,
    finished_run,
    fresh_accelerate,
    run,
    workdir,
)

from concept_encoder.checkpoints.checkpoint import CheckpointError
from concept_encoder.common.faults import RunFolderError


@pytest.mark.loop
@pytest.mark.parametrize("error", [OSError(28, "No space left on device"),
                                   RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 960 vs 888")])  # fmt: skip
def test_a_full_disk_at_the_final_save_removes_the_partial_model_and_names_the_last_checkpoint(workdir, monkeypatch,
                                                                                                error):  # fmt: skip
    import transformers.modeling_utils

    from concept_encoder.common.faults import DiskFullError

    os.chdir(workdir)

    def full(*args, **kwargs):
        raise error

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    name = f"full-{type(error).__name__}"
    with pytest.raises(DiskFullError, match=f"while saving the model runs/{name}/final .* the last intact checkpoint "
                                            f"is runs/{name}/checkpoints/step_0000002"):  # fmt: skip
        run("--run_name", name, "--max_steps", "2", "--save_steps", "2")
    assert not Path(f"runs/{name}/final").exists() and not list(Path(f"runs/{name}").glob("final.partial*"))


def test_a_final_folder_the_run_did_not_write_is_refused_before_training_and_left_alone(workdir):
    os.chdir(workdir)
    final = Path("runs/someone-elses/final")
    final.mkdir(parents=True)
    (final / "results.csv").write_text("mine")
    with pytest.raises(RunFolderError, match="someone-elses holds files this project did not write .*final"):
        run("--run_name", "someone-elses", "--max_steps", "2")
    assert (final / "results.csv").read_text() == "mine" and sorted(p.name for p in final.iterdir()) == ["results.csv"]
    assert not Path("runs/someone-elses/config.json").exists()  # refused before the run wrote anything


def test_a_folder_of_someone_elses_is_never_a_run_folder_not_even_with_auto(workdir):
    os.chdir(workdir)
    mine = Path("runs/userdir")
    (mine / "tokenizer").mkdir(parents=True)
    files = {"config.json": '{"mine": true}', "metrics.jsonl": "my notes\n", "tokenizer/vocab.txt": "[PAD]\n"}
    for name, text in files.items():
        (mine / name).write_text(text)
    for resume in ([], ["--resume_from_checkpoint", "auto"]):  # auto: what the refusal of a used folder suggests
        with pytest.raises(RunFolderError, match="userdir holds files this project did not write .*config.json"):
            run("--run_name", "userdir", "--max_steps", "2", *resume)
    assert {name: (mine / name).read_text() for name in files} == files
    assert sorted(p.name for p in mine.iterdir()) == ["config.json", "metrics.jsonl", "tokenizer"]


def test_two_threads_writing_the_same_file_aside_at_once_each_write_their_own_copy(tmp_path):
    """A driver's `--jobs 2`: two cells of one K finishing together both copy the K's request into the archive.
    One partial name per process would let the second writer clear the first one's copy and fail to move its own."""
    import threading

    from concept_encoder.common.paths import written_aside

    target, both_written, errors = tmp_path / "request.json", threading.Barrier(2, timeout=30), []

    def write(text):
        try:
            with written_aside(target) as partial:
                partial.write_text(text)
                both_written.wait()  # both copies written before either moves into place
        except Exception as error:  # noqa: BLE001 (reported by the assertion below)
            errors.append(error)

    writers = [threading.Thread(target=write, args=(text,)) for text in ("first", "second")]
    for writer in writers:
        writer.start()
    for writer in writers:
        writer.join()
    assert errors == [] and target.read_text() in ("first", "second")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["request.json"]  # no copy left behind


def test_written_aside_moves_a_whole_file_or_folder_into_place_and_removes_a_failed_one(tmp_path):
    from concept_encoder.common.paths import written_aside

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
    with written_aside(folder) as partial:  # a folder written aside carries the project's marker
        partial.mkdir()
        (partial / "old.bin").write_bytes(b"1")
    assert sorted(p.name for p in folder.iterdir()) == [".concept-encoder", "old.bin"]
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
    assert sorted(p.name for p in folder.iterdir()) == [".concept-encoder", "model.safetensors"]
    assert not list(tmp_path.glob("final.partial*"))


def test_a_folder_is_replaced_only_if_this_project_wrote_it_never_through_a_link_or_over_a_file(tmp_path):
    from concept_encoder.checkpoints.model_folder import holds_only_saved_model_files
    from concept_encoder.common.paths import NotOursError, written_aside

    def write_model(target, legacy=None):
        with written_aside(target, replace_existing=True, legacy=legacy) as partial:
            partial.mkdir()
            (partial / "config.json").write_text("{}")

    users = tmp_path / "users"
    users.mkdir()
    (users / "thesis.tex").write_text("mine")
    (users / "models").mkdir()
    linked = tmp_path / "linked"
    linked.symlink_to(users, target_is_directory=True)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    refusals = {
        users: r"holds files this project did not write \(no .concept-encoder marker\): refusing to replace it",
        linked: "is a symbolic link: refusing to replace it",
        a_file: "is a file, not a folder this project wrote",
    }
    for target, message in refusals.items():
        with pytest.raises(NotOursError, match=message):
            write_model(target, legacy=holds_only_saved_model_files)
    assert (users / "thesis.tex").read_text() == "mine" and (users / "models").is_dir() and linked.is_symlink()
    assert a_file.read_text() == "mine" and not list(tmp_path.glob("*.partial*"))
    with pytest.raises(NotOursError):  # a user's folder that also holds a save_pretrained file is still theirs
        (users / "config.json").write_text("{}")
        write_model(users, legacy=holds_only_saved_model_files)
    older = tmp_path / "older"  # a model folder this project wrote before it marked folders: recognised
    older.mkdir()
    (older / "config.json").write_text("{}")
    (older / "model.safetensors").write_bytes(b"0")
    write_model(older, legacy=holds_only_saved_model_files)
    assert sorted(p.name for p in older.iterdir()) == [".concept-encoder", "config.json"]
    write_model(older)  # now marked: replaced without any legacy rule


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


@pytest.mark.loop
def test_a_real_full_disk_at_a_checkpoint_is_one_line_and_leaves_no_partial_files(tmp_path, monkeypatch):
    from concept_encoder.common.faults import DiskFullError

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


@pytest.mark.loop
def test_a_run_folder_deleted_while_training_ends_the_run_in_one_line(workdir, monkeypatch):
    import loops.mlm as mlm

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


@pytest.mark.loop
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
            run("--run_name", "a", "--max_steps", "6", "--resume_from_checkpoint", "auto")
    finally:
        holder.kill()
        holder.wait()


class CreatesAFile:
    """Pickled, it names `Path.touch` as the function to call on loading: code run from a checkpoint."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


@pytest.mark.loop
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

    from concept_encoder.checkpoints.checkpoint import write_manifest

    crafted = tmp_path / "crafted" / "checkpoints" / "step_0000004"
    shutil.copytree(finished_run / "checkpoints/step_0000004", crafted)
    marker = tmp_path / "code-ran"
    torch.save({"generator": CreatesAFile(marker)} if content == "pickle" else {}, crafted / state_file)
    write_manifest(crafted)  # the sizes agree: only the content is hostile
    with pytest.raises(CheckpointError, match=message):
        run("--run_name", f"crafted-{len(content)}", "--max_steps", "6", "--save_steps", "2",
            "--resume_from_checkpoint", str(crafted))  # fmt: skip
    assert not marker.exists()


@pytest.mark.parametrize(
    ("state_file", "content", "message"),
    [
        ("train_state.json", '{"step": "eight", "epoch": 0}', r"train_state.json holds values a loop does not write \(step\)"),
        ("train_state.json", '{"step": 4, "gates": [1]}', r"train_state.json holds values a loop does not write \(gates\)"),
        ("train_state.json", '{"step": 4, "seconds": -1.5}', r"train_state.json holds values a loop does not write \(seconds\)"),
        ("train_state.json", '{"step": 4, "seconds": NaN}', r"train_state.json holds values a loop does not write \(seconds\)"),
        ("train_state.json", '{"step": 4, "seconds": "1 h"}', r"train_state.json holds values a loop does not write \(seconds\)"),
        ("train_state.json", '{"step": 4, "cpu_threads": 2}', r"train_state.json holds values a loop does not write \(cpu_threads\)"),
        ("train_state.json", '{"step": 4, "cpu_threads": [0]}', r"train_state.json holds values a loop does not write \(cpu_threads\)"),
        ("train_state.json", "[4]", "train_state.json is not a JSON object"),
        ("resume_settings.json", "[]", "resume_settings.json does not hold the run's settings"),
        ("manifest.json", '["model.safetensors"]', "manifest.json is not a list of files and sizes"),
    ],
)  # fmt: skip
def test_checkpoint_json_whose_sizes_match_but_values_do_not_is_named_before_use(finished_run, tmp_path, state_file,
                                                                                 content, message):  # fmt: skip
    from concept_encoder.checkpoints.checkpoint import resolve_resume, write_manifest

    crafted = tmp_path / "run" / "checkpoints" / "step_0000004"
    shutil.copytree(finished_run / "checkpoints/step_0000004", crafted)
    (crafted / state_file).write_text(content)
    if state_file != "manifest.json":
        write_manifest(crafted)  # the sizes agree: only the values are wrong
    with pytest.raises(CheckpointError, match=f"--resume_from_checkpoint {crafted} is damaged: {message}"):
        resolve_resume(str(crafted), str(tmp_path), None)
    assert resolve_resume("auto", str(tmp_path), "run") is None  # `auto` passes over it (no other checkpoint here)


def test_deepspeed_state_files_are_checked_before_deepspeed_unpickles_them(tmp_path):
    import torch
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from concept_encoder.checkpoints.checkpoint import verify_deepspeed_states

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


@pytest.mark.loop
def test_unreadable_files_other_models_and_a_full_disk_are_named(tmp_path, monkeypatch, capsys):
    from accelerate import Accelerator

    from concept_encoder.common.faults import DiskFullError
    from concept_encoder.data import DataSourceError, load_raw_dataset
    from concept_encoder.decide.check_health import main as check_health

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


@pytest.mark.alone
@pytest.mark.loop
def test_a_stale_cpu_adam_lock_is_named_not_waited_on(workdir, tmp_path, monkeypatch, capsys):
    from concept_encoder.common import process_group
    from concept_encoder.machine.extension_locks import stale_op_locks

    lock = tmp_path / "extensions" / "cpu_adam" / "lock"
    lock.parent.mkdir(parents=True)
    lock.write_text("")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    with lock.open() as held:  # a live owner (a build in progress) is not stale
        assert held and stale_op_locks("cpu_adam", settle_s=0) == []
    assert stale_op_locks("cpu_adam", settle_s=0) == [lock]

    import launch.build_ops as build_ops
    import launch.check_plan as check_plan

    assert check_plan.main(["--profile", "rtx3080_10gb"]) == 1
    assert f"rm {lock}" in capsys.readouterr().out
    assert build_ops.main([]) == 1  # make install's build of the ops: named, not waited on either
    assert f"rm {lock}" in capsys.readouterr().err

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


def test_a_report_folder_that_cannot_take_reports_is_one_line_before_the_work(tmp_path, monkeypatch, capsys):
    """Every tool that writes a report checks its folder first (here a file stands where a folder must be; a
    read-only folder takes the same path), so no run's hours are lost to it at the end."""
    from concept_encoder.decide import ablate, compare
    from concept_encoder.finetuning import report as finetune_report

    sys.path.insert(0, str(ROOT / "launch"))
    import zero_compare

    (tmp_path / "afile").write_text("mine")
    blocked = str(tmp_path / "afile" / "reports")
    monkeypatch.setattr(ablate, "REPORT_DIR", blocked)
    monkeypatch.setattr(ablate, "run_loop", lambda command: pytest.fail("a run started before the check"))
    calls = {
        "compare": lambda: compare.main([str(tmp_path), "--report_dir", blocked]),
        "finetune_report": lambda: finetune_report.main([str(tmp_path / "r.json"), "--out_dir", blocked]),
        "ablate": lambda: ablate.main(
            [
                "--vary",
                "learning_rate=1e-4,5e-3",
                "--decide",
                "eval_loss",
                "--name",
                "rep",
                "--",
                *COMMON,
                "--output_dir",
                str(tmp_path / "runs"),
            ]
        ),  # fmt: skip
        "zero_compare": lambda: zero_compare.parse_args(["--configs", "zero2", "--out_dir", blocked]),
    }
    for tool, call in calls.items():
        with pytest.raises(SystemExit) as refused:
            call()
        err = capsys.readouterr().err
        assert refused.value.code == 2, tool
        assert f"{blocked}: {tmp_path / 'afile'} is a file, not a folder" in err and "Traceback" not in err, (tool, err)
    assert (tmp_path / "afile").read_text() == "mine" and not (tmp_path / "runs").exists()


def test_a_report_written_whole_leaves_nothing_when_the_disk_fills(tmp_path):
    import errno

    from concept_encoder.common.faults import DiskFullError, written_whole

    paths = [tmp_path / f"report.{ext}" for ext in ("md", "json", "png")]
    paths[0].touch()  # the claimed name
    with pytest.raises(DiskFullError, match=r"no space left on the disk of .* while writing the report report\.\* "
                                            r"\(nothing of it was kept\); free space"):  # fmt: skip
        with written_whole(paths, "the report report.*"):
            paths[0].write_text("# table")
            paths[1].write_text("{")
            raise OSError(errno.ENOSPC, "No space left on device")
    assert not any(path.exists() for path in paths)
    with pytest.raises(ValueError, match="not a disk problem"), written_whole(paths, "x"):
        paths[0].write_text("# table")
        raise ValueError("not a disk problem")  # other errors pass through, the files still removed
    assert not paths[0].exists()
