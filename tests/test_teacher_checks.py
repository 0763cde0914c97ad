"""A distillation teacher (`--teacher <folder>`, training/distill.py) is checked like every model folder handed in:
safetensors only, every encoder tensor in the file, every parameter finite, then what distillation itself needs
(a tokenizer that reads the texts, one hidden state per token). Each fault is one line naming the folder, raised
before the teacher embeds a document; what does not break distillation (another width) is not refused."""

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from loop_runs import fresh_accelerate, run, tiny_teacher, workdir  # noqa: F401 (fixtures)
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, BertConfig, BertModel

import loops.mlm as mlm
from concept_encoder import ConceptEncoderForMaskedLM, config_from_preset
from concept_encoder.checkpoints.model_folder import ModelFolderError
from concept_encoder.data.tokenizer import train_tokenizer
from concept_encoder.training import distill

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
DISTILL = ["--objective", "distill", "--packing", "false", "--max_steps", "2"]


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    return tiny_teacher(tmp_path_factory.mktemp("teacher") / "sound")


def variant(teacher: Path, tmp_path: Path, name: str) -> Path:
    folder = tmp_path / name
    shutil.copytree(teacher, folder)
    return folder


def bert_teacher(teacher: Path, folder: Path, **overrides) -> Path:
    """A BERT beside `teacher`'s tokenizer, its config changed by `overrides` (e.g. another width)."""
    folder.mkdir()
    for name in TOKENIZER_FILES:
        shutil.copy(teacher / name, folder / name)
    settings = {**json.loads((teacher / "config.json").read_text()), **overrides}
    BertModel(BertConfig(**{k: v for k, v in settings.items() if k not in ("architectures", "transformers_version")}))\
        .save_pretrained(folder)  # fmt: skip
    return folder


def refused(folder: Path, match: str) -> str:
    """`load_teacher(folder)`'s one-line refusal, which names the folder and matches `match`."""
    with pytest.raises(ModelFolderError, match=match) as caught:
        distill.load_teacher(folder)
    message = str(caught.value)
    assert "\n" not in message and str(folder) in message and message.startswith("--teacher")
    return message


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_teacher_with_non_finite_weights_is_refused_naming_the_tensor(teacher, tmp_path, value):
    spoiled = variant(teacher, tmp_path, "non-finite")
    tensors = load_file(spoiled / "model.safetensors")
    name = next(k for k in sorted(tensors) if "encoder.layer.0." in k and k.endswith("weight"))
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[0] = value  # one element is enough
    save_file(tensors, spoiled / "model.safetensors")
    refused(spoiled, rf"hold NaN/Inf \(e.g. {name}\)")


def test_a_pickle_only_teacher_is_refused_in_one_line_before_any_pickle_is_read(teacher, tmp_path):
    pickled = variant(teacher, tmp_path, "pickled")
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    (pickled / "pytorch_model.bin").write_bytes(b"\x80\x04not a pickle anyone may load")  # never unpickled
    message = refused(pickled, "holds its weights only as pytorch_model.bin, which this project does not load")
    assert "re-save the model as safetensors" in message and "safe_serialization=True" in message


def test_a_folder_without_config_or_tokenizer_or_encoder_tensors_is_refused(teacher, tmp_path):
    bare = variant(teacher, tmp_path, "no-config")
    (bare / "config.json").unlink()
    refused(bare, "holds no config.json")
    untokenized = variant(teacher, tmp_path, "no-tokenizer")  # transformers would build an empty tokenizer
    for name in TOKENIZER_FILES:
        (untokenized / name).unlink()
    refused(untokenized, "reads 'The cat sat on the mat.' as unknown tokens only .* save the teacher's own tokenizer")
    lacking = variant(teacher, tmp_path, "lacking")  # a bare encoder: its keys carry no base_model_prefix
    tensors = load_file(lacking / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if "encoder.layer.1." not in k}, lacking / "model.safetensors")
    refused(lacking, r"tensor\(s\) of the pretrained bert are not in its weights \(e.g. encoder\.layer\.1\.")


