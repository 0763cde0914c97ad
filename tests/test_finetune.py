"""loops/finetune.py and concept_encoder.tasks: task types, the embedded task, model loading, selection
on dev only, baselines, the report, clear errors."""

import json
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from accelerate.state import AcceleratorState
from loop_runs import (  # noqa: F401 (fixtures: a module work folder, accelerate reset)
    fp16_scaler_on_cpu,
    fresh_accelerate,
    overflowing_once,
    workdir,
)
from safetensors.torch import load_file, save_file
from token_encoders import POSITIONS, save_token_encoder, tiny_config

import loops.finetune as finetune
from concept_encoder import ConceptEncoderForMaskedLM, config_from_preset
from concept_encoder.checkpoints.checkpoint import write_manifest
from concept_encoder.data import DataSourceError, load_tokenizer
from concept_encoder.tasks import TaskArguments, load_task
from concept_encoder.training.args import FINETUNE_ARGUMENT_CLASSES, FINETUNE_DEFAULTS
from concept_encoder.training.preflight import fail_fast

ROOT = Path(__file__).resolve().parents[1]

WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda omicron sigma omega red green blue".split()
COMMON = ["--max_steps", "60", "--eval_steps", "15", "--logging_steps", "5", "--per_device_train_batch_size", "16",
          "--learning_rates", "3e-3", "--report_to", "none", "--progress_bar", "false"]  # fmt: skip


def sentence(rng: random.Random, cue: str | None = None) -> str:
    words = [rng.choice(WORDS[:12]) for _ in range(8)]
    if cue:
        words.insert(rng.randrange(len(words)), cue)
    return " ".join(words)


@pytest.fixture(scope="module")
def concept_model(workdir) -> Path:
    """A micro Concept Encoder saved with its tokenizer, as `make train` leaves one (untrained)."""
    rng = random.Random(0)
    tokenizer = load_tokenizer("train:wordpiece:200", texts=iter([sentence(rng, c) for c in WORDS * 20]),
                               corpus_id="finetune-test", cache_dir=workdir / "Cache")  # fmt: skip
    config = config_from_preset("micro", vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                                mask_token_id=tokenizer.mask_token_id, cls_token_id=tokenizer.cls_token_id,
                                sep_token_id=tokenizer.sep_token_id, unk_token_id=tokenizer.unk_token_id,
                                hidden_dropout_prob=0.0)  # fmt: skip
    torch.manual_seed(0)
    path = workdir / "concept" / "final"
    ConceptEncoderForMaskedLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def bert_model(workdir, concept_model) -> Path:
    """A tiny transformers BERT saved locally, with the same tokenizer."""
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    tokenizer = AutoTokenizer.from_pretrained(concept_model)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    path = workdir / "bert"
    BertForMaskedLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_tasks(folder: Path) -> dict[str, Path]:
    """Learnable synthetic tasks: a cue word decides the class (in the second text for pairs) or the score."""
    rng = random.Random(1)
    folder.mkdir(exist_ok=True)
    rows = [(sentence(rng, cue), cue) for cue in ("red", "green", "blue") * 60]
    single = folder / "colors.csv"
    single.write_text("text,label\n" + "\n".join(f"{t},{c}" for t, c in rows) + "\n")
    pairs = folder / "pairs.tsv"
    lines = []
    for i in range(180):  # the label is in the second text: the pair must be encoded jointly
        cue = "red" if i % 2 else "blue"
        lines.append(f"{sentence(rng, rng.choice(('green', None)))}\t{sentence(rng, cue)}\t{int(cue == 'red')}")
    pairs.write_text("first\tsecond\tsame\n" + "\n".join(lines) + "\n")
    regression = folder / "scores.jsonl"
    scores = {"red": 0.1, "green": 0.55, "blue": 0.95}
    regression.write_text("".join(json.dumps({"text": sentence(rng, c), "label": scores[c] + rng.uniform(-0.05, 0.05)}) + "\n"
                                  for c in ("red", "green", "blue") * 60))  # fmt: skip
    multi = folder / "tags.jsonl"
    rows = []
    for _ in range(180):
        tags = [rng.random() < 0.5 for _ in ("red", "green", "blue")]
        text = sentence(rng, " ".join(c for c, on in zip(("red", "green", "blue"), tags, strict=True) if on) or None)
        rows.append(json.dumps({"text": text, "label": [int(t) for t in tags]}) + "\n")
    multi.write_text("".join(rows))
    return {"single": single, "pairs": pairs, "regression": regression, "multi": multi}


@pytest.mark.loop
@pytest.mark.parametrize(
    ("kind", "extra", "metric"),
    [("single", [], "accuracy"), ("pairs", ["--text_fields", "first,second", "--label_field", "same"], "accuracy"),
     ("regression", [], "pearson"), ("multi", [], "micro_f1")],
)  # fmt: skip
def test_each_task_type_trains_and_reports_every_seed(workdir, concept_model, kind, extra, metric):
    task = write_tasks(workdir / "tasks")[kind]
    assert finetune.main(["--model_name_or_path", str(concept_model), "--task", str(task), "--seeds", "2",
                          "--run_name", kind, *extra, *COMMON]) == 0  # fmt: skip
    report = json.loads(sorted(Path("Cache/reports").glob("finetune_*.json"))[-1].read_text())
    [row] = report["rows"]
    assert row["seeds"] == [42, 43] and len(row[f"{metric}_seeds"]) == 2
    assert row[f"{metric}_mean"] == pytest.approx(sum(row[f"{metric}_seeds"]) / 2)
    values = row[f"{metric}_seeds"]
    assert row[f"{metric}_std"] == pytest.approx(abs(values[0] - values[1]) / 2**0.5)
    baselines = report["baselines"][task.name]
    assert set(baselines) == {"majority", "tfidf", "task_sha256"} and metric in baselines["tfidf"]["validation"]
    assert row["rate_grid"] == {"0.003": report["runs"][0]["dev"][metric]} and row["learning_rate"] == 3e-3
    for run in report["runs"]:
        train = [r for r in map(json.loads, Path(run["run_dir"], "metrics.jsonl").read_text().splitlines())
                 if r["kind"] == "train"]  # fmt: skip
        losses = [r["loss"] for r in train]
        assert sum(losses[-3:]) < sum(losses[:3]), losses  # logged losses are single batches: compare three
        assert [r["step"] for r in train] == list(range(5, 61, 5))  # host memory logged with each: RSS over the run
        assert all(0 < r["rss_gb"] <= r["peak_rss_gb"] for r in train)
        assert Path(run["run_dir"], "final", "config.json").exists()


