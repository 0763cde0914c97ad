"""`export` never destroys data, carries no code it did not write, ends a damaged input or a full disk in one line,
and takes links as users use them (issue 55: items 1, 2, 5 and 7).

The run is `loop_runs.finished_run` (6 steps in process); what a test damages is a copy (`copied_run`). Refusals
of the output folder come before any model is built (`untrained_model` patched to fail where that is asserted).
"""

import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from loop_runs import ROOT, finished_run, fresh_accelerate, workdir  # noqa: F401 (fixtures)
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer

import concept_encoder  # noqa: F401 (registers the model with the Auto classes)
from concept_encoder.checkpoints import export, reshard
from concept_encoder.checkpoints.checkpoint import write_manifest
from concept_encoder.common.paths import OWNER_MARKER, remove_stale_partials, written_aside

STEP = "checkpoints/step_0000004"
CARD_WITHOUT_THE_PACKAGE = """
import sys
sys.path = [p for p in sys.path if p.rstrip("/") != sys.argv[2] and p not in ("", ".")]
sys.meta_path = [f for f in sys.meta_path if "editable" not in repr(f).lower()]  # the editable install's finder
import importlib.util
assert importlib.util.find_spec("concept_encoder") is None, "the package is still importable"
from transformers import AutoModelForMaskedLM, AutoTokenizer
model = AutoModelForMaskedLM.from_pretrained(sys.argv[1], trust_remote_code=True)  # as the model card says
print("LOADED", len(AutoTokenizer.from_pretrained(sys.argv[1], config=model.config).get_vocab()))
"""


def snapshot(folder: Path) -> dict:
    """Every file under `folder` (links not followed) with its bytes: what must survive a refusal."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(capsys, *argv: str, code: int = 2) -> str:
    """Run export, expect `code` and exactly one error line on standard error, the last; return it. (A refusal
    after the weights are written follows transformers' own progress bar on the same stream.)"""
    assert export.main(list(map(str, argv))) == code
    lines = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in lines if "error" in line.lower() or "Traceback" in line]
    assert len(errors) == 1 and lines[-1] == errors[0] and errors[0].startswith("error: "), lines
    return errors[0]


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    done = subprocess.Popen([sys.executable, "-c", "pass"])
    done.wait()
    return done.pid


@pytest.fixture(scope="module")
def copied_run(finished_run, tmp_path_factory):  # noqa: F811
    """A copy of the run with only `step_0000004`, its tokenizer and config: damaged at will."""
    run = tmp_path_factory.mktemp("copied") / "a"
    keep = shutil.ignore_patterns("final", "step_0000002", "step_0000006")
    shutil.copytree(finished_run, run, ignore=keep)
    return run


@pytest.fixture(scope="module")
def earlier(copied_run, tmp_path_factory):
    """An export of step 4, to copy as "an earlier export" wherever a test changes one."""
    out = tmp_path_factory.mktemp("earlier") / "out"
    assert export.main([str(copied_run / STEP), str(out)]) == 0
    return out


def an_earlier_export(earlier: Path, where: Path) -> Path:
    shutil.copytree(earlier, where, symlinks=True)
    return where


def damaged_copy(run: Path, name: str) -> Path:
    """A copy of the run's step-4 checkpoint as `checkpoints/<name>`, its manifest rewritten after the caller
    damages it (see `rewrite_manifest`)."""
    checkpoint = run / "checkpoints" / name
    shutil.copytree(run / STEP, checkpoint)
    return checkpoint


def rewrite_manifest(checkpoint: Path) -> None:
    (checkpoint / "manifest.json").unlink()
    write_manifest(checkpoint)


# 1. --overwrite replaces only an earlier export, every file as it wrote it