def test_what_breaks_distillation_is_refused_and_another_width_is_not(teacher, tmp_path):
    concept = tmp_path / "concept-encoder"  # returns its concepts [B,C,H]: the old tensor-size RuntimeError
    ConceptEncoderForMaskedLM(config_from_preset("micro", vocab_size=400)).save_pretrained(concept)
    for name in TOKENIZER_FILES:
        shutil.copy(teacher / name, concept / name)
    refused(concept, r"returns \[2, 16, 64\] as last_hidden_state for \[2, \d+\] tokens, not one state per token")
    short = bert_teacher(teacher, tmp_path / "short-table", vocab_size=100)
    refused(short, "its tokenizer has 400 tokens and its embedding table 100 rows")

    wide = bert_teacher(teacher, tmp_path / "wide", hidden_size=48, vocab_size=408)  # a padded table as well
    texts = {"train": ["The cat sat on the mat.", "A dog."], "validation": ["one more"]}
    targets = distill.teacher_targets(str(wide), texts, 64, tmp_path, distill.load_teacher(wide))
    assert targets["train"].shape == (2, 48)
    args = SimpleNamespace(distill_loss="cosine", distill_weight=1.0, mlm_weight=1.0, learning_rate=1e-3)
    projection = distill.Distillation(targets, 64, args, torch.device("cpu"))  # a student of width 64
    assert torch.isfinite(projection.loss(torch.randn(2, 64), torch.tensor([0, 1])))
    tokenizer = AutoTokenizer.from_pretrained(wide)
    student = ConceptEncoderForMaskedLM(config_from_preset("micro", vocab_size=len(tokenizer)))
    distill.init_word_embeddings(student, str(wide), tokenizer)  # 408 teacher rows onto 400: the shared ones


def documents(texts: list[str]) -> Dataset:
    return Dataset.from_dict({"text": texts})


def test_the_teacher_is_checked_before_it_embeds_any_document(teacher, tmp_path, monkeypatch):
    monkeypatch.setattr(distill, "teacher_targets", lambda *a, **k: pytest.fail("the teacher embedded documents"))
    texts = ["The cat sat on the mat.", "A dog."]
    data = SimpleNamespace(train=documents(texts), validation=documents(texts[:1]), tokenizer=None,
                           documents={"train": documents(texts), "validation": documents(texts[:1])})  # fmt: skip
    spoiled = variant(teacher, tmp_path, "nan")
    tensors = load_file(spoiled / "model.safetensors")
    save_file({k: torch.full_like(v, float("nan")) for k, v in tensors.items()}, spoiled / "model.safetensors")
    args = SimpleNamespace(teacher=str(spoiled), teacher_embedding_init=False)
    with pytest.raises(ModelFolderError, match=f"--teacher: {spoiled}: .* hold NaN/Inf"):
        distill.attach_teacher(data, args, 64, tmp_path)
    data.tokenizer = train_tokenizer("wordpiece", 300, iter(["something else entirely"] * 5))
    args = SimpleNamespace(teacher=str(teacher), teacher_embedding_init=True)
    with pytest.raises(ValueError, match=f"the student needs the teacher's vocabulary; add --tokenizer {teacher}"):
        distill.attach_teacher(data, args, 64, tmp_path)


@pytest.mark.loop
def test_the_loop_refuses_a_nan_teacher_before_it_builds_the_model(teacher, tmp_path, monkeypatch):
    spoiled = variant(teacher, tmp_path, "nan-loop")
    tensors = load_file(spoiled / "model.safetensors")
    save_file({k: torch.full_like(v, float("nan")) for k, v in tensors.items()}, spoiled / "model.safetensors")
    monkeypatch.setattr(mlm, "build_model", lambda *a, **k: pytest.fail("the student was built"))
    with pytest.raises(ModelFolderError, match=f"--teacher: {spoiled}: .* hold NaN/Inf"):
        run("--run_name", "nan-teacher", *DISTILL, "--teacher", str(spoiled))