@pytest.mark.loop
def test_each_seed_trains_in_its_own_shuffled_order_and_bucketing_buckets(workdir, concept_model, monkeypatch):
    """The training split is shuffled in an order drawn from the seed: two seeds, two first batches. With
    `--bucket_by_length` the batches come from `LengthBucketedBatches`. (Passed by position, the bucketing flag once
    landed on the shuffle: every run trained in the file's order, the same for every seed.) The order is a setting
    of the run: a finished run that records none is not reused."""
    from concept_encoder.training import batches

    first_batches, samplers = [], []
    original = batches.positioned_windows

    def spy(loader, *args, **kwargs):
        samplers.append(loader.batch_sampler)
        for index, (window, position) in enumerate(original(loader, *args, **kwargs)):
            if index == 0:
                first_batches.append(window[0]["input_ids"].tolist())
            yield window, position

    monkeypatch.setattr(batches, "positioned_windows", spy)
    task = write_tasks(workdir / "tasks")["single"]
    argv = ["--model_name_or_path", str(concept_model), "--task", str(task), *COMMON, "--max_steps", "1"]
    assert finetune.main([*argv, "--seeds", "2", "--run_name", "orders"]) == 0
    assert len(first_batches) == 2 and first_batches[0] != first_batches[1]
    assert not any(isinstance(sampler, batches.LengthBucketedBatches) for sampler in samplers)
    assert finetune.main([*argv, "--run_name", "buckets", "--bucket_by_length", "true"]) == 0
    assert isinstance(samplers[-1], batches.LengthBucketedBatches)
    # a run that records no order (trained in the file's order, before the fix) is not reused as one of these
    [summary] = Path("Cache/finetune").glob("orders-*-seed42/summary.json")
    done = json.loads(summary.read_text())
    del done["settings"]["train_order"]
    summary.write_text(json.dumps(done))
    with pytest.raises(finetune.CheckpointError, match="train_order: finished run None, this run 'shuffled per seed'"):
        finetune.main([*argv, "--seeds", "2", "--run_name", "orders", "--resume_from_checkpoint", "auto"])


def test_a_path_with_seed_starts_each_seed_from_its_own_model(workdir, concept_model, monkeypatch, capsys):
    """`{seed}` in --model_name_or_path: each seed loads its own folder (a curriculum: seed 42 continues the earlier
    stage's seed-42 run), recorded in its run's settings; a seed without its folder is refused before any run."""
    task = str(write_tasks(workdir / "tasks")["single"])
    argv = ["--task", task, *COMMON, "--max_steps", "2", "--eval_steps", "1", "--seeds", "2"]
    assert finetune.main(["--model_name_or_path", str(concept_model), *argv, "--run_name", "stage1"]) == 0
    [tag] = {p.name.removeprefix("stage1-").rsplit("-seed", 1)[0] for p in Path("Cache/finetune").glob("stage1-*")}
    per_seed = str(Path("Cache/finetune").resolve() / f"stage1-{tag}-seed{{seed}}" / "final")
    loaded = []
    original = finetune.classifier
    monkeypatch.setattr(finetune, "classifier", lambda path, *a: loaded.append(path) or original(path, *a))
    assert finetune.main(["--model_name_or_path", per_seed, *argv, "--run_name", "stage2"]) == 0
    assert loaded == [per_seed.format(seed=42), per_seed.format(seed=43)]
    digests = set()
    for seed in (42, 43):
        [summary] = Path("Cache/finetune").glob(f"stage2-*-seed{seed}/summary.json")
        settings = json.loads(summary.read_text())["settings"]
        assert settings["model"] == per_seed.format(seed=seed)
        digests.add(settings["model_sha256"])
    assert len(digests) == 2  # two models, not one read twice
    assert "seedS" in summary.parent.name  # the run names name the template, not one seed's folder
    loaded.clear()
    with pytest.raises(ValueError, match=f"stage1-{tag}-seed44/final is not a folder"):
        finetune.main(["--model_name_or_path", per_seed, *argv, "--seeds", "3", "--run_name", "stage3"])
    assert loaded == [] and not list(Path("Cache/finetune").glob("stage3-*"))
    # the launched script's check before torch loads (`fail_fast`) reads every seed's folder the same way
    fail_fast(["--model_name_or_path", per_seed, *argv], FINETUNE_ARGUMENT_CLASSES, FINETUNE_DEFAULTS)
    with pytest.raises(SystemExit):
        fail_fast(["--model_name_or_path", per_seed, *argv, "--seeds", "3"], FINETUNE_ARGUMENT_CLASSES,
                  FINETUNE_DEFAULTS)  # fmt: skip
    assert f"stage1-{tag}-seed44/final is not a folder" in capsys.readouterr().err


def test_embedded_task_is_deterministic_real_and_not_trivial():
    first, second = load_task(TaskArguments(task="embedded")), load_task(TaskArguments(task="embedded"))
    assert first.train["text_a"] == second.train["text_a"] and first.validation["label"] == second.validation["label"]
    total = sum(first.sizes().values())
    assert total >= 2000 and first.num_labels == 9
    counts = [first.validation["label"].count(k) for k in range(9)]
    assert max(counts) / sum(counts) < 0.2  # the majority baseline is far below 100%
    pairs = load_task(TaskArguments(task="embedded_pairs"))
    assert pairs.pair and set(pairs.train["label"]) == {0, 1}


@pytest.mark.loop
def test_a_pretrained_encoder_loads_into_the_classifier_and_bert_runs_the_same_protocol(
    workdir, concept_model, bert_model
):
    from concept_encoder.training.model import build_classifier

    task = load_task(TaskArguments(task=str(write_tasks(workdir / "tasks")["single"])))
    classifier, note = build_classifier(str(concept_model), task)
    pretrained = ConceptEncoderForMaskedLM.from_pretrained(concept_model)
    for name, tensor in pretrained.encoder.state_dict().items():
        assert torch.equal(classifier.encoder.state_dict()[name], tensor), name
    assert "dropped" in note and "mlm_decoder" in note and not hasattr(classifier, "mlm_decoder")
    assert finetune.main(["--model_name_or_path", str(concept_model), "--compare_to", str(bert_model),
                          "--task", str(workdir / "tasks" / "colors.csv"), "--seeds", "1", "--run_name", "both",
                          *COMMON]) == 0  # fmt: skip
    report = json.loads(sorted(Path("Cache/reports").glob("finetune_*.json"))[-1].read_text())
    assert [row["model"] for row in report["rows"]] == ["concept", "bert"]


@pytest.mark.loop
@pytest.mark.parametrize(("kind", "precision"), [("roberta", "no"), ("distilbert", "bf16"), ("mpnet", "no")])
def test_roberta_distilbert_and_mpnet_fine_tune_two_steps_probe_and_are_kernel_probed_in_the_runs_dtype(
    workdir, concept_model, monkeypatch, kind, precision
):
    from transformers import AutoTokenizer

    folder = save_token_encoder(workdir / kind, kind, AutoTokenizer.from_pretrained(concept_model))
    verdicts, real = [], finetune.probe_attention_kernels
    monkeypatch.setattr(finetune, "probe_attention_kernels", lambda *a, **k: verdicts.append(real(*a, **k)))
    assert finetune.main(["--model_name_or_path", str(folder), "--task", str(write_tasks(workdir / "tasks")["single"]),
                          "--seeds", "1", "--run_name", kind, "--probe", *COMMON, "--max_steps", "2", "--eval_steps",
                          "2", "--mixed_precision", precision]) == 0  # fmt: skip
    report = json.loads(sorted(Path("Cache/reports").glob("finetune_*.json"))[-1].read_text())
    methods = [(row["model"], row["method"]) for row in report["rows"]]
    assert methods == [(kind, "probe: hidden mean"), (kind, "fine-tune")]
    [run] = [run for run in report["runs"] if run["method"] == "fine-tune"]
    saved = json.loads(Path(run["run_dir"], "final", "config.json").read_text())
    assert run["best_step"] == 2 and saved["model_type"] == kind
    [verdict] = verdicts
    assert verdict["dtype"] == {"no": "fp32", "bf16": "bf16"}[precision] and verdict["dropout"] == 0.1
    if kind == "mpnet":  # eager attention: no SDPA kernel to choose, and the probe says so instead of guessing
        assert verdict["chosen"] is None and "attn_implementation='eager'" in verdict["not_probed"]
    else:
        assert verdict["math"] and not verdict["cudnn"] and verdict["chosen"] in ("flash", "math")


