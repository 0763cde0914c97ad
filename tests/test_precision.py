"""What a run saves and checks whatever precision it trained in: model folders in float32 unless `--save_dtype`
asks for less, float32 whenever a folder is loaded to train, and an end-of-run export check that compares like
with like and marks the run when the saved model is not the trained one. (The DeepSpeed bf16 run, whose fp32
masters live in its optimizer, is in tests/test_deepspeed.py; fp16's loss scale in test_schedules_and_budgets.py.)"""

import json
from pathlib import Path

import pytest
import torch
from loop_runs import fresh_accelerate, run, workdir  # noqa: F401 (fixtures)
from safetensors.torch import load_file

import loops.mlm as mlm
from concept_encoder.checkpoints import export
from concept_encoder.checkpoints.model_folder import save_model_weights, stored_float_dtypes
from concept_encoder.training.model import build_classifier

TASK = type("Task", (), {"num_labels": 2, "task_type": "single_label_classification", "label_names": None})()


def dtypes_of(folder: Path) -> set[torch.dtype]:
    return {tensor.dtype for tensor in load_file(folder / "model.safetensors").values()}


@pytest.mark.loop
def test_a_bf16_autocast_run_saves_float32_and_its_export_check_compares_like_with_like():
    assert run("--run_name", "bf16", "--max_steps", "2", "--mixed_precision", "bf16") == 0
    final = Path("runs/bf16/final")
    assert dtypes_of(final) == {torch.float32}
    assert json.loads((final / "config.json").read_text())["dtype"] == "float32"
    check = json.loads(Path("runs/bf16/summary.json").read_text())["export_check"]
    # the reloaded model ran as the run's did: fp32 weights under bf16 autocast, on the CPU
    assert check["alike"] and check["passed"] and check["dtype"] == "float32" and check["device"] == "cpu"
    assert check["max_abs_diff"] < 1e-4 and check["tolerance"] == export.RUN_CHECK_TOLERANCE


@pytest.mark.loop
def test_save_dtype_bfloat16_halves_the_files_and_says_so(capsys):
    assert run("--run_name", "small-files", "--max_steps", "1", "--save_dtype", "bfloat16") == 0
    final = Path("runs/small-files/final")
    assert dtypes_of(final) == {torch.bfloat16} and stored_float_dtypes(final) == {"bfloat16"}
    assert json.loads((final / "config.json").read_text())["dtype"] == "bfloat16"
    assert "weights saved in bfloat16" in (final / "README.md").read_text()
    check = json.loads(Path("runs/small-files/summary.json").read_text())["export_check"]
    assert not check["alike"] and check["passed"]  # rounded weights: only a gross fault is told from rounding
    # a 16-bit folder handed to training is upcast, with one line saying so
    capsys.readouterr()
    classifier, _ = build_classifier(str(final), TASK)
    twin, _ = build_classifier(str(final), TASK, from_scratch=True)  # config.json says bfloat16: the twin is fp32
    assert {p.dtype for p in classifier.parameters()} == {p.dtype for p in twin.parameters()} == {torch.float32}
    assert f"{final} holds bfloat16 weights: loaded as float32" in capsys.readouterr().out


@pytest.mark.loop
def test_a_saved_model_that_is_not_the_trained_one_marks_the_run(monkeypatch, capsys):
    real = mlm.save_model_weights

    def lost_gather(model, folder, state_dict=None, dtype="float32"):  # as a ZeRO-3 gather that returned zeros
        state = {name: torch.zeros_like(t) if "concept" in name else t for name, t in state_dict.items()}
        real(model, folder, state, dtype)

    monkeypatch.setattr(mlm, "save_model_weights", lost_gather)
    assert run("--run_name", "lost", "--max_steps", "1") == 0
    check = json.loads(Path("runs/lost/summary.json").read_text())["export_check"]
    assert check["alike"] and not check["passed"] and check["max_abs_diff"] > check["tolerance"]
    out = capsys.readouterr().out
    assert "export check failed" in out and "summary.json marks it" in out


def test_save_model_weights_casts_every_float_and_keeps_tied_weights_tied(tmp_path):
    from concept_encoder import ConceptEncoderForMaskedLM, config_from_preset

    model = ConceptEncoderForMaskedLM(config_from_preset("micro", vocab_size=64)).to(torch.bfloat16)
    save_model_weights(model, tmp_path, model.state_dict(), "float32")
    assert json.loads((tmp_path / "config.json").read_text())["dtype"] == "float32"  # not the module's bfloat16
    assert dtypes_of(tmp_path) == {torch.float32}
    reloaded = type(model).from_pretrained(tmp_path)  # transformers 5: dtype="auto" reads config.json
    assert {p.dtype for p in reloaded.parameters()} == {torch.float32}
    assert reloaded.get_output_embeddings().weight is reloaded.get_input_embeddings().weight
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name].float()), name
