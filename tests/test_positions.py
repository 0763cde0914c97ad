"""Reading past the trained length (model/positions.py): position tables grown by copying their trained rows, and
the loops' and tools' `--extend_positions` (refused without it, named in the refusal)."""

import json
from pathlib import Path

import pytest
import torch
from test_model import V, random_batch, tiny_config
from transformers import AutoModelForMaskedLM, AutoModelForSequenceClassification

from concept_encoder import PRESETS, ConceptEncoderForMaskedLM
from concept_encoder.model.bert_baseline import BertForSparseMaskedLM, bert_config
from concept_encoder.model.positions import extend_position_tables


@pytest.mark.parametrize("decoder", ["perceiver", "posonly", "weighted"])
def test_a_grown_table_repeats_the_trained_rows_and_leaves_short_inputs_unchanged(decoder, tmp_path):
    torch.manual_seed(0)
    model = ConceptEncoderForMaskedLM(tiny_config(max_position_embeddings=16, decoder_type=decoder)).eval()
    ids, labels = random_batch(seq_len=16)[:2]
    with torch.no_grad():
        before = model(input_ids=ids, labels=labels).loss
        trained = model.encoder.embeddings.position_embeddings.weight.clone()
        assert extend_position_tables(model, 40) == 16 and model.config.max_position_embeddings == 40
        grown = model.encoder.embeddings.position_embeddings.weight
        assert grown.shape == (40, trained.shape[1]) and torch.equal(grown, trained[torch.arange(40) % 16])
        torch.testing.assert_close(model(input_ids=ids, labels=labels).loss, before, rtol=0, atol=0)
        if decoder == "weighted":  # its mixture logits are indexed by position too
            assert model.mlm_decoder.mixture_logits.weight.shape[0] == 40
        long_ids = torch.randint(5, V, (2, 40))
        assert model(input_ids=long_ids).logits.shape == (2, 40, V)  # reads the new length
    assert extend_position_tables(model, 32) == 40  # not longer: nothing changes
    model.save_pretrained(tmp_path / "grown")
    reloaded = AutoModelForMaskedLM.from_pretrained(tmp_path / "grown").eval()
    assert reloaded.config.max_position_embeddings == 40
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=long_ids).logits, model(input_ids=long_ids).logits)


def test_the_bert_twin_grows_its_table_and_its_id_buffers():
    model = BertForSparseMaskedLM(bert_config({**PRESETS["micro"], "max_position_embeddings": 16}, V, pad_token_id=0))
    model.eval()
    extend_position_tables(model, 48)
    embeddings = model.bert.embeddings
    assert embeddings.position_embeddings.weight.shape[0] == 48 and embeddings.position_ids.shape == (1, 48)
    assert embeddings.token_type_ids.shape == (1, 48) and not embeddings.token_type_ids.any()
    with torch.no_grad():
        assert model(input_ids=torch.randint(5, V, (1, 48))).logits.shape == (1, 48, V)


def test_fine_tuning_and_its_twin_read_past_the_table_only_when_asked(tmp_path):
    from concept_encoder.tasks.loading import TaskData
    from concept_encoder.training.model import build_classifier

    torch.manual_seed(0)
    ConceptEncoderForMaskedLM(tiny_config(max_position_embeddings=16)).save_pretrained(tmp_path / "short")
    task = TaskData("t", "single_label_classification", 3, None, ("accuracy",), None, None, None)
    model, note = build_classifier(str(tmp_path / "short"), task, extend_to=64)
    assert model.config.max_position_embeddings == 64 and "position tables grown from 16 to 64 rows" in note
    assert model(input_ids=torch.randint(5, V, (1, 64))).logits.shape == (1, 3)
    twin, _ = build_classifier(str(tmp_path / "short"), task, from_scratch=True, extend_to=64)
    assert twin.config.max_position_embeddings == 64  # a fresh twin's table is sized from the length
    plain, _ = build_classifier(str(tmp_path / "short"), task)
    assert plain.config.max_position_embeddings == 16
    plain.save_pretrained(tmp_path / "plain")
    assert AutoModelForSequenceClassification.from_pretrained(tmp_path / "plain").config.max_position_embeddings == 16


def test_a_saved_model_read_past_its_table_is_refused_naming_the_extension(tmp_path, capsys, monkeypatch):
    from concept_encoder.decide import check_health
    from concept_encoder.training.args import parse_args
    from concept_encoder.training.preflight import preflight

    monkeypatch.chdir(tmp_path)
    ConceptEncoderForMaskedLM(tiny_config(max_position_embeddings=16)).save_pretrained(tmp_path / "short")
    argv = ["--model_name_or_path", str(tmp_path / "short"), "--max_seq_length", "64", "--output_dir", "out"]
    model_args, data_args, training_args = parse_args(argv)
    with pytest.raises(ValueError, match=r"max_seq_length=64 exceeds the model's max_position_embeddings=16; lower "
                       r"--max_seq_length, or pass --extend_positions copy"):  # fmt: skip
        preflight(model_args, data_args, training_args, cuda=False)
    model_args, data_args, training_args = parse_args([*argv, "--extend_positions", "copy"])
    preflight(model_args, data_args, training_args, cuda=False)  # asked for: accepted
    with pytest.raises(ValueError, match=r"extend_positions='tile' is unknown; choose one of \('no', 'copy'\)"):
        parse_args([*argv, "--extend_positions", "tile"])
    assert check_health.main([str(tmp_path / "short"), "--max_seq_length", "64"]) == 2
    assert "pass --extend_positions copy" in capsys.readouterr().err
    assert json.loads((tmp_path / "short" / "config.json").read_text())["max_position_embeddings"] == 16  # untouched