@pytest.mark.loop
def test_the_rate_and_step_are_chosen_on_dev_never_on_the_reported_split(workdir, concept_model, monkeypatch):
    task_file = str(write_tasks(workdir / "tasks")["single"])
    argv = ["--model_name_or_path", str(concept_model), "--task", task_file, "--seeds", "2", *COMMON,
            "--learning_rates", "3e-4,3e-3"]  # fmt: skip
    finetune.main([*argv, "--run_name", "clean"])
    clean = json.loads(sorted(Path("Cache/reports").glob("finetune_*.json"))[-1].read_text())
    assert list(clean["rows"][0]["rate_grid"]) == ["0.0003", "0.003"]
    # every rate on the first seed; the chosen one for the second seed only
    folders = sorted(p.name for p in Path("Cache/finetune").glob("clean-*"))
    chosen = f"{clean['rows'][0]['learning_rate']:g}"
    assert folders == sorted(["clean-concept-lr0.0003-seed42", "clean-concept-lr0.003-seed42",
                              f"clean-concept-lr{chosen}-seed43"])  # fmt: skip
    # validation evaluated once per seed, for the chosen run only
    evaluated = {p.parent.name for p in Path("Cache/finetune").glob("clean-*/metrics.jsonl")
                 if any(json.loads(line)["kind"] == "validation" for line in p.read_text().splitlines())}  # fmt: skip
    assert evaluated == {f"clean-concept-lr{chosen}-seed42", f"clean-concept-lr{chosen}-seed43"}
    other = next(rate for rate in ("0.0003", "0.003") if rate != chosen)  # the grid's other run: its time kept
    assert all(list(run["rate_grid_seconds"]) == [other] for run in clean["runs"])
    assert clean["rows"][0]["grid_seconds"] == clean["runs"][0]["rate_grid_seconds"][other] > 0

    real_load = finetune.load_task

    def poisoned(args):
        task = real_load(args)
        labels = task.validation["label"]
        task.validation = task.validation.remove_columns("label").add_column("label", labels[::-1])
        return task

    AcceleratorState._reset_state(reset_partial_state=True)
    monkeypatch.setattr(finetune, "load_task", poisoned)
    finetune.main([*argv, "--run_name", "poisoned"])
    dirty = json.loads(sorted(Path("Cache/reports").glob("finetune_*.json"))[-1].read_text())
    assert dirty["rows"][0]["rate_grid"] == clean["rows"][0]["rate_grid"]
    assert dirty["rows"][0]["learning_rate"] == clean["rows"][0]["learning_rate"]
    for before, after in zip(clean["runs"], dirty["runs"], strict=True):
        assert after["best_step"] == before["best_step"] and after["dev"] == before["dev"]
    assert [r["validation"] for r in dirty["runs"]] != [r["validation"] for r in clean["runs"]]


@pytest.mark.loop
def test_baselines_and_probes_see_exactly_the_rows_the_models_see_and_the_report_shows_them(
    workdir, concept_model, bert_model
):
    from concept_encoder.tasks.baselines import split_rows

    task_file = workdir / "tasks" / "colors.csv"
    write_tasks(workdir / "tasks")
    assert finetune.main(["--model_name_or_path", str(concept_model), "--compare_to", str(bert_model),
                          "--task", str(task_file), "--seeds", "1", "--run_name", "rows", "--probe", *COMMON,
                          "--max_steps", "15"]) == 0  # fmt: skip
    report_json = sorted(Path("Cache/reports").glob("finetune_*.json"))[-1]
    report = json.loads(report_json.read_text())
    tfidf = report["baselines"]["colors.csv"]["tfidf"]
    task = load_task(TaskArguments(task=str(task_file)))
    expected = {name: split_rows(split) for name, split in (("train", task.train), ("dev", task.dev),
                                                            ("validation", task.validation))}  # fmt: skip
    assert tfidf["rows"] == expected and [r["count"] for r in expected.values()] == [len(task.train), len(task.dev),
                                                                                    len(task.validation)]  # fmt: skip
    assert len(report["runs"]) == 5  # concept: 2 probes + 1 fine-tune; bert: 1 probe + 1 fine-tune
    for run in report["runs"]:
        assert run["rows"] == tfidf["rows"], run["method"]  # the encoded splits the loaders iterate
    assert tfidf["validation"]["accuracy"] > 0.9  # the cue word decides the class: a bag of words finds it
    methods = [(row["model"], row["method"]) for row in report["rows"]]
    assert methods == [("concept", "probe: concepts mean"), ("concept", "probe: embeddings mean"),
                       ("concept", "fine-tune"), ("bert", "probe: hidden mean"), ("bert", "fine-tune")]  # fmt: skip
    for row in report["rows"]:
        if row["method"].startswith("probe"):
            assert set(row["probe_C"]) <= {0.01, 0.1, 1.0, 10.0, 100.0, 1000.0}
    # random embeddings still separate a cue word: the bag-of-embeddings probe learns the task
    assert next(r for r in report["rows"] if r["method"] == "probe: embeddings mean")["accuracy_mean"] > 0.6
    markdown = report_json.with_suffix(".md").read_text()
    for text in (
        "TF-IDF (word 1-2 grams) + linear",
        "majority class",
        "probe: concepts mean",
        "Learning rate grid",
        "**",
        "learned softmax weights over concepts → dense+tanh",
        "[CLS] → pooler dense+tanh",
    ):
        assert text in markdown, text
    assert report_json.with_suffix(".png").stat().st_size > 0
    # the baselines are kept beside the output folder, keyed by the task's rows: a second invocation reads them
    from concept_encoder.tasks.baselines import task_baselines, task_digest

    cached = Path("Cache/baselines") / f"colors.csv-{task_digest(task)}.json"
    assert {**json.loads(cached.read_text()), "task_sha256": task_digest(task)} == report["baselines"]["colors.csv"]
    cached.write_text(json.dumps({"majority": {"accuracy": -1.0}, "tfidf": {}}))  # proof that it is read
    assert task_baselines(task, cache_dir="Cache")["majority"] == {"accuracy": -1.0}
    changed = load_task(TaskArguments(task=str(task_file), dev_fraction=0.2))
    assert task_digest(changed) != task_digest(task)
    cached.unlink()


@pytest.mark.loop
def test_probe_only_leaves_the_model_untouched_and_trains_nothing(workdir, concept_model):
    from transformers import AutoTokenizer

    from concept_encoder.finetuning.probe import linear_probe
    from concept_encoder.tasks.loading import encode_splits
    from concept_encoder.training.model import build_classifier

    task = load_task(TaskArguments(task=str(write_tasks(workdir / "tasks")["single"])))
    tokenizer = AutoTokenizer.from_pretrained(concept_model)
    splits = encode_splits(task, tokenizer, 64)
    model, _ = build_classifier(str(concept_model), task)
    model.train()  # the probe evaluates in eval mode and gives the model back as it found it
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loaders = finetune.make_loaders(splits, tokenizer, model, SimpleNamespace(per_device_train_batch_size=16, dataloader_num_workers=0,
                                    per_device_eval_batch_size=16), 0, shuffle_train=False)  # fmt: skip
    fits = linear_probe(model, loaders, splits, task, torch.device("cpu"))
    assert set(fits) == {"concepts mean", "embeddings mean"}
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and model.training
    assert fits["embeddings mean"]["chosen"] in (0.01, 0.1, 1.0, 10.0, 100.0, 1000.0)
    assert finetune.main(["--model_name_or_path", str(concept_model), "--task", str(workdir / "tasks" / "colors.csv"),
                          "--probe", "--finetune", "false", "--run_name", "probe-only", *COMMON]) == 0  # fmt: skip
    report = json.loads(sorted(Path("Cache/reports").glob("finetune_*.json"))[-1].read_text())
    assert {row["method"] for row in report["rows"]} == {"probe: concepts mean", "probe: embeddings mean"}
    assert not list(Path("Cache/finetune").glob("probe-only-*"))  # no fine-tuning run folder


