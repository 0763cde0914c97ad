"""Fine-tuning at ListOps' scale: length-bucketed batches (every example once an epoch, exact resume), BERT's mean
pooling, [CLS] pooling of refined tokens, the last step reported beside the dev-chosen one, and the listops driver
on a tiny variant writing every row."""

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from loop_runs import TwoAtATime, fresh_accelerate, in_process, workdir  # noqa: F401 (fixtures)
from torch.utils.data import DataLoader

import loops.finetune as finetune
from concept_encoder.checkpoints.checkpoint import TrainState
from concept_encoder.decide import experiments, listops
from concept_encoder.training.batches import LengthBucketedBatches, accumulation_windows
from concept_encoder.training.runtime import usable_cores

LENGTHS = [(7 * i) % 97 + 3 for i in range(203)]
FINETUNE = ["--max_steps", "16", "--eval_steps", "4", "--logging_steps", "1", "--per_device_train_batch_size", "8",
            "--learning_rates", "1e-3", "--report_to", "none", "--progress_bar", "false", "--task", "listops:64:300",
            "--max_seq_length", "66", "--bucket_by_length", "true", "--report_last_step", "true"]  # fmt: skip


def test_bucketed_batches_hold_every_example_once_an_epoch_in_batches_of_similar_length():
    sampler = LengthBucketedBatches(LENGTHS, batch_size=8, seed=5, pool_batches=5)
    epochs = []
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert sorted(i for b in batches for i in b) == list(range(len(LENGTHS)))  # each once
        assert len(batches) == len(sampler) == 26 and sum(len(b) < 8 for b in batches) == 1
        epochs.append(batches)
    assert epochs[0] != epochs[1]  # another order each epoch
    sampler.set_epoch(0)
    assert list(sampler) == epochs[0]  # fixed by (seed, epoch)
    spread = sum(max(LENGTHS[i] for i in b) - min(LENGTHS[i] for i in b) for b in epochs[0]) / len(epochs[0])
    shuffled = torch.randperm(len(LENGTHS), generator=torch.Generator().manual_seed(0)).tolist()
    random_spread = sum(max(LENGTHS[i] for i in shuffled[k : k + 8]) - min(LENGTHS[i] for i in shuffled[k : k + 8])
                        for k in range(0, len(shuffled), 8)) / 26  # fmt: skip
    assert spread < random_spread / 3  # the padding a batch carries is a fraction of a random batch's
    with pytest.raises(ValueError, match="batch_size=0"):
        LengthBucketedBatches(LENGTHS, batch_size=0, seed=0)


def bucketed_loader(seed: int):
    dataset = [{"i": i} for i in range(len(LENGTHS))]
    loader = DataLoader(dataset, batch_sampler=LengthBucketedBatches(LENGTHS, 8, seed, pool_batches=5),
                        collate_fn=lambda rows: [r["i"] for r in rows])  # fmt: skip
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    return Accelerator().prepare_data_loader(loader)


def test_bucketed_batches_resume_exactly_across_an_epoch_boundary():
    state = TrainState()
    whole = accumulation_windows(bucketed_loader(3), 2, state, lambda b: b)
    expected = [next(whole) for _ in range(18)]  # 13 windows an epoch (26 batches, pairs): into the second
    state = TrainState()
    first = accumulation_windows(bucketed_loader(3), 2, state, lambda b: b)
    head = [next(first) for _ in range(15)]
    saved = TrainState(epoch=state.epoch, batches_in_epoch=state.batches_in_epoch)
    assert saved.epoch == 1 and saved.batches_in_epoch == 4
    rest = accumulation_windows(bucketed_loader(3), 2, saved, lambda b: b)
    assert head + [next(rest) for _ in range(3)] == expected


