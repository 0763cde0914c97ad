"""`python -m concept_encoder export`: a training checkpoint becomes a plain model folder that computes what the
run's final model computes, and bad inputs are refused in one line before any work.

The run is `loop_runs.finished_run` (6 steps in process, checkpoints at 2, 4 and 6, the final model at 6).
"""

import json
import shutil

import pytest
import torch
from loop_runs import finished_run, fresh_accelerate, workdir  # noqa: F401 (fixtures)
from safetensors.torch import load_file
from transformers import AutoModelForMaskedLM, AutoTokenizer

import concept_encoder  # noqa: F401 (registers the model with the Auto classes)
from concept_encoder.checkpoints import export

IDS = torch.randint(5, 2000, (2, 64), generator=torch.Generator().manual_seed(1))


def logits(folder):
    model = AutoModelForMaskedLM.from_pretrained(folder).eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits


@pytest.mark.loop
def test_the_last_checkpoint_exports_as_the_final_model(finished_run, tmp_path, capsys):
    out = tmp_path / "step6"
    assert export.main([str(finished_run / "checkpoints/step_0000006"), str(out)]) == 0
    assert "max |Δlogit| 0.00e+00" in capsys.readouterr().out
    torch.testing.assert_close(logits(out), logits(finished_run / "final"), rtol=0, atol=0)  # the same weights
    assert (out / "model.safetensors").read_bytes() == (finished_run / "final/model.safetensors").read_bytes()
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.get_vocab() == AutoTokenizer.from_pretrained(finished_run / "tokenizer").get_vocab()
    record = json.loads((out / "export.json").read_text())
    assert record["step"] == 6 and record["weights_from"] == "model.safetensors"
    assert record["check"]["max_abs_logit_diff"] == 0.0 and record["check"]["probe_ids"] == [1, 64]
    card = (out / "README.md").read_text()
    assert "step_0000006` (step 6)" in card and "python -m concept_encoder export" in card
    assert "masked-token loss" in card  # the run evaluated at step 6: the card reports it

    earlier = tmp_path / "step2"
    assert export.main([str(finished_run / "checkpoints/step_0000002"), str(earlier)]) == 0
    assert not torch.allclose(logits(earlier), logits(out))  # it reads the checkpoint, not the final model
    assert "masked-token loss" not in (earlier / "README.md").read_text()  # no evaluation at step 2

    small = tmp_path / "bf16"  # --save_dtype: smaller files on request, checked like with like (bf16 both sides)
    assert export.main([str(finished_run / "checkpoints/step_0000006"), str(small), "--save_dtype", "bfloat16"]) == 0
    assert {t.dtype for t in load_file(small / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((small / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((small / "export.json").read_text())["check"]["max_abs_logit_diff"] == 0.0
    assert "weights saved in bfloat16" in (small / "README.md").read_text()
    assert "weights saved in float32" in card


@pytest.mark.loop
def test_bad_inputs_are_refused_in_one_line_before_any_work(finished_run, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(export, "untrained_model", lambda config: pytest.fail("refused inputs build no model"))
    out = tmp_path / "out"

    assert export.main([str(finished_run), str(out)]) == 2
    error = capsys.readouterr().err
    assert "is not a checkpoint folder (no train_state.json)" in error and "step_0000006" in error

    run = tmp_path / "copied_run"
    shutil.copytree(finished_run, run, ignore=shutil.ignore_patterns("final", "step_0000002", "step_0000006"))
    checkpoint = run / "checkpoints/step_0000004"
    (checkpoint / "manifest.json").write_text("{not json")
    assert export.main([str(checkpoint), str(out)]) == 2
    assert "step_0000004 is damaged: manifest.json is not valid JSON" in capsys.readouterr().err

    (out / "notes").mkdir(parents=True)
    (out / "notes/mine.txt").write_text("mine")
    good = str(finished_run / "checkpoints/step_0000004")
    assert export.main([good, str(out)]) == 2
    assert "exists and is not an empty folder; pass --overwrite" in capsys.readouterr().err
    assert export.main([good, str(out), "--overwrite"]) == 2  # --overwrite replaces only a folder this project wrote
    assert "holds files this project did not write" in capsys.readouterr().err
    assert (out / "notes/mine.txt").read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == [
        "copied_run", "out",
    ]  # fmt: skip


@pytest.mark.loop
def test_overwrite_replaces_an_earlier_export_and_a_failed_check_leaves_nothing(finished_run, tmp_path, monkeypatch):
    out = tmp_path / "out"
    checkpoint = str(finished_run / "checkpoints/step_0000004")
    assert export.main([checkpoint, str(out)]) == 0
    assert export.main([checkpoint, str(out)]) == 2  # the folder is there now
    assert export.main([checkpoint, str(out), "--overwrite"]) == 0

    real = export.reloaded_logits
    monkeypatch.setattr(export, "reloaded_logits", lambda *args: real(*args) + 1e-3)  # e.g. a lost tied weight
    again = tmp_path / "again"
    assert export.main([checkpoint, str(again)]) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no folder, no partial copy


def test_wrapper_prefixes_are_removed_and_only_tied_weights_may_be_missing():
    assert export.plain_names({"module._orig_mod.a.weight": 1, "module._orig_mod.b": 2}) == {"a.weight": 1, "b": 2}
    assert export.plain_names({"module.a": 1, "b": 2}) == {"module.a": 1, "b": 2}  # not every name: not a wrapper
    model = export.untrained_model(
        {"model_type": "bert", "vocab_size": 50, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
         "intermediate_size": 16, "max_position_embeddings": 16, "tie_word_embeddings": True}
    )  # fmt: skip
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "cls.predictions.decoder.weight"}
    export.load_strictly(model, state)  # tied to the word embeddings, which are there
    with pytest.raises(export.ExportError, match=r"1 tensor\(s\) missing \(bert.embeddings.LayerNorm.bias\)"):
        export.load_strictly(model, {k: v for k, v in state.items() if k != "bert.embeddings.LayerNorm.bias"})
    with pytest.raises(export.ExportError, match=r"1 unexpected \(extra\)"):
        export.load_strictly(model, {**state, "extra": torch.zeros(1)})


def test_help_names_the_checkpoint_and_the_folder(capsys):
    with pytest.raises(SystemExit) as done:
        export.main(["--help"])
    assert done.value.code == 0
    assert "usage: python -m concept_encoder export" in capsys.readouterr().out