@pytest.mark.loop
def test_the_chosen_step_at_the_end_says_train_longer(workdir, concept_model, capsys):
    task_file = str(write_tasks(workdir / "tasks")["single"])
    argv = ["--model_name_or_path", str(concept_model), "--task", task_file, "--seeds", "1", "--run_name", "short",
            *COMMON, "--eval_steps", "0", "--epochs", "1"]  # fmt: skip
    assert finetune.main(argv) == 0  # one evaluation, at the last step: it is chosen, nothing says it stopped improving
    report_json = sorted(Path("Cache/reports").glob("finetune_*.json"))[-1]
    [row] = json.loads(report_json.read_text())["rows"]
    one_pass = -(-len(load_task(TaskArguments(task=task_file)).train) // 16)  # --epochs 1 at batch 16, in steps
    assert row["still_improving"] and row["best_steps"] == [one_pass]
    assert "still improving: train longer" in report_json.with_suffix(".md").read_text()
    assert "still improving: train longer" in capsys.readouterr().out  # the log line, on the console
    first, last = row["train_loss"]
    assert first > 0 and last > 0


def test_fine_tuning_flags_are_checked_before_any_work(concept_model, bert_model, tmp_path):
    base = ["--model_name_or_path", str(concept_model), *COMMON]
    with pytest.raises(ValueError, match="--learning_rates 0.001 for one fixed rate instead of --learning_rate"):
        finetune.main([*base, "--learning_rate", "1e-3"])
    with pytest.raises(ValueError, match="learning_rates='1e-4,x' is not a comma-separated list"):
        finetune.main([*base, "--learning_rates", "1e-4,x"])
    with pytest.raises(ValueError, match="give distinct rates in"):
        finetune.main([*base, "--learning_rates", "1e-4,1e-4"])
    with pytest.raises(ValueError, match=r"--pooling cls: .* does not refine its tokens \(token_refinement is off\)"):
        finetune.main([*base, "--pooling", "cls"])
    with pytest.raises(ValueError, match=r"supports \['auto', 'cls', 'mean'\]; its sequence-classification head pools"):
        finetune.main(["--model_name_or_path", str(bert_model), *COMMON, "--pooling", "weighted"])
    with pytest.raises(ValueError, match="--finetune false leaves nothing to do"):
        finetune.main([*base, "--finetune", "false"])
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="--report_dir .*a-file/reports: .*a-file is a file, not a folder"):
        finetune.main([*base, "--report_dir", str(a_file / "reports")])
    broken = tmp_path / "broken-model"
    broken.mkdir(exist_ok=True)
    (broken / "config.json").write_text("[]")
    with pytest.raises(ValueError, match="broken-model/config.json holds a JSON list"):
        finetune.main([*base, "--compare_to", str(broken)])  # every model is checked before the first trains


def test_pooling_choice_and_new_weights_are_named_in_full(workdir, concept_model, bert_model):
    from concept_encoder.training.model import build_classifier

    task = load_task(TaskArguments(task=str(write_tasks(workdir / "tasks")["single"])))
    model, _ = build_classifier(str(concept_model), task, pooling="mean")
    assert model.config.classifier_pooling == "mean" and model.pooling.score is None
    _, note = build_classifier(str(bert_model), task)
    # the saved BertForMaskedLM has no pooler: it and the classifier are new, named parameter by parameter
    assert "'bert.pooler.dense.weight'" in note and "'classifier.weight'" in note and "['bert'" not in note


@pytest.mark.parametrize("kind", ["roberta", "distilbert", "mpnet"])
def test_mean_pooling_and_chunks_are_refused_for_a_classifier_without_a_pooler(kind):
    from concept_encoder.finetuning.chunked import chunk_problem
    from concept_encoder.training.model import check_pooling

    without = tiny_config(kind, vocab_size=100)  # its head reads [CLS] itself: mean-pooled input would be dropped
    with pytest.raises(ValueError, match=f"--pooling mean: m: {kind}'s sequence classifier reads its first token's"):
        check_pooling(without, "mean", "m")
    assert "nor chunks (--chunk_length) can feed it" in chunk_problem(without, 16)
    assert check_pooling(without, "cls", "m") == {}
    bert = tiny_config("bert", vocab_size=100)  # a pooler: both readings feed it
    assert check_pooling(bert, "mean", "m") == {} and chunk_problem(bert, 16) is None


@pytest.mark.parametrize("kind", ["bert", "roberta", "distilbert", "mpnet"])
def test_a_token_encoder_is_refused_past_the_positions_its_table_reads(kind, tmp_path):
    """RoBERTa's and MPNet's position ids start after their padding index: their tables read fewer tokens than
    they have rows (roberta-base: 514 rows, 512 tokens), and one more token would fail mid-run."""
    from concept_encoder.accounting.architectures import readable_positions
    from concept_encoder.training.preflight import preflight

    config = tiny_config(kind, vocab_size=100, pad_token_id=3)
    config.save_pretrained(tmp_path)
    assert readable_positions(config.to_dict()) == POSITIONS
    fargs, task_args, args = finetune.parse_args(["--model_name_or_path", str(tmp_path), "--from_scratch",
                                                  "--max_seq_length", str(POSITIONS)],
                                                 classes=FINETUNE_ARGUMENT_CLASSES, defaults=FINETUNE_DEFAULTS)  # fmt: skip
    preflight(fargs, task_args, args, cuda=False)  # every position it reads: accepted
    task_args.max_seq_length = POSITIONS + 1
    with pytest.raises(ValueError, match=f"max_seq_length={POSITIONS + 1} exceeds the model's") as refused:
        preflight(fargs, task_args, args, cuda=False)
    assert ("are never read" in str(refused.value)) == (kind in ("roberta", "mpnet"))
    with torch.no_grad():  # the refusal is right: the table has no row for the next position
        model = finetune.AutoModelForSequenceClassification.from_config(config).eval()
        model(input_ids=torch.full((1, POSITIONS), 5))
        if kind in ("roberta", "mpnet"):
            with pytest.raises((IndexError, RuntimeError), match="out of"):
                model(input_ids=torch.full((1, POSITIONS + 1), 5))


