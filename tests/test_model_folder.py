"""A model folder is what it claims (concept_encoder/checkpoints/model_folder.py): every way a folder can lie ends in
one line naming the file, before training; a sound folder loads with only the new task head random."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForSequenceClassification

from concept_encoder import ConceptEncoderForMaskedLM, config_from_preset
from concept_encoder.checkpoints.model_folder import ModelFolderError, load_checked, model_folder_problem
from concept_encoder.training.model import build_classifier

TASK = SimpleNamespace(label_names=["a", "b"], num_labels=2, task_type="single_label_classification")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("model") / "sound"
    torch.manual_seed(0)
    ConceptEncoderForMaskedLM(config_from_preset("micro", vocab_size=64)).save_pretrained(folder)
    return folder


def variant(saved: Path, tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    shutil.copytree(saved, folder)
    return folder


def test_a_sound_folder_loads_with_only_the_task_head_new(saved):
    assert model_folder_problem(saved) is None
    model, note = build_classifier(str(saved), TASK)
    assert "new (randomly initialised): ['classifier" in note and "encoder." not in note.split("new")[1]


def test_files_that_are_not_a_model_are_named_before_anything_loads(saved, tmp_path):
    weights = saved / "model.safetensors"
    cases = {
        "config-list": (lambda f: (f / "config.json").write_text("[1, 2]"), "config.json holds a JSON list, not an object"),
        "config-text": (lambda f: (f / "config.json").write_text("hidden_size: 64"), "config.json is not JSON"),
        "empty-weights": (lambda f: (f / "model.safetensors").write_bytes(b""), "is 0 bytes, not a safetensors file"),
        "cut-weights": (
            lambda f: (f / "model.safetensors").write_bytes(weights.read_bytes()[: weights.stat().st_size // 2]),
            "its tensors need .* bytes and the file holds .*: cut short",
        ),
        "pickle-only": (
            lambda f: (f / "model.safetensors").rename(f / "pytorch_model.bin"),
            "holds its weights only as pytorch_model.bin, which this project does not load",
        ),
        "no-weights": (lambda f: (f / "model.safetensors").unlink(), "holds no model.safetensors"),
    }  # fmt: skip
    for name, (spoil, message) in cases.items():
        folder = variant(saved, tmp_path, name)
        spoil(folder)
        with pytest.raises(ModelFolderError, match=message):
            build_classifier(str(folder), TASK)
        with pytest.raises(ModelFolderError, match=message):
            load_checked(ConceptEncoderForMaskedLM, folder)
    from_scratch = variant(saved, tmp_path, "twin-of-pickle")
    (from_scratch / "model.safetensors").rename(from_scratch / "pytorch_model.bin")
    assert build_classifier(str(from_scratch), TASK, from_scratch=True)[1] == "fresh weights (--from_scratch)"


def test_weights_that_do_not_fit_the_config_are_refused_never_silently_random(saved, tmp_path):
    tensors = load_file(saved / "model.safetensors")
    lacking = variant(saved, tmp_path, "lacking")  # some encoder layers gone (or saved under other names)
    save_file({k: v for k, v in tensors.items() if ".layers.1." not in k}, lacking / "model.safetensors")
    with pytest.raises(
        ModelFolderError, match=r"tensor\(s\) of the pretrained encoder are not in its weights .*layers\.1"
    ):
        build_classifier(str(lacking), TASK)
    renamed = variant(saved, tmp_path, "renamed")
    save_file({k.replace("encoder.", "backbone."): v for k, v in tensors.items()}, renamed / "model.safetensors")
    with pytest.raises(ModelFolderError, match="not in its weights"):
        load_checked(AutoModelForSequenceClassification, renamed, num_labels=2)
    nan = variant(saved, tmp_path, "nan")
    name = next(k for k in tensors if k.startswith("encoder.layers.0"))
    save_file({**tensors, name: torch.full_like(tensors[name], float("nan"))}, nan / "model.safetensors")
    with pytest.raises(ModelFolderError, match=rf"hold NaN/Inf \(e.g. {name}"):
        build_classifier(str(nan), TASK)
    shaped = variant(saved, tmp_path, "shaped")
    config = json.loads((saved / "config.json").read_text())
    (shaped / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(ModelFolderError, match="the weights do not load into its config's model"):
        build_classifier(str(shaped), TASK)


def test_the_loops_preflight_names_the_folder_in_one_line(saved, tmp_path):
    from concept_encoder.training.args import FINETUNE_ARGUMENT_CLASSES, FINETUNE_DEFAULTS, parse_args
    from concept_encoder.training.preflight import preflight

    broken = variant(saved, tmp_path, "broken")
    (broken / "config.json").write_text('"a string"')
    argv = ["--model_name_or_path", str(broken), "--output_dir", str(tmp_path / "out")]
    model_args, task_args, args = parse_args(argv, classes=FINETUNE_ARGUMENT_CLASSES, defaults=FINETUNE_DEFAULTS)
    with pytest.raises(ValueError, match="--model_name_or_path: .*config.json holds a JSON str, not an object"):
        preflight(model_args, SimpleNamespace(max_seq_length=64), args, cuda=False)


def test_a_tool_that_reads_the_models_own_predictions_needs_every_tensor(saved, tmp_path):
    """check_health measures what the MLM decoder predicts: a fine-tuned classifier's folder (no decoder) is
    refused instead of measured with a random decoder."""
    model, info = load_checked(ConceptEncoderForMaskedLM, saved, whole=True)  # a pretraining run's folder: whole
    assert not info["missing_keys"]
    classifier = tmp_path / "classifier"
    build_classifier(str(saved), TASK)[0].save_pretrained(classifier)
    assert load_checked(ConceptEncoderForMaskedLM, classifier)[0] is not None  # the encoder alone is whole
    with pytest.raises(
        ModelFolderError,
        match=r"tensor\(s\) of its ConceptEncoderForMaskedLM are not in its weights .* pass a pretraining run's",
    ):
        load_checked(ConceptEncoderForMaskedLM, classifier, whole=True)
