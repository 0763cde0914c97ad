"""Distillation from a teacher encoder (`--objective distill`, training/distill.py): a tiny teacher built here."""

import hashlib
import json
from pathlib import Path

import pytest
import torch
from loop_runs import fresh_accelerate, records, run, sigterm_after, tiny_teacher, workdir  # noqa: F401 (fixtures)

import loops.mlm as mlm
from concept_encoder import ConceptEncoderForMaskedLM, config_from_preset
from concept_encoder.data.tokenizer import train_tokenizer
from concept_encoder.training import distill
from concept_encoder.training.args import parse_args


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> Path:
    return tiny_teacher(tmp_path_factory.mktemp("teacher"))


def digest(folder: Path) -> str:
    return hashlib.sha1(b"".join(p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file())).hexdigest()


def test_the_target_is_the_teachers_mean_pooled_states_on_its_own_tokens_cached(teacher, tmp_path, monkeypatch):
    texts = {"train": ["The cat sat on the mat.", "A much longer sentence about modules and their functions."],
             "validation": ["one more"]}  # fmt: skip
    targets = distill.teacher_targets(str(teacher), texts, 64, tmp_path)
    model, tokenizer = distill.load_teacher(teacher)
    for split, rows in texts.items():
        for i, text in enumerate(rows):
            encoded = tokenizer(text, return_tensors="pt")  # alone: no padding
            expected = model(**encoded).last_hidden_state[0].mean(0)
            assert torch.allclose(targets[split][i], expected, atol=1e-5)
    assert targets["train"].shape == (2, 32)
    monkeypatch.setattr(distill, "load_teacher", lambda folder: pytest.fail("the cached targets were recomputed"))
    again = distill.teacher_targets(str(teacher), texts, 64, tmp_path)
    assert torch.equal(again["train"], targets["train"])
    assert len(list((tmp_path / "teachers").glob("*.safetensors"))) == 1


DISTILL = ["--objective", "distill", "--packing", "false", "--max_steps", "6", "--learning_rate", "3e-3"]


@pytest.mark.loop
def test_distillation_learns_the_teacher_leaves_it_unchanged_and_resumes_exactly(teacher, monkeypatch):
    before = digest(teacher)
    args = [*DISTILL, "--teacher", str(teacher), "--mlm_weight", "0", "--save_steps", "3", "--eval_steps", "6"]
    assert run("--run_name", "distil", *args) == 0
    train = records("distil", "train")
    losses = [r["distill/cosine"] for r in train]
    assert losses[-1] < losses[0] and digest(teacher) == before  # learns; the teacher's files untouched
    [evaluation] = records("distil", "eval")
    assert 0 < evaluation["eval_distill_cosine"] <= 1 and "eval_loss" in evaluation
    card = Path("runs/distil/final/README.md").read_text()
    assert f"distillation from the teacher `{teacher}`" in card
    config = json.loads(Path("runs/distil/config.json").read_text())
    assert config["training_args"]["teacher"] == str(teacher) and config["data_args"]["packing"] is False

    real = sigterm_after(monkeypatch, calls=4)
    run("--run_name", "distil-split", *args)
    monkeypatch.setattr(mlm, "train_step", real)
    run("--run_name", "distil-split", *args, "--resume_from_checkpoint", "auto")
    resumed = records("distil-split", "train")
    assert [(r["loss"], r["distill/cosine"]) for r in resumed] == [(r["loss"], r["distill/cosine"]) for r in train]
    assert records("distil-split", "eval")[0]["eval_distill_cosine"] == evaluation["eval_distill_cosine"]


@pytest.mark.loop
def test_a_bert_student_distils_its_mean_token_state_beside_mlm(teacher):
    assert run("--run_name", "distil-bert", *DISTILL, "--teacher", str(teacher), "--architecture", "bert",
               "--max_steps", "2", "--distill_loss", "mse", "--distill_weight", "0.5") == 0  # fmt: skip
    [first, last] = records("distil-bert", "train")
    assert first["distill/mse"] > 0 and first["loss"] > 0


def test_the_embedding_init_projects_the_teachers_table_and_needs_its_vocabulary(teacher, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(teacher)
    model = ConceptEncoderForMaskedLM(config_from_preset("micro", vocab_size=len(tokenizer)))
    distill.init_word_embeddings(model, str(teacher), tokenizer)
    table = distill.load_teacher(teacher)[0].get_input_embeddings().weight.detach()
    centred = table - table.mean(0)
    student = model.get_input_embeddings().weight.detach()  # width 64 > 32: a rotation of the table, scaled
    assert torch.allclose(student[:, 32:], torch.zeros(len(tokenizer), 32))
    gram, teacher_gram = student @ student.T, centred @ centred.T
    assert torch.allclose(gram / gram.abs().max(), teacher_gram / teacher_gram.abs().max(), atol=1e-4)
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    other = train_tokenizer("wordpiece", 300, iter(["something else entirely"] * 5))
    with pytest.raises(ValueError, match=f"the student needs the teacher's vocabulary; add --tokenizer {teacher}"):
        distill.init_word_embeddings(model, str(teacher), other)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--objective", "distill", "--packing", "false"], "needs --teacher <model folder>"),
        (["--teacher", "."], "apply to --objective distill only"),
        (["--objective", "distill", "--teacher", "{teacher}"], "add --packing false"),
        (["--objective", "distill", "--packing", "false", "--teacher", "./nowhere"], "nowhere is not a folder"),
        (["--objective", "distill", "--packing", "false", "--teacher", "{teacher}", "--distill_loss", "kl"],
         "distill_loss='kl' is unknown"),
        (["--objective", "distill", "--packing", "false", "--teacher", "{teacher}", "--mlm_weight", "-1"],
         "mlm_weight=-1.0 >= 0"),
    ],
)  # fmt: skip
def test_distillation_settings_are_checked_at_parse_time(teacher, extra, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_args([part.replace("{teacher}", str(teacher)) for part in extra])


def test_the_teachers_identity_follows_its_weights_and_every_tokenizer_file(teacher, tmp_path):
    """The cache key's teacher part: a changed weight or tokenizer setting is a new teacher (new targets)."""
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(teacher, copy)
    before = distill.teacher_identity(copy)
    settings = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**settings, "do_lower_case": False}))
    changed = distill.teacher_identity(copy)
    assert changed != before
    tensors = distill.load_file(str(copy / "model.safetensors"))
    name = sorted(tensors)[0]
    distill.save_file({**tensors, name: tensors[name] + 1}, str(copy / "model.safetensors"))
    assert distill.teacher_identity(copy) not in (before, changed)