@pytest.mark.loop
def test_overwrite_never_replaces_a_folder_this_project_uses_for_something_else(
    copied_run, earlier, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(export, "untrained_model", lambda config: pytest.fail("refused outputs build no model"))
    other_run = shutil.copytree(copied_run, tmp_path / "other_run")
    cache_entry = tmp_path / "Cache/tokenizers/wordpiece-2000"
    with written_aside(cache_entry) as partial:  # how a cache entry is written: marked, no export record
        shutil.copytree(copied_run / "tokenizer", partial)
    final = an_earlier_export(earlier, tmp_path / "final")
    (final / "export.json").unlink()  # a run's final/: marked and model files only, no export record
    checkpoint = copied_run / STEP
    targets = {
        copied_run: "is this export's input",  # the run being exported
        copied_run / "tokenizer": "is this export's input",
        copied_run / "checkpoints": "is this export's input",
        other_run: "is a training run's folder",
        other_run / "tokenizer": "for something else than an export",
        other_run / STEP: "is a training checkpoint",
        cache_entry: "for something else than an export",
        final: "for something else than an export",
    }
    before = {target: snapshot(target) for target in targets}
    for target, message in targets.items():
        for overwrite in (["--overwrite"], []):
            error = refused(capsys, checkpoint, target, *overwrite)
            assert message in error and "choose another folder" in error, error
    assert all(snapshot(target) == files for target, files in before.items())
    assert not list(tmp_path.glob("*.partial-*")) and not list(copied_run.glob("*.partial-*"))


@pytest.mark.loop
def test_overwrite_refuses_any_file_the_earlier_export_did_not_record(
    earlier, copied_run, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(export, "untrained_model", lambda config: pytest.fail("refused outputs build no model"))
    checkpoint = copied_run / STEP

    unmarked = tmp_path / "unmarked"  # model files and a user's notes, no marker, no record: not replaced
    unmarked.mkdir()
    for name in ("config.json", "model.safetensors", "README.md"):
        shutil.copy(earlier / name, unmarked / name)
    (unmarked / "notes.txt").write_text("mine")

    added = an_earlier_export(earlier, tmp_path / "added")  # a user's file added to an earlier export
    (added / "my_eval.md").write_text("mine")
    grown = an_earlier_export(earlier, tmp_path / "grown")  # a file the export wrote, changed since
    (grown / "README.md").write_text((grown / "README.md").read_text() + "my notes\n")
    edited = an_earlier_export(earlier, tmp_path / "edited")  # same size, other bytes: the digest tells
    card = (edited / "README.md").read_bytes()
    (edited / "README.md").write_bytes(card[:-2] + b"X\n")
    nested = an_earlier_export(earlier, tmp_path / "nested")  # an export writes no subfolder nor link
    (nested / "results").mkdir()
    (nested / "results/table.csv").write_text("mine")
    (nested / "linked").symlink_to(tmp_path / "unmarked")
    many = an_earlier_export(earlier, tmp_path / "many")
    for index in range(8):
        (many / f"mine_{index}.txt").write_text("mine")
    old_style = an_earlier_export(earlier, tmp_path / "old_style")  # an export.json that lists no files
    record = json.loads((old_style / "export.json").read_text())
    (old_style / "export.json").write_text(json.dumps({k: v for k, v in record.items() if k != "files"}))

    cases = {
        unmarked: "(no export.json listing the files of an earlier export): README.md, config.json, model.safetensors, notes.txt",
        added: "not as its export.json lists them): my_eval.md;",
        grown: "README.md (changed)",
        edited: "README.md (changed)",
        nested: "linked (a link), results/",
        many: "mine_0.txt, mine_1.txt, mine_2.txt, mine_3.txt, mine_4.txt and 3 more",
        old_style: "an export written before export.json listed its files",
    }
    before = {target: snapshot(target) for target in cases}
    for target, message in cases.items():
        error = refused(capsys, checkpoint, target, "--overwrite")
        assert message in error, error
        assert "holds files this project did not write" in error or target == old_style
        assert "move" in error and "choose another folder" in error
    assert all(snapshot(target) == files for target, files in before.items())
    assert (nested / "linked").is_symlink() and (unmarked / "notes.txt").read_text() == "mine"


@pytest.mark.loop
def test_an_intact_earlier_export_is_replaced_and_its_record_lists_every_file(earlier, copied_run, tmp_path):
    out = an_earlier_export(earlier, tmp_path / "out")
    (out / "tokenizer.json").unlink()  # a file the user removed loses them nothing: still replaceable
    assert export.main([str(copied_run / STEP), str(out), "--overwrite"]) == 0
    files = json.loads((out / "export.json").read_text())["files"]
    assert set(files) | {"export.json", OWNER_MARKER} == {p.name for p in out.iterdir()}
    assert all(export.file_record(out / name) == record for name, record in files.items())
    assert not list(tmp_path.glob("out.*"))  # no partial or set-aside copy left


class MainProcess:
    """The one process of a resume on "another process count" (`reshard.staged_checkpoint` asks only these)."""

    is_main_process, num_processes = True, 2

    def wait_for_everyone(self):
        pass


def test_a_resharding_stage_is_made_and_removed_without_following_links(tmp_path, monkeypatch):
    precious = tmp_path / "checkpoints/step_1"  # the checkpoint being resumed: must survive whatever links point to it
    (precious / "pytorch_model").mkdir(parents=True)
    (precious / "pytorch_model/mp_rank_00_model_states.pt").write_bytes(b"weights")
    (precious / "train_state.json").write_text("{}")
    expected = snapshot(precious)
    monkeypatch.setattr(reshard, "convert_to_universal", lambda source, target: target.mkdir())
    stages = tmp_path / "run" / reshard.RESHARDING_FOLDER

    def resume(swap_in_a_link: bool = False) -> None:
        with reshard.staged_checkpoint(MainProcess(), precious, tmp_path / "run", universal=True) as staged:
            assert staged.is_dir() and not staged.is_symlink() and (staged / "pytorch_model").is_dir()
            assert (staged / "train_state.json").resolve() == precious / "train_state.json"
            if swap_in_a_link:  # the stage replaced by a link while loading: the link goes, not the checkpoint
                shutil.rmtree(staged)
                staged.symlink_to(precious)
        assert snapshot(precious) == expected and not (stages / "step_1").exists()
        assert not (stages / "step_1").is_symlink()

    stages.parent.mkdir()
    stages.symlink_to(precious.parent)  # <run>/resharding/step_1 is the checkpoint itself through this link
    resume()
    stages.mkdir(exist_ok=True)
    (stages / "step_1").symlink_to(precious)  # a stage left as a link
    resume()
    resume(swap_in_a_link=True)


def test_partial_copies_of_dead_processes_are_removed_and_a_live_ones_kept(tmp_path):
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("mine")
    target = tmp_path / "out"
    dead, alive = tmp_path / f"out.partial-{dead_pid()}", tmp_path / f"out.partial-{os.getppid()}"
    linked, other = tmp_path / f"out.partial-{dead_pid()}", tmp_path / f"other.partial-{dead_pid()}"
    threads = tmp_path / f"out.partial-{dead_pid()}-t4242"  # a dead process's thread wrote it (a driver's --jobs)
    for folder in (dead, alive, other, threads):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"half")
    linked.symlink_to(precious)  # a partial name that is a link: unlinked, what it names untouched
    with written_aside(target, sweep_stale=True) as partial:
        partial.mkdir()
    assert not dead.exists() and not linked.is_symlink() and (precious / "notes.txt").read_text() == "mine"
    assert not threads.exists()
    assert (alive / "model.safetensors").read_bytes() == b"half" and other.is_dir()  # a live process's, another's
    assert remove_stale_partials(target) == [] and target.is_dir()


# 2. no code travels


@pytest.mark.loop
def test_no_code_travels_from_a_tokenizer_folder_and_the_card_vouches_only_for_the_projects_code(
    finished_run,
    copied_run,
    tmp_path,
    capsys,
    caplog,  # noqa: F811
):
    planted = shutil.copytree(copied_run / "tokenizer", tmp_path / "planted")
    (planted / "tokenization_evil.py").write_text("import os; os.system('touch PWNED')\n")
    (planted / "modeling.py").write_text("raise SystemExit('planted')\n")  # named as one of the project's files
    (planted / "config.json").write_text('{"model_type": "evil"}')  # would replace the model's config
    (planted / "code").mkdir()
    (planted / "code/helper.py").write_text("")
    (planted / "vocab.txt").symlink_to("/etc/hostname")
    settings = json.loads((planted / "tokenizer_config.json").read_text())
    settings["auto_map"] = {"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]}
    (planted / "tokenizer_config.json").write_text(json.dumps(settings))
    (planted / "special_tokens_map.json").write_text(json.dumps({"auto_map": {"AutoProcessor": "evil/repo--x.Y"}}))

    out = tmp_path / "out"
    assert export.main([str(copied_run / STEP), str(out), "--tokenizer", str(planted)]) == 0
    own_code = {p.name for p in (finished_run / "final").glob("*.py")}  # what save_pretrained of the model writes
    assert own_code and {p.name for p in out.rglob("*.py")} == own_code
    assert (out / "modeling.py").read_bytes() == (finished_run / "final/modeling.py").read_bytes()
    assert not (out / "code").exists() and not (out / "vocab.txt").exists()
    assert json.loads((out / "config.json").read_text())["model_type"] == "concept_encoder"
    assert "auto_map" not in json.loads((out / "tokenizer_config.json").read_text())
    assert "auto_map" not in json.loads((out / "special_tokens_map.json").read_text())
    model_map = json.loads((out / "config.json").read_text())["auto_map"]
    assert all(target.split(".")[0] + ".py" in own_code for target in model_map.values())
    advised = [line for line in (out / "README.md").read_text().splitlines() if "trust_remote_code=True" in line]
    assert len(advised) == 1 and "AutoModelForMaskedLM" in advised[0]  # the model's code only, never the tokenizer's
    left = " ".join(r.getMessage() for r in caplog.records) + capsys.readouterr().err
    for name in ("tokenization_evil.py", "modeling.py", "config.json", "code/", "vocab.txt", "AutoTokenizer"):
        assert name in left, (name, left)
    expected = AutoTokenizer.from_pretrained(copied_run / "tokenizer").get_vocab()
    assert AutoTokenizer.from_pretrained(out).get_vocab() == expected
    loaded = subprocess.run([sys.executable, "-c", CARD_WITHOUT_THE_PACKAGE, str(out), str(ROOT)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300,
                            env={**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")})  # fmt: skip
    assert loaded.stdout.strip() == f"LOADED {len(expected)}", loaded.stderr[-2000:]  # no prompt to run code
    assert 'AutoTokenizer.from_pretrained("<this folder>", config=model.config)' in (out / "README.md").read_text()
    assert not (tmp_path / "PWNED").exists() and not Path("PWNED").exists()


# 5. damaged weights and a full disk: one line, nothing half-written


@pytest.mark.loop
def test_damaged_weights_are_one_line_naming_the_file(copied_run, tmp_path, capsys):
    weights = load_file(copied_run / STEP / "model.safetensors")
    name = next(k for k, v in weights.items() if v.dim() == 2)

    corrupt = damaged_copy(copied_run, "step_0000104")  # the manifest's sizes match: only reading tells
    data = bytearray((corrupt / "model.safetensors").read_bytes())
    data[8:40] = b"\xff" * 32  # the JSON header
    (corrupt / "model.safetensors").write_bytes(bytes(data))

    shaped = damaged_copy(copied_run, "step_0000204")
    save_file({**weights, name: weights[name][:-1].contiguous()}, shaped / "model.safetensors")
    rewrite_manifest(shaped)

    nan = damaged_copy(copied_run, "step_0000304")
    save_file({**weights, name: torch.full_like(weights[name], float("nan"))}, nan / "model.safetensors")
    rewrite_manifest(nan)

    pickled = damaged_copy(copied_run, "step_0000404")
    (pickled / "model.safetensors").unlink()
    (pickled / "pytorch_model.bin").write_bytes(b"PK\x03\x04 not a whole torch file")
    rewrite_manifest(pickled)

    cases = {
        corrupt: "step_0000104/model.safetensors does not read as model weights",
        shaped: "step_0000204/model.safetensors do not fit the run's model_config (",
        nan: f"step_0000304/model.safetensors hold NaN or infinite values ({name}",
        pickled: "step_0000404/pytorch_model.bin is not a state file this project writes",
    }
    for checkpoint, message in cases.items():
        error = refused(capsys, checkpoint, tmp_path / "out")
        assert message in error and "export another checkpoint of the run" in error, error
    assert not list(tmp_path.iterdir())


@pytest.mark.loop
def test_a_full_disk_is_one_line_and_the_earlier_export_stays_whole(earlier, copied_run, tmp_path, capsys, monkeypatch):
    out = an_earlier_export(earlier, tmp_path / "out")
    before = snapshot(out)
    stale = tmp_path / f"out.partial-{dead_pid()}"  # left by an export killed earlier: cleaned now
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    real_save = export.save_model_weights

    def fills_the_disk(model, folder, **kwargs):
        real_save(model, folder, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device", str(folder / "model.safetensors"))

    def safetensors_full(model, folder, **kwargs):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, message: "No space left on device" })')

    def card_unwritable(folder, *args):
        raise PermissionError(errno.EACCES, "Permission denied", str(folder / "README.md"))

    writers = {
        (
            "save_model_weights",
            fills_the_disk,
        ): f"no space left on the disk of {tmp_path} while writing {out}/model.safetensors",
        ("save_model_weights", safetensors_full): f"no space left on the disk of {tmp_path} while writing {out}:",
        (
            "write_model_card",
            card_unwritable,
        ): f"could not write {out}/README.md (Permission denied) while exporting to {out}",
    }
    for (writer, failing), message in writers.items():
        with monkeypatch.context() as patch:
            patch.setattr(export, writer, failing)
            error = refused(capsys, copied_run / STEP, out, "--overwrite", code=1)
        assert message in error and f"{out} is as it was" in error, error
        assert snapshot(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["out"]

    fresh = tmp_path / "fresh"
    with monkeypatch.context() as patch:
        patch.setattr(export, "save_model_weights", fills_the_disk)
        error = refused(capsys, copied_run / STEP, fresh, code=1)
    assert f"{fresh} was not created" in error and "free space on that disk" in error and not fresh.exists()


# 7. links as users use them


@pytest.mark.loop
def test_a_checkpoint_through_a_link_exports_and_a_link_as_the_target_is_refused(
    copied_run, tmp_path, capsys, monkeypatch
):
    latest = tmp_path / "latest"
    latest.symlink_to(copied_run / STEP)  # a link outside the run: the run is found from the real place
    out = tmp_path / "out"
    assert export.main([str(latest), str(out)]) == 0
    capsys.readouterr()
    assert json.loads((out / "export.json").read_text())["run"] == str(copied_run.resolve())

    monkeypatch.setattr(export, "untrained_model", lambda config: pytest.fail("refused inputs build no model"))
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere/model")
    for overwrite in ([], ["--overwrite"]):
        error = refused(capsys, latest, dangling, *overwrite)
        assert f"{dangling} is a dangling symbolic link to {tmp_path}/nowhere/model; remove the link" in error
    assert dangling.is_symlink() and not (tmp_path / "nowhere").exists()

    to_export = tmp_path / "to_export"
    to_export.symlink_to(out)  # a link to an earlier export: replacing it would replace the link, not the export
    before = snapshot(out)
    error = refused(capsys, latest, to_export, "--overwrite")
    assert f"{to_export} is a symbolic link to {out}" in error and snapshot(out) == before

    gone = tmp_path / "gone"
    gone.symlink_to(tmp_path / "deleted_checkpoint")
    error = refused(capsys, gone, tmp_path / "other")
    assert f"{gone} is a dangling symbolic link to" in error and "pass the checkpoint folder itself" in error


def test_a_tokenizer_saved_into_a_model_folder_leaves_its_own_code_behind(tmp_path, monkeypatch):
    """A tokenizer class registered for the Auto classes copies its module beside it and names it in `auto_map`:
    the loops' `final/`, snapshots and run tokenizers (`save_tokenizer_without_code`) keep the model's own
    modelling files and drop that code and every `auto_map` entry naming it."""
    import importlib.util
    import sys

    from tokenizers import Tokenizer, models

    from concept_encoder import ConceptEncoderForMaskedLM, config_from_preset
    from concept_encoder.checkpoints.model_folder import save_tokenizer_without_code

    module_file = tmp_path / "planted_tokenizer.py"
    module_file.write_text("from transformers import PreTrainedTokenizerFast\n\n\n"
                           "class PlantedTokenizer(PreTrainedTokenizerFast):\n    pass\n")  # fmt: skip
    spec = importlib.util.spec_from_file_location("planted_tokenizer", module_file)
    planted = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "planted_tokenizer", planted)
    spec.loader.exec_module(planted)
    planted.PlantedTokenizer.register_for_auto_class()
    tokenizer = planted.PlantedTokenizer(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, "[UNK]")))
    folder = tmp_path / "final"
    ConceptEncoderForMaskedLM(config_from_preset("micro", vocab_size=8)).save_pretrained(folder)
    own = sorted(p.name for p in folder.glob("*.py"))
    assert own and "modeling.py" in own
    left_out = save_tokenizer_without_code(tokenizer, folder)
    assert sorted(p.name for p in folder.glob("*.py")) == own  # the model's own files stay, the planted one is gone
    assert "planted_tokenizer.py" in left_out
    assert any("tokenizer_config.json's auto_map AutoTokenizer" in line for line in left_out)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    assert "planted_tokenizer" not in json.dumps(settings.get("auto_map", {}))
    assert json.loads((folder / "config.json").read_text())["auto_map"]["AutoModelForMaskedLM"] == (
        "heads.ConceptEncoderForMaskedLM"
    )  # the model's own auto_map is kept