def test_pad_to_multiple_of_rounds_every_batch_and_is_refused_past_the_positions(concept_model, tmp_path):
    from datasets import Dataset

    from concept_encoder.training.preflight import preflight

    tokenizer = finetune.AutoTokenizer.from_pretrained(concept_model)
    split = Dataset.from_dict({"input_ids": [[2, *[5] * n, 3] for n in (3, 9, 14, 6, 1)], "labels": [0, 1, 0, 1, 1]})

    class Reader(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None, labels=None):  # [B,N], [B,N], [B]
            return input_ids

    args = SimpleNamespace(dataloader_num_workers=0, per_device_train_batch_size=2, per_device_eval_batch_size=2)

    def lengths(multiple):
        loaders = finetune.make_loaders({"train": split, "dev": split}, tokenizer, Reader(), args, 0,
                                        pad_to_multiple_of=multiple)  # fmt: skip
        return {batch["input_ids"].shape[1] for loader in loaders.values() for batch in loader}

    assert any(n % 8 for n in lengths(None)) and lengths(8) == {8, 16}  # 5 to 16 tokens, each batch rounded up
    config = tiny_config("bert", vocab_size=100)
    config.save_pretrained(tmp_path)
    argv = ["--model_name_or_path", str(tmp_path), "--max_seq_length", str(POSITIONS)]

    def parsed(*extra):
        return finetune.parse_args([*argv, *extra], classes=FINETUNE_ARGUMENT_CLASSES, defaults=FINETUNE_DEFAULTS)

    preflight(*parsed("--from_scratch", "--pad_to_multiple_of", "32"), cuda=False)  # 128 = 4 x 32: within the table
    with pytest.raises(ValueError, match=f"--pad_to_multiple_of 48 pads a batch of max_seq_length={POSITIONS} tokens "
                                         f"to 144, past the model's {POSITIONS} positions; give --max_seq_length 96") as refused:  # fmt: skip
        preflight(*parsed("--pad_to_multiple_of", "48"), cuda=False)  # trained weights: the table cannot grow
    assert str(refused.value).endswith(f"(divisors of {POSITIONS} near 48: 32, 64)")
    fargs, task_args, args = parsed("--from_scratch", "--pad_to_multiple_of", "48")
    preflight(fargs, task_args, args, cuda=False)  # fresh weights: the twin's table is built to 144
    task = SimpleNamespace(num_labels=2, task_type="single_label_classification", label_names=None)
    twin, _ = finetune.classifier(str(tmp_path), task, fargs, task_args)
    assert twin.config.max_position_embeddings == 144 and twin.bert.embeddings.position_embeddings.num_embeddings == 144


def test_labels_keep_their_identity_and_bad_labels_are_named(tmp_path, caplog):
    folder = tmp_path / "labels"
    folder.mkdir()
    train = [("some words", "01"), ("other words", "1"), ("more text", "NA")] * 20  # three classes as written
    (folder / "train.csv").write_text("text,label\n" + "\n".join(f"{t} {i},{c}" for i, (t, c) in enumerate(train)))
    (folder / "validation.csv").write_text("text,label\nfirst,01\nsecond,NA\nthird,7\nfourth,7\n")
    task = load_task(TaskArguments(task=str(folder)))
    assert task.task_type == "single_label_classification" and task.label_names == ["01", "1", "7", "NA"]
    assert task.num_labels == 4 and sorted(set(task.train["label"])) == [0, 1, 3]  # 7 (id 2): validation only
    assert [task.label_names[i] for i in task.validation["label"]] == ["01", "NA", "7", "7"]
    assert "classes only in the validation split (never trained on; their examples count as errors): {'7': 2}" in (
        caplog.text
    )
    signs = tmp_path / "signs.jsonl"  # any integers: contiguous ids in numeric order
    signs.write_text("".join(json.dumps({"text": f"words {i}", "label": [-1, 10, 1][i % 3]}) + "\n" for i in range(60)))
    task = load_task(TaskArguments(task=str(signs)))
    assert task.label_names == ["-1", "1", "10"] and task.num_labels == 3
    holes = tmp_path / "holes.csv"
    holes.write_text("text,label\n" + "\n".join(f"words {i},{'' if i in (3, 8) else i % 2}" for i in range(40)))
    with pytest.raises(DataSourceError, match="2 row\\(s\\) have no label \\(rows \\[3, 8\\]"):
        load_task(TaskArguments(task=str(holes)))
    scores = tmp_path / "scores.csv"
    scores.write_text("text,label\n" + "\n".join(f"words {i},{'inf' if i == 5 else i / 7}" for i in range(40)))
    with pytest.raises(DataSourceError, match="regression labels must be finite numbers; rows \\[5\\]"):
        load_task(TaskArguments(task=str(scores), task_type="regression"))
    scores.write_text("text,label\n" + "\n".join(f"words {i},{i / 7}" for i in range(40)))
    assert load_task(TaskArguments(task=str(scores))).task_type == "regression"