def test_a_chunked_reading_encodes_each_chunk_alone_and_averages_their_mean_states():
    from transformers import BertConfig, BertForSequenceClassification

    from concept_encoder.finetuning.chunked import read_in_chunks
    from concept_encoder.finetuning.probe import frozen_features

    torch.manual_seed(0)
    config = BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                        max_position_embeddings=16, num_labels=3, hidden_dropout_prob=0.0)  # fmt: skip
    model = BertForSequenceClassification(config).eval()
    ids = torch.randint(5, V, (2, 40))
    mask = torch.ones_like(ids)
    mask[1, 21:] = 0  # the second input is 21 tokens: two chunks, the second of 5 tokens; the third chunk empty
    with torch.no_grad():
        expected = []
        for row, n in ((0, 40), (1, 21)):
            chunks = [ids[row, i : min(i + 16, n)] for i in range(0, n, 16)]
            means = [model.bert(chunk[None]).last_hidden_state.mean(1) for chunk in chunks]  # each chunk alone
            pooled = model.bert.pooler.activation(model.bert.pooler.dense(torch.cat(means).mean(0, keepdim=True)))
            expected.append(model.classifier(pooled))
        read_in_chunks(model, 16)
        logits = model(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(logits, torch.cat(expected), rtol=1e-5, atol=1e-5)
        states = model.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
        assert states.shape == (2, 40, 32)  # position for position: the probes' masked mean reads it as usual
        loader = [{"input_ids": ids, "attention_mask": mask}]
        assert frozen_features(model, loader, torch.device("cpu"))["hidden mean"].shape == (2, 32)
    with pytest.raises(ValueError, match="--chunk_length 32 is longer than the model's 16 positions"):
        read_in_chunks(BertForSequenceClassification(config), 32)
    concept = ConceptEncoderForMaskedLM(tiny_config())
    with pytest.raises(ValueError, match="a Concept Encoder reads the whole input"):
        read_in_chunks(concept, 16)


@pytest.mark.loop
def test_continued_pretraining_reads_past_the_table_only_with_the_extension(tmp_path, monkeypatch):
    """A model saved with a 32-row table: `loops/mlm.py --max_seq_length 64` from it is refused (naming the flag)
    and runs with `--extend_positions copy`, saving a 64-row table whose first rows are the trained ones."""
    import shutil

    from loop_runs import COMMON
    from safetensors.torch import load_file

    import loops.mlm as mlm

    monkeypatch.chdir(tmp_path)
    common = [a if a != "64" else "32" for a in COMMON]  # the shared arguments at 32 tokens
    assert mlm.main([*common, "--output_dir", "runs", "--run_name", "short", "--max_steps", "2"]) == 0
    model = AutoModelForMaskedLM.from_pretrained("runs/short/final")
    table = model.encoder.embeddings.position_embeddings
    model.encoder.embeddings.position_embeddings = torch.nn.Embedding.from_pretrained(table.weight[:32].clone(),
                                                                                     freeze=False)  # fmt: skip
    model.config.max_position_embeddings = 32
    model.save_pretrained(tmp_path / "trained32")
    for name in Path("runs/short/final").glob("*token*"):
        shutil.copy(name, tmp_path / "trained32" / name.name)  # its own tokenizer, as a run's final/ carries it
    folder_decides = ("--preset", "--tokenizer")  # a model folder has its own shape and tokenizer
    unshaped = [a for i, a in enumerate(COMMON) if not set(folder_decides) & set(COMMON[max(i - 1, 0) : i + 1])]
    longer = [*unshaped, "--output_dir", "runs", "--model_name_or_path", "trained32", "--max_steps", "1"]
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings=32; lower --max_seq_length, or "
                       "pass --extend_positions copy"):  # fmt: skip
        mlm.main([*longer, "--run_name", "refused"])
    assert mlm.main([*longer, "--run_name", "grown", "--extend_positions", "copy", "--learning_rate", "1e-9"]) == 0
    grown = load_file("runs/grown/final/model.safetensors")["encoder.embeddings.position_embeddings.weight"]
    trained = load_file("trained32/model.safetensors")["encoder.embeddings.position_embeddings.weight"]
    assert grown.shape[0] == 64 and torch.allclose(grown[32:], trained, atol=1e-4)  # copies, barely trained
    assert json.loads(Path("runs/grown/final/config.json").read_text())["max_position_embeddings"] == 64