def test_bert_mean_pooling_feeds_the_masked_mean_to_its_pooler():
    from transformers import BertConfig, BertForSequenceClassification

    from concept_encoder.finetuning.chunked import apply_reading
    from concept_encoder.finetuning.probe import masked_mean

    torch.manual_seed(0)
    config = BertConfig(vocab_size=40, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    model = BertForSequenceClassification(config).eval()
    ids, mask = torch.randint(5, 40, (2, 11)), torch.ones(2, 11, dtype=torch.long)
    mask[1, 7:] = 0
    with torch.no_grad():
        states = model.bert(ids, attention_mask=mask).last_hidden_state
        pooled = model.bert.pooler.activation(model.bert.pooler.dense(masked_mean(states, mask)))
        assert "mean of its real tokens" in apply_reading(model, None, "mean")
        torch.testing.assert_close(model(ids, attention_mask=mask).logits, model.classifier(pooled))
        short = model(ids[1:, :7]).logits  # the padded row equals itself unpadded
        torch.testing.assert_close(model(ids, attention_mask=mask).logits[1:], short, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def listops_model(workdir):
    """A micro Concept Encoder with refined tokens and [CLS] pooling, the ListOps tokenizer beside it."""
    os.chdir(workdir)
    from concept_encoder.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("listops")
    arm = listops.Arm("m", "m", "micro", "concept", 8, True, "cls", 1, "scratch")
    return listops.fresh_folder(workdir / "lo", arm, tokenizer, 66)


@pytest.mark.loop
def test_listops_fine_tuning_with_buckets_resumes_exactly_and_reports_the_last_step(workdir, listops_model,
                                                                                    monkeypatch):  # fmt: skip
    argv = ["--model_name_or_path", str(listops_model), "--from_scratch", "--seeds", "1", "--save_steps", "6",
            "--pooling", "cls", *FINETUNE]  # fmt: skip
    assert finetune.main([*argv, "--run_name", "whole"]) == 0
    whole = json.loads(sorted(Path("Cache/reports").glob("finetune_*.json"))[-1].read_text())["runs"][0]
    assert set(whole["validation_last_step"]) == {"accuracy", "macro_f1"} and whole["steps"] == 16
    assert set(whole["validation_by"]) == {"depth", "length_range"}
    assert sum(g["count"] for g in whole["validation_by"]["depth"].values()) == 50
    assert "[CLS] token refined" in whole["pooling"] and whole["memory"]["peak_rss_gb"] > 0
    real, calls = finetune.train_step, {"n": 0}

    def step_then_signal(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 9:  # after the checkpoint at 6, before the next
            os.kill(os.getpid(), signal.SIGTERM)
        return real(*args, **kwargs)

    monkeypatch.setattr(finetune, "train_step", step_then_signal)
    assert finetune.main([*argv, "--run_name", "split"]) == 128 + signal.SIGTERM  # checkpointed, not finished
    monkeypatch.setattr(finetune, "train_step", real)
    AcceleratorState._reset_state(reset_partial_state=True)
    assert finetune.main([*argv, "--run_name", "split", "--resume_from_checkpoint", "auto"]) == 0
    resumed = json.loads(sorted(Path("Cache/reports").glob("finetune_*.json"))[-1].read_text())["runs"][0]
    for key in ("best_step", "dev", "validation", "validation_last_step", "validation_by"):
        assert resumed[key] == whole[key], key

    def losses(name):
        [folder] = Path("Cache/finetune").glob(f"{name}-*-seed42")
        return [json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()
                if json.loads(line)["kind"] == "train"]  # fmt: skip

    assert losses("split") == losses("whole")  # bitwise: the same bucketed batches after the resume


DRIVER = ["--task", "listops:100:200", "--presets", "micro", "--concepts", "8,16", "--pretrain_tokens", "4k", "--seeds", "2",
          "--finetune_args", "--max_steps 4 --learning_rates 1e-3 --per_device_train_batch_size 8 "
          "--per_device_eval_batch_size 50 --report_to none --progress_bar false",
          "--", "--per_device_train_batch_size", "4", "--report_to", "none", "--progress_bar", "false",
          "--eval_steps", "0", "--save_steps", "0", "--max_eval_batches", "1", "--output_dir", "runs"]  # fmt: skip


@pytest.mark.loop
def test_the_driver_on_a_tiny_variant_writes_every_row_and_reuses_them(in_process, capsys, monkeypatch):
    assert listops.main(DRIVER) == 0
    [report] = Path("Cache/reports").glob("listops_*.json")
    assert {p.suffix for p in report.parent.glob(f"{report.stem}.*")} == {".md", ".json", ".png"}
    data = json.loads(report.read_text())
    keys = [r["key"] for r in data["rows"]]
    expected = ["micro-concept-C8", "micro-concept-C8-refine", "micro-concept-C16", "micro-concept-C16-refine",
                "micro-bert"]  # fmt: skip
    assert keys[:5] == expected and len(keys) == 7  # then the best Concept Encoder's and BERT's self-pretrained twins
    assert keys[5] in {f"{k}-selfpre" for k in expected[:4]} and keys[6] == "micro-bert-selfpre"
    rows = {r["key"]: r for r in data["rows"]}
    assert [len(rows[k]["seeds"]) for k in keys] == [1, 1, 2, 2, 2, 2, 2]  # the sweep's width: one seed
    for row in data["rows"]:
        assert 0 <= row["accuracy"] <= 1 and row["accuracy_last"] is not None and row["seconds"] > 0
        assert row["tokens_per_s"] > 0 and row["forward_flops_per_example"] > 0 and row["parameters"] > 0
        assert set(row["accuracy_by"]) == {"depth", "length_range"}
    refined, plain = rows["micro-concept-C16-refine"], rows["micro-concept-C16"]
    assert refined["forward_flops_per_example"] > plain["forward_flops_per_example"]
    assert refined["parameters"] > plain["parameters"]
    pretraining = [c for c in in_process if str(experiments.MLM_SCRIPT) in c]
    assert len(pretraining) == 2 and all("task:listops:100:200" in c and "0.1" in c for c in pretraining)
    assert data["published"][0] == ["Transformer (LRA)", 36.37] and data["goals"]
    markdown = report.with_suffix(".md").read_text()
    assert "Published test accuracy" in markdown and "micro-bert-selfpre" in markdown
    launched = len(in_process)
    capsys.readouterr()
    assert listops.main(DRIVER) == 0  # everything measured: reused, nothing launched but the finished pretraining
    assert len([c for c in in_process[launched:] if str(experiments.FINETUNE_SCRIPT) in c]) == 0
    assert "finished earlier, reused" in capsys.readouterr().out
    for key in expected:  # the from-scratch arms measured again, --jobs 2 (the self-pretrained twins reused)
        Path(f"Cache/listops/listops/points/{key}.json").unlink()
    monkeypatch.setenv("CPU_THREADS", "")  # recorded, so that whatever the test leaves is undone
    monkeypatch.delenv("CPU_THREADS")
    launches = TwoAtATime(experiments.run_command)
    monkeypatch.setattr(experiments, "run_command", launches)
    assert listops.main([*DRIVER[:2], "--jobs", "2", *DRIVER[2:]]) == 0
    assert "--jobs 2: arms measured 2 at a time, " in capsys.readouterr().out
    assert len(launches.most) == 5 and max(launches.most) == 2  # two arms at once, never more
    assert set(launches.threads) == {str(max(1, usable_cores() // 2))}
    [again] = sorted(Path("Cache/reports").glob("listops_*.json"), key=lambda p: p.stat().st_mtime_ns)[-1:]
    assert [(r["key"], r["accuracy"]) for r in json.loads(again.read_text())["rows"]] == [
        (r["key"], r["accuracy"]) for r in data["rows"]
    ]
    monkeypatch.setattr(experiments, "run_command", launches.fallback)
    assert listops.main([*DRIVER[:2], "--archive", "kept", *DRIVER[2:]]) == 0  # every finished point copied there
    assert sorted(p.stem for p in Path("kept/listops/points").glob("*.json")) == sorted(keys)
    shutil.rmtree("Cache/listops")  # a fresh machine: the points only in the archive, no pretraining run either
    shutil.rmtree("runs")
    launched = len(in_process)
    assert listops.main([*DRIVER[:2], "--archive", "kept", *DRIVER[2:]]) == 0
    assert len(in_process) == launched  # nothing fine-tuned, nothing self-pretrained again
    [line] = [line for line in capsys.readouterr().out.splitlines() if " restored from kept/listops" in line]
    assert set(line.split(" restored from")[0].split(", ")) == set(keys)
    [restored] = sorted(Path("Cache/reports").glob("listops_*.json"), key=lambda p: p.stat().st_mtime_ns)[-1:]
    assert json.loads(restored.read_text())["rows"] == json.loads(again.read_text())["rows"]


def test_bad_driver_plans_are_refused_before_any_run(in_process, capsys):
    for extra, message in (
        (["--task", "embedded"], "measures listops"),
        (["--presets", "micro,huge"], "unknown"),
        (["--concepts", "16,16"], "distinct"),
        (["--poolings", "max"], "--poolings 'max': ['max'] unknown; choose from ('mean', 'cls')"),
        (["--architectures", "gpt"], "--architectures 'gpt': ['gpt'] unknown; choose from ('concept', 'bert')"),
        (["--mixers", "none,lstm"], "--mixers 'none,lstm': ['lstm'] unknown; choose from ('none', 'conv')"),
        (["--finetune_args", "--seeds 2"], "set by the listops driver"),
    ):
        with pytest.raises(SystemExit):
            listops.main([*extra])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        listops.main(["--task", "listops:100:200", "--", "--dataset", "docstrings"])
    assert "set by the listops driver" in capsys.readouterr().err
    small = ["--task", "listops:100:200", "--presets", "micro"]
    for extra, message in (
        (["--pretrain_tokens", "1M,2M"], "--pretrain_tokens '1M,2M': give one budget"),
        (["--pretrain_tokens", "0k"], "--pretrain_tokens '0k': '0k' is not a positive token count"),
        (["--architectures", "concept", "--refinement", "off", "--poolings", "cls"], "no arm to measure"),
        (["--", "--bogus", "1"], "--bogus"),  # the self-pretraining's arguments: checked before the first arm runs
    ):
        with pytest.raises(SystemExit):
            listops.main([*small, *extra])
        assert message in capsys.readouterr().err
    assert in_process == [] and not Path("Cache/listops/listops").exists()  # nothing launched, nothing recorded


def test_the_mixer_arms_build_models_with_the_mixer_and_keep_the_plain_arms_keys(tmp_path):
    """`--mixers none,conv` adds a mixer arm beside each Concept Encoder arm (BERT has none); the plain arms keep the
    keys they had before the axis existed (so earlier folders are reused), and each arm's model folder says its mixer."""
    from concept_encoder.data.tokenizer import load_tokenizer

    args = listops.build_parser().parse_args(["--presets", "micro", "--concepts", "16", "--refinement", "both",
                                              "--mixers", "none,conv"])  # fmt: skip
    listops.check_arguments(args)
    arms = listops.scratch_arms(args)
    assert [a.key for a in arms] == ["micro-concept-C16", "micro-concept-C16-conv", "micro-concept-C16-refine",
                                     "micro-concept-C16-refine-conv", "micro-bert"]  # fmt: skip
    tokenizer = load_tokenizer("listops")
    for arm in arms:
        config = json.loads((listops.fresh_folder(tmp_path, arm, tokenizer, 102) / "config.json").read_text())
        assert config.get("local_mixer", "none") == arm.mixer and ("local mixer" in arm.label) == (arm.mixer == "conv")
    plan, _ = listops.pretraining_plan(arms[1], args, [], 102, 1000)
    assert plan.pretrain_argv[plan.pretrain_argv.index("--local_mixer") + 1] == "conv"