def test_bad_tasks_fail_fast_with_one_clear_message(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: "offline" in milliseconds
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    with pytest.raises(DataSourceError, match="Hub is unreachable.*--dataset embedded|Hub is unreachable"):
        load_task(TaskArguments(task="glue:rte"))
    table = tmp_path / "t.csv"
    table.write_text("text,label\nsome words,1\nmore words,0\n")
    with pytest.raises(DataSourceError, match=r"no column\(s\) \['category'\]"):
        load_task(TaskArguments(task=str(table), label_field="category"))
    table.write_text("text,label\nsome words,1\n,0\nmore,1\n")
    with pytest.raises(DataSourceError, match="row 1 has no text in column 'text'"):
        load_task(TaskArguments(task=str(table)))
    table.write_text("text,label\n" + "\n".join(f"words {i},same" for i in range(40)) + "\n")
    with pytest.raises(DataSourceError, match="single class"):
        load_task(TaskArguments(task=str(table)))


def test_task_files_as_spreadsheets_and_people_write_them(tmp_path, caplog):
    table = tmp_path / "t.csv"
    rows = [f"words number {i},{'ab'[i % 2]}" for i in range(60)]
    table.write_bytes(("\ufefftext,label\n" + "\n".join(rows) + "\n").encode("utf-8"))  # "CSV UTF-8": a BOM
    assert load_task(TaskArguments(task=str(table))).label_names == ["a", "b"]
    long_cell = tmp_path / "long.csv"  # a whole long document in one cell: beyond csv's default 131,072 characters
    long_cell.write_text("text,label\n" + "\n".join(f"{'word ' * 40_000 if i == 3 else 'w'} {i},{'ab'[i % 2]}"
                                                    for i in range(60)) + "\n")  # fmt: skip
    long_task = load_task(TaskArguments(task=str(long_cell)))
    assert len(long_task.train) + len(long_task.dev) + len(long_task.validation) == 60
    refusals = {
        "text,label\n": "has a header row and no examples",
        "text,label,label\nwords,a,b\nmore,b,a\n": r"column\(s\) \['label'\] are named twice",
        "text,label\n" + "\n".join(f"words {i},{i / 7:.3f}" for i in range(40)) + "\nmore,n/a\n":
            r"scores such as 0.143 beside cells that are not numbers \(rows \[40\], e.g. 'n/a'\)",
    }  # fmt: skip
    for text, message in refusals.items():
        table.write_text(text)
        with pytest.raises(DataSourceError, match=message):
            load_task(TaskArguments(task=str(table)))
    ragged = tmp_path / "tags.jsonl"
    ragged.write_text("".join(json.dumps({"text": f"w {i}", "label": [1, 0] if i != 7 else [1, 0, 1]}) + "\n"
                              for i in range(30)))  # fmt: skip
    with pytest.raises(DataSourceError, match="row 7 has 3 labels where the first row has 2"):
        load_task(TaskArguments(task=str(ragged)))
    files = {
        "empty.jsonl": (b"", "empty.jsonl is empty; a task file needs examples"),
        "cut.jsonl": (b'{"text": "a", "label": 1}\n{"text": "b", "lab\n', "cut.jsonl line 2 is not valid JSON"),
        "latin.csv": ("text,label\ncaf\xe9,1\n".encode("latin-1"), r"latin.csv is not UTF-8 text \(byte 14, line 2\)"),
        "tags.jsonl": (b'{"text": "a", "label": [1, "x"]}\n', r"row 0 is \[1, 'x'\], not a list of 0/1"),
        "two.csv": (b"text,label\nhello,a\nworld,b\n", r"2 example\(s\) are too few to hold out 0.2 of them"),
        "constant.csv": (("text,label\n" + "".join(f"words {i},2.5\n" for i in range(40))).encode(),
                         "every score of the training split is 2.5; a regression is measured by correlations"),
    }  # fmt: skip
    for name, (content, message) in files.items():
        (tmp_path / name).write_bytes(content)
        with pytest.raises(DataSourceError, match=message):
            load_task(TaskArguments(task=str(tmp_path / name)))
    folder = tmp_path / "split"
    folder.mkdir()
    (folder / "train.csv").write_text("text,label\n" + "\n".join(rows) + "\n")
    (folder / "validation.csv").write_text("text,label\n" + "\n".join(rows[:5] + ["unseen words,a"]) + "\n")
    with caplog.at_level("WARNING"):
        load_task(TaskArguments(task=str(folder)))
    assert "5 of 6 validation row(s) repeat a training row's text" in caplog.text
    (folder / "validation.csv").rename(tmp_path / "outside.csv")
    (folder / "validation.csv").symlink_to(tmp_path / "outside.csv")  # a task folder is read inside itself only
    with pytest.raises(DataSourceError, match="validation.csv lead\\(s\\) outside .*split through a link"):
        load_task(TaskArguments(task=str(folder)))


@pytest.mark.alone
@pytest.mark.loop
def test_two_processes_agree_on_every_metric(workdir, concept_model):
    from concept_encoder.common import process_group

    task = write_tasks(workdir / "tasks")["single"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29661",
           str(ROOT / "loops/finetune.py"), "--model_name_or_path", str(concept_model), "--task", str(task),
           "--seeds", "1", "--run_name", "ddp", *COMMON]  # fmt: skip
    out = process_group.run(cmd, 300, cwd=workdir)
    assert out.returncode == 0, out.stderr[-3000:]
    [run_dir] = Path("Cache/finetune").glob("ddp-*-seed42")
    ranks = [json.loads((run_dir / "ranks" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1] and ranks[0]["best_step"] > 0
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["validation"] == ranks[0]["validation"]
    train = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    assert train and all(len(r["rss_gb_ranks"]) == 2 and r["rss_gb"] == max(r["rss_gb_ranks"]) for r in train)


def test_pretraining_flags_and_an_unnamed_resume_are_refused(concept_model):
    with pytest.raises(ValueError, match=r"does not support \['--concept_losses'\]"):
        finetune.main(["--model_name_or_path", str(concept_model), "--concept_losses", "uniformity", *COMMON])
    with pytest.raises(ValueError, match="--resume_from_checkpoint auto and the --run_name"):
        finetune.main(["--model_name_or_path", str(concept_model), "--resume_from_checkpoint", "auto", *COMMON])


@pytest.mark.loop
def test_a_model_saved_without_its_tokenizer_is_refused_and_takes_one_from_tokenizer(workdir, bert_model, tmp_path):
    import shutil

    from concept_encoder.data import DataSourceError

    bare = tmp_path / "bert-bare"  # save_pretrained of the model alone: transformers would invent a 5-token tokenizer
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(bert_model / name, bare / name)
    task = str(write_tasks(workdir / "tasks")["single"])
    argv = [
        "--model_name_or_path",
        str(bare),
        "--task",
        task,
        "--seeds",
        "1",
        "--probe",
        "--finetune",
        "false",
        *COMMON,
    ]
    with pytest.raises(DataSourceError, match="bert-bare holds no tokenizer .* pass --tokenizer <the folder"):
        finetune.main([*argv, "--run_name", "bare"])
    assert not Path("Cache/finetune/bare").exists()
    assert finetune.main([*argv, "--run_name", "bare-tok", "--tokenizer", str(bert_model)]) == 0
    with pytest.raises(DataSourceError, match="--tokenizer .*bert-bare: .* holds no tokenizer"):
        finetune.main([*argv, "--run_name", "bare-bad", "--tokenizer", str(bare)])


@pytest.mark.loop
def test_sigterm_checkpoints_and_auto_resume_continues_exactly(workdir, concept_model, monkeypatch):
    import os
    import signal

    task = str(write_tasks(workdir / "tasks")["single"])
    argv = ["--model_name_or_path", str(concept_model), "--task", task, "--seeds", "2", "--save_steps", "20", *COMMON]
    finetune.main([*argv, "--run_name", "whole"])
    whole = json.loads(sorted(Path("Cache/reports").glob("finetune_*.json"))[-1].read_text())

    real_step, calls = finetune.train_step, {"n": 0}

    def step_then_signal(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 60 + 25:  # seed 43, step 25: after its checkpoint at 20, before the next
            os.kill(os.getpid(), signal.SIGTERM)
        return real_step(*args, **kwargs)

    monkeypatch.setattr(finetune, "train_step", step_then_signal)
    assert finetune.main([*argv, "--run_name", "split"]) == 128 + signal.SIGTERM  # checkpointed, not finished
    [interrupted] = Path("Cache/finetune").glob("split-*-seed43")
    assert not (interrupted / "summary.json").exists()
    assert sorted(p.name for p in (interrupted / "checkpoints").iterdir()) == ["step_0000020", "step_0000025"]
    cut = interrupted / "checkpoints" / "step_0000025"  # its wall-clock so far, as if it had taken 10,000 s
    state = json.loads((cut / "train_state.json").read_text())
    assert state["seconds"] > 0
    threads = torch.get_num_threads()
    assert state["cpu_threads"] == [threads]  # ... and begun with one thread more
    (cut / "train_state.json").write_text(json.dumps({**state, "seconds": 10000.0, "cpu_threads": [threads + 1]}))
    write_manifest(cut)
    monkeypatch.setattr(finetune, "train_step", real_step)
    AcceleratorState._reset_state(reset_partial_state=True)
    assert finetune.main([*argv, "--run_name", "split", "--resume_from_checkpoint", "auto"]) == 0
    resumed = json.loads(sorted(Path("Cache/reports").glob("finetune_*.json"))[-1].read_text())
    for key in ("best_step", "dev", "validation"):
        assert [run[key] for run in resumed["runs"]] == [run[key] for run in whole["runs"]], key
    assert [10000 <= run["seconds"] < 10600 for run in resumed["runs"]] == [False, True]  # the cut run: both parts
    assert [run["cpu_threads"] for run in resumed["runs"]] == [threads, [threads + 1, threads]]  # each count

    def train_losses(folder):
        return [
            r["loss"]
            for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
            if r["kind"] == "train"
        ]

    [uninterrupted] = Path("Cache/finetune").glob("whole-*-seed43")
    assert train_losses(interrupted) == train_losses(uninterrupted)  # bitwise: same batches, dropout, optimizer

    # a finished run is reused only for the same task content and settings, never for another task of that name
    relabelled = workdir / "relabelled" / Path(task).name
    relabelled.parent.mkdir(exist_ok=True)
    lines = Path(task).read_text().splitlines()
    rotate = {"red": "green", "green": "blue", "blue": "red"}  # the same texts and classes, other labels
    relabelled.write_text("\n".join([lines[0], *(f"{row.rsplit(',', 1)[0]},{rotate[row.rsplit(',', 1)[1]]}"
                                                  for row in lines[1:])]) + "\n")  # fmt: skip
    for other, differs in (
        ([*argv[:3], str(relabelled), *argv[4:]], "task_sha256"),
        ([*argv, "--max_steps", "45"], "max_steps"),
    ):
        AcceleratorState._reset_state(reset_partial_state=True)
        with pytest.raises(ValueError, match=f"finished before under other settings \\({differs}: finished run"):
            finetune.main([*other, "--run_name", "split", "--resume_from_checkpoint", "auto"])
    weights = Path(concept_model) / "model.safetensors"  # the same folder now holding other weights
    original = weights.read_bytes()
    try:
        tensors = load_file(weights)
        first = sorted(tensors)[0]
        save_file({**tensors, first: tensors[first] + 0.01}, weights, metadata={"format": "pt"})
        AcceleratorState._reset_state(reset_partial_state=True)
        with pytest.raises(ValueError, match="finished before under other settings \\(model_sha256: finished run"):
            finetune.main([*argv, "--run_name", "split", "--resume_from_checkpoint", "auto"])
    finally:
        weights.write_bytes(original)


def test_zero3_is_refused_before_any_run_folder_is_written(concept_model, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(ROOT / "ds_configs/zero3.json"))
    with pytest.raises(ValueError, match="ZeRO-3 partitions"):
        finetune.main(["--model_name_or_path", str(concept_model), *COMMON])
    assert not Path("Cache/finetune").exists()


def test_a_model_given_twice_or_two_models_of_one_name_are_refused_before_training(concept_model, tmp_path,
                                                                                  monkeypatch):  # fmt: skip
    import shutil

    monkeypatch.chdir(tmp_path)
    twin = tmp_path / "elsewhere" / Path(concept_model).parent.name / Path(concept_model).name  # the same name
    shutil.copytree(concept_model, twin)
    link = tmp_path / "link"
    link.symlink_to(concept_model)  # the same folder under another name
    for others, message in ((f"{concept_model}/", "is given twice"), (str(link), "is given twice .*the same folder"),
                            (str(twin), "would share the name")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            finetune.main(["--model_name_or_path", str(concept_model), "--compare_to", others, *COMMON])
    assert not Path("Cache/finetune").exists()


@pytest.mark.loop
def test_a_failed_gate_stops_the_seed_keeps_its_best_step_and_exits_3(workdir, concept_model):
    task_file = str(write_tasks(workdir / "tasks")["single"])
    argv = ["--model_name_or_path", str(concept_model), "--task", task_file, "--seeds", "1", *COMMON]
    with pytest.raises(ValueError, match="evaluates no metric 'eval_loss'"):
        finetune.main([*argv, "--gate", "eval_loss<1"])  # a pretraining metric: not on the dev split
    assert finetune.main([*argv, "--run_name", "gated", "--gate", "accuracy>1@30"]) == 3  # fails whatever it learns
    result = json.loads(sorted(Path("Cache/finetune").glob("gated-*/summary.json"))[-1].read_text())
    assert result["stopped_by_gate"] and result["gates"][0]["step"] == 30 and result["gates"][0]["passed"] is False
    assert result["best_step"] <= 30 and "accuracy" in result["validation"]  # its best step, evaluated and saved


@pytest.mark.loop
def test_stop_at_dev_ends_the_run_at_the_first_evaluation_reaching_it_and_a_rerun_stays_stopped(workdir, concept_model):
    task_file = str(write_tasks(workdir / "tasks")["single"])
    argv = ["--model_name_or_path", str(concept_model), "--task", task_file, "--seeds", "1", *COMMON,
            "--run_name", "target", "--stop_at_dev", "0"]  # fmt: skip
    # any accuracy reaches 0: the run stops at its first evaluation, step 15
    with pytest.raises(ValueError, match="stop_at_dev=nan must be a finite number"):
        finetune.main([*argv, "--stop_at_dev", "nan"])
    assert finetune.main(argv) == 0
    [summary] = Path("Cache/finetune").glob("target-*/summary.json")
    result = json.loads(summary.read_text())
    assert (result["steps"], result["best_step"], result["stopped_at_dev"]) == (15, 15, True)  # step 15: the first
    assert not result["still_improving"]  # evaluation; a stop at the target is not "still improving"
    summary.unlink()  # as if the process died after the stop's checkpoint: the resumed run knows it had stopped
    assert finetune.main([*argv, "--resume_from_checkpoint", "auto"]) == 0  # stopped where it was, not on to 60
    metrics = [json.loads(line) for line in (summary.parent / "metrics.jsonl").read_text().splitlines()]
    assert max(m["step"] for m in metrics) == 15 and json.loads(summary.read_text())["steps"] == 15


def test_reports_of_several_invocations_merge_into_one_table(tmp_path):
    from concept_encoder.finetuning import report as finetune_report

    def run(model, method, seed, accuracy, **extra):
        return {"model": model, "method": method, "task": "t", "seed": seed, "pooling": "p", "seconds": 1.0,
                "validation": {"accuracy": accuracy}, **extra}  # fmt: skip

    tuned = dict(learning_rate=1e-4, rate_grid={"0.0001": 0.5}, best_step=10, still_improving=False, train_loss=None)
    baselines = {"t": {"majority": {"accuracy": 0.1}, "tfidf": {"name": "TF-IDF", "validation": {"accuracy": 0.7},
                                                                "parameter": "C", "chosen": 10.0}}}  # fmt: skip
    first = tmp_path / "a.json"
    first.write_text(json.dumps({"runs": [run("m", "fine-tune", 1, 0.6, **tuned), run("m", "fine-tune", 2, 0.8, **tuned)],
                                 "baselines": baselines}))  # fmt: skip
    second = tmp_path / "b.json"
    second.write_text(json.dumps({"runs": [run("m-scratch", "probe: hidden mean", 1, 0.4, probe_C=1.0)],
                                  "baselines": baselines}))  # fmt: skip
    assert finetune_report.main([str(first), str(second), "--out_dir", str(tmp_path / "out")]) == 0
    [merged] = (tmp_path / "out").glob("finetune_merged_*.json")
    rows = json.loads(merged.read_text())["rows"]
    assert [(r["model"], r["method"], r["seeds"]) for r in rows] == [("m", "fine-tune", [1, 2]),
                                                                     ("m-scratch", "probe: hidden mean", [1])]  # fmt: skip
    assert rows[0]["accuracy_mean"] == pytest.approx(0.7) and merged.with_suffix(".png").exists()
    copy = tmp_path / "copy.json"  # the same runs again (a copied report, a resumed invocation reusing its seeds)
    copy.write_text(json.dumps({**json.loads(first.read_text()), "runs": [{**r, "seconds": 9.0} for r in
                                                                          json.loads(first.read_text())["runs"]]}))  # fmt: skip
    runs, _ = finetune_report.merge_reports([first, copy])
    assert sorted(r["seed"] for r in runs) == [1, 2]  # each seed once, not four seeds with a spread of zero
    clash = tmp_path / "clash.json"  # another model under the same name, seed and method
    clash.write_text(json.dumps({"runs": [run("m", "fine-tune", 1, 0.1, **tuned)], "baselines": baselines}))
    with pytest.raises(ValueError, match=r"two different results for m \(fine-tune, seed 1\) on t"):
        finetune_report.merge_reports([first, clash])
    settings = {"model_sha256": "ab", "learning_rate": 1e-4, "max_steps": 60, "seed": 1}
    protocol = tmp_path / "protocol.json"  # the same model, seeds of two protocols: not one row's seeds
    protocol.write_text(json.dumps({"runs": [run("m", "fine-tune", 1, 0.6, settings=settings, **tuned),
                                             run("m", "fine-tune", 2, 0.8, **tuned,
                                                 settings={**settings, "seed": 2, "max_steps": 12})],
                                    "baselines": baselines}))  # fmt: skip
    with pytest.raises(ValueError, match=r"runs of m \(fine-tune\) on t were made under other settings \(max_steps"):
        finetune_report.merge_reports([protocol])
    for bad in ("{}", "[1, 2]", '"text"'):
        (tmp_path / "bad.json").write_text(bad)
        with pytest.raises(SystemExit):
            finetune_report.main([str(first), str(tmp_path / "bad.json")])
    other = tmp_path / "other.json"  # a task of the same name with other content: never pooled with the first
    other.write_text(json.dumps({"runs": [run("m", "fine-tune", 3, 0.9, **tuned)],
                                 "baselines": {"t": {**baselines["t"], "task_sha256": "feedc0de"}}}))  # fmt: skip
    first.write_text(
        json.dumps({**json.loads(first.read_text()), "baselines": {"t": {**baselines["t"], "task_sha256": "0ddba11"}}})
    )
    with pytest.raises(ValueError, match="task 't' is not one task across these reports"):
        finetune_report.merge_reports([first, other])


@pytest.mark.loop
def test_a_non_finite_loss_stops_fine_tuning_before_the_step_is_applied(workdir, concept_model, monkeypatch):
    from concept_encoder.common.faults import NonFiniteLossError

    task_file = str(write_tasks(workdir / "tasks")["single"])
    real = finetune.build_classifier

    def poisoned(*args, **kwargs):  # a head that makes the loss NaN from the first step
        model, note = real(*args, **kwargs)
        with torch.no_grad():
            model.classifier.weight.fill_(float("nan"))
        return model, note

    monkeypatch.setattr(finetune, "build_classifier", poisoned)
    argv = ["--model_name_or_path", str(concept_model), "--task", task_file, "--seeds", "1", "--run_name", "nan"]
    with pytest.raises(NonFiniteLossError, match="the fine-tuning loss was non-finite for 3 consecutive steps"):
        finetune.main([*argv, *COMMON])
    [run_dir] = Path("Cache/finetune").glob("nan-*")
    assert not (run_dir / "final").exists() and not (run_dir / "summary.json").exists()


@pytest.mark.loop
def test_an_fp16_overflow_in_fine_tuning_backs_the_loss_scale_off_and_the_run_goes_on(
    workdir, concept_model, monkeypatch, capsys
):
    made = fp16_scaler_on_cpu(monkeypatch, finetune)
    real = finetune.build_classifier

    def with_one_overflow(*args, **kwargs):
        model, note = real(*args, **kwargs)
        overflowing_once(model.classifier.weight)
        return model, note

    monkeypatch.setattr(finetune, "build_classifier", with_one_overflow)
    task_file = str(write_tasks(workdir / "tasks")["single"])
    argv = ["--model_name_or_path", str(concept_model), "--task", task_file, "--seeds", "1", "--run_name", "fp16"]
    assert finetune.main([*argv, *COMMON, "--max_steps", "4", "--eval_steps", "2"]) == 0
    assert "non-finite fine-tuning gradient norm at step 1 (update skipped)" in capsys.readouterr().out
    assert made[0].scaler.get_scale() == 2.0**15  # halved once, by the first run's overflow
    [run_dir] = Path("Cache/finetune").glob("fp16-*")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["best_step"] in (2, 4)
    weights = load_file(run_dir / "final" / "model.safetensors")
    assert all(w.dtype == torch.float32 and torch.isfinite(w).all() for w in weights.values())


def test_a_full_disk_while_writing_a_report_leaves_no_empty_or_half_report(tmp_path, monkeypatch):
    from concept_encoder.common.faults import DiskFullError
    from concept_encoder.finetuning import report as finetune_report

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(finetune_report, "plot", full)
    run = {"model": "m", "method": "probe: mean", "task": "t", "seed": 1, "pooling": "p", "seconds": 1.0,
           "validation": {"accuracy": 0.5}, "probe_C": 1.0}  # fmt: skip
    with pytest.raises(DiskFullError, match="no space left on the disk of .* while writing the report finetune_"):
        finetune_report.write_report([run], {}, tmp_path / "reports", "title")
    assert list((tmp_path / "reports").iterdir()) == []


@pytest.mark.loop
def test_a_full_disk_at_a_seeds_final_save_is_one_line_and_leaves_no_half_model(workdir, concept_model, monkeypatch):
    import transformers.modeling_utils

    from concept_encoder.common.faults import DiskFullError

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    task_file = str(write_tasks(workdir / "tasks")["single"])
    argv = ["--model_name_or_path", str(concept_model), "--task", task_file, "--seeds", "1", "--run_name", "full"]
    with pytest.raises(DiskFullError, match="no space left on the disk of .* while saving the model .*final"):
        finetune.main([*argv, *COMMON])
    [run_dir] = Path("Cache/finetune").glob("full-*")
    assert not (run_dir / "final").exists() and not list(run_dir.glob("*.partial-*"))
    assert not (run_dir / "summary.json").exists()


def test_a_seeds_final_folder_it_did_not_write_is_refused_and_left_alone(workdir, concept_model):
    task_file = str(write_tasks(workdir / "tasks")["single"])
    tag = finetune.model_tag(str(concept_model), False)
    final = Path("Cache/finetune") / f"theirs-{tag}-lr0.003-seed42" / "final"
    final.mkdir(parents=True)
    (final / "notes.txt").write_text("mine")
    argv = ["--model_name_or_path", str(concept_model), "--task", task_file, "--seeds", "1", "--run_name", "theirs"]
    with pytest.raises(ValueError, match="seed42 holds files this project did not write .*: final\\)"):
        finetune.main([*argv, *COMMON])
    assert sorted(p.name for p in final.iterdir()) == ["notes.txt"]


def test_a_rate_chosen_at_the_grids_end_is_named_in_the_report():
    from concept_encoder.finetuning.report import format_markdown, grid_edge

    def row(rate, grid):
        return {"model": "m", "method": "fine-tune", "task": "t", "pooling": "p", "metrics": ["accuracy"],
                "accuracy_mean": 0.5, "accuracy_std": 0.0, "accuracy_seeds": [0.5], "seconds": 1.0,
                "learning_rate": rate, "rate_grid": grid, "best_steps": [10], "still_improving": False,
                "train_loss": None}  # fmt: skip

    assert grid_edge(row(3e-3, {"0.001": 0.35, "0.003": 1.0})) == "highest"
    assert grid_edge(row(1e-4, {"0.0001": 0.6, "0.0003": 0.4, "0.001": 0.2})) == "lowest"
    assert grid_edge(row(3e-4, {"0.0001": 0.4, "0.0003": 0.6, "0.001": 0.2})) is None  # bracketed
    assert grid_edge(row(1e-3, {"0.001": 1.0, "0.003": 1.0})) is None  # a tie: flat there, not beyond
    assert grid_edge(row(1e-3, {"0.001": 0.9})) is None  # one rate: no grid to be at the end of
    text = format_markdown([row(3e-3, {"0.001": 0.35, "0.003": 1.0})], {}, "t")
    assert (
        "Chosen at the grid's end, the best rate may lie beyond it (extend --learning_rates): m (highest, 0.003)"
        in text
    )
    assert "grid's end" not in format_markdown([row(3e-4, {"0.0001": 0.4, "0.0003": 0.6, "0.001": 0.2})], {}, "t")
