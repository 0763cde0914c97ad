"""The MLM loop: learning, exact resume, preemption, accumulation, init order, 2 processes, arguments,
steps without a masked token, a finite blow-up, a saved model that travels without the package."""

import json
import math
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from loop_runs import (  # noqa: F401 (fixtures)
    COMMON,
    ROOT,
    fresh_accelerate,
    load_without_the_package,
    records,
    run,
    sigterm_after,
    train_losses,
    workdir,
)
from transformers import AutoModelForMaskedLM

import loops.mlm as mlm
from concept_encoder import ConceptEncoderForMaskedLM, config_from_preset
from concept_encoder.accounting.flops import mlm_training_flops
from concept_encoder.checkpoints.checkpoint import CheckpointError
from concept_encoder.common import process_group
from concept_encoder.common.metrics_log import read_metrics
from concept_encoder.training.args import parse_args


@pytest.mark.loop
def test_tiny_run_learns_and_saves_a_loadable_model():
    run("--run_name", "learn", "--max_steps", "60", "--learning_rate", "3e-3", "--lr_scheduler_type", "constant")
    losses = train_losses("learn")
    assert len(losses) == 60
    assert sum(losses[-5:]) / 5 < losses[0] - 1.0, f"loss did not fall: {losses[0]:.3f} → {losses[-5:]}"
    run_dir = Path("runs/learn")
    assert (run_dir / "loss_curve.png").stat().st_size > 0
    assert json.loads((run_dir / "config.json").read_text())["training_args"]["max_steps"] == 60
    model = AutoModelForMaskedLM.from_pretrained(run_dir / "final")
    assert isinstance(model, ConceptEncoderForMaskedLM)
    assert (run_dir / "final" / "tokenizer.json").exists()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 60 and not summary["preempted"] and math.isfinite(summary["eval_loss"])
    assert list(Path("Cache/logs").glob("mlm-*.log"))


@pytest.mark.loop
def test_sigterm_checkpoint_and_exact_resume(monkeypatch):
    args = ["--max_steps", "8", "--save_steps", "3", "--eval_steps", "4"]
    run("--run_name", "straight", *args)
    reference = train_losses("straight")

    real = sigterm_after(monkeypatch, calls=5)
    assert run("--run_name", "split", *args) == 128 + signal.SIGTERM  # checkpointed, not finished: `&&` stops here
    run_dir = Path("runs/split")
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary == {**summary, "steps": 5, "preempted": True}
    assert not (run_dir / "final").exists()
    assert (run_dir / "checkpoints" / "step_0000005" / "train_state.json").exists()
    assert not list((run_dir / "checkpoints").glob("*.tmp"))

    monkeypatch.setattr(mlm, "train_step", real)
    run("--run_name", "split", *args, "--resume_from_checkpoint", "auto")
    resumed = train_losses("split")
    assert resumed == reference  # bitwise: same batches, masks, dropout and optimizer state
    evals = [r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "eval"]
    straight_evals = [r for r in read_metrics(Path("runs/straight/metrics.jsonl")) if r["kind"] == "eval"]
    assert [e["eval_loss"] for e in evals] == [e["eval_loss"] for e in straight_evals]
    assert (run_dir / "final" / "model.safetensors").exists()
    kept = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    assert kept == ["step_0000005", "step_0000006"]  # saves at 3, 5 (signal), 6; rotation keeps the newest 2


@pytest.mark.loop
def test_streaming_run_trains_evaluates_and_resumes_exactly(monkeypatch):
    """`--streaming`: no length, no indexing, a shuffle buffer; resume still replays the same batches."""
    args = ["--max_steps", "6", "--save_steps", "3", "--streaming", "true", "--streaming_validation_documents", "30"]
    run("--run_name", "stream_straight", *args)
    reference = train_losses("stream_straight")
    assert len(reference) == 6 and records("stream_straight", "eval")[-1]["eval_masked_tokens"] > 0

    real = sigterm_after(monkeypatch, calls=4)
    run("--run_name", "stream_split", *args)
    monkeypatch.setattr(mlm, "train_step", real)
    run("--run_name", "stream_split", *args, "--resume_from_checkpoint", "auto")
    assert train_losses("stream_split") == reference
    assert AutoModelForMaskedLM.from_pretrained("runs/stream_split/final") is not None


@pytest.mark.loop
def test_train_records_carry_model_tflops_and_mfu_against_the_given_peak():
    run("--run_name", "mfu", "--max_steps", "2", "--peak_tflops", "0.5")
    config = json.loads(Path("runs/mfu/final/config.json").read_text())
    flops_per_token = mlm_training_flops(config, 1, 64, 0.15) / 64  # COMMON trains on 64-token blocks
    for record in records("mfu", "train"):
        assert record["tflops_per_s"] == pytest.approx(flops_per_token * record["tokens_per_s"] / 1e12)
        assert record["mfu"] == pytest.approx(record["tflops_per_s"] / 0.5)
    with pytest.raises(ValueError, match="peak_tflops=0.0 must be > 0"):
        parse_args(["--peak_tflops", "0"])


def test_stream_held_out_whole_is_a_clear_error():
    from concept_encoder.data import DataArguments, DataSourceError, prepare_data

    whole = ["--max_steps", "2", "--streaming", "true", "--streaming_validation_documents", "100000"]
    with pytest.raises(DataSourceError, match="tokenizer was trained on no text.*--streaming_validation_documents"):
        run("--run_name", "stream_empty", *whole, "--tokenizer", "train:wordpiece:1999")  # trained on the empty split
    prepare_data(DataArguments(tokenizer="train:wordpiece:2000", max_seq_length=64))  # this one trained (cached)
    with pytest.raises(ValueError, match="too small for one optimizer step.*--streaming_validation_documents"):
        run("--run_name", "stream_empty", *whole)


@pytest.mark.loop
def test_non_finite_loss_stops_with_the_step(monkeypatch):
    monkeypatch.setattr(
        mlm,
        "train_step",
        lambda *a, **k: {
            "loss": float("nan"),
            "labelled": 1,
            "tokens": 1,
            "grad_norm": None,
            "terms": {},
            "applied": False,
        },
    )
    with pytest.raises(mlm.NonFiniteLossError, match="3 consecutive steps, last at step 3"):
        run("--run_name", "nan", "--max_steps", "10", "--max_bad_steps", "3")


@pytest.mark.loop
def test_init_order(monkeypatch):
    calls = []
    names = [
        "setup_distributed", "setup_logging", "parse_args", "set_seed", "log_system_info", "log_data_config",
        "prepare_data", "log_dataset_sizes", "build_model", "log_model_info", "probe_attention_kernels",
        "maybe_compile", "setup_run_dirs", "save_run_config", "init_wandb", "Accelerator", "train_step",
        "save_final", "finish_distributed",
    ]  # fmt: skip
    for name in names:
        real = getattr(mlm, name)

        def recorder(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(mlm, name, recorder)
    run("--run_name", "order", "--max_steps", "2")
    first_seen = list(dict.fromkeys(calls))
    assert first_seen == names
    assert calls.count("train_step") == 2


@pytest.mark.alone
@pytest.mark.loop
@pytest.mark.parametrize("streaming", [False, True])
def test_two_process_cpu_run_ranks_agree(workdir, streaming):
    name = "ddp_stream" if streaming else "ddp"
    two_process_runs(workdir)
    ranks = [json.loads((workdir / "runs" / name / "ranks" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0] == ranks[1] and ranks[0]["eval_loss"] is not None
    record = [r for r in read_metrics(workdir / "runs" / name / "metrics.jsonl") if r["kind"] == "train"][0]
    assert record["tokens_seen"] == 2 * 8 * 64  # two ranks, each a micro-batch of 8 × 64 tokens
    config = json.loads((workdir / "runs" / name / "config.json").read_text())
    assert config["system"]["world_size"] == 2 and config["system"]["backend"] == "gloo"
    assert config["data_args"]["streaming"] is streaming


def two_process_runs(workdir: Path) -> None:
    """Two 2-process DDP runs of 4 steps (checkpoints at 2 and 4), `runs/ddp` and `runs/ddp_stream` (streamed
    data), the missing ones made one after another in the ranks of one launch (tests/one_launch_several_runs.py)."""
    streaming = {"ddp": "false", "ddp_stream": "true"}
    missing = [name for name in streaming if not (workdir / "runs" / name / "summary.json").exists()]
    if not missing:
        return
    runs = json.dumps([[name, None, ["--streaming", streaming[name]]] for name in missing])
    cmd = [
        sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
        "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29517",
        str(ROOT / "tests" / "one_launch_several_runs.py"), runs, *COMMON, "--output_dir", "runs", "--max_steps", "4",
        "--streaming_validation_documents", "30", "--save_steps", "2",
    ]  # fmt: skip
    out = process_group.run(cmd, 300, cwd=workdir)
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.alone  # reads the two-process run above, in the same worker
@pytest.mark.loop
def test_a_two_process_run_resumes_on_one_process_with_the_same_global_batch(workdir):
    checkpoint = workdir / "runs" / "ddp" / "checkpoints" / "step_0000002"
    two_process_runs(workdir)  # made by the two-process test above; launched here when this test runs alone
    with pytest.raises(CheckpointError, match=r"world_size: checkpoint 2, this run 1: .* \(2 × 8 × 1 = 16 examples a "
                       r"step\) and per-device batch 8; give --gradient_accumulation_steps 2"):  # fmt: skip
        run("--run_name", "one", "--max_steps", "4", "--resume_from_checkpoint", str(checkpoint))
    run("--run_name", "one", "--max_steps", "4", "--gradient_accumulation_steps", "2", "--save_steps", "2",
        "--resume_from_checkpoint", str(checkpoint))  # fmt: skip
    two, one = records("ddp", "train"), records("one", "train")
    assert [r["step"] for r in one] == [3, 4] and [r["tokens_seen"] for r in one] == [r["tokens_seen"] for r in two[2:]]
    # the same micro-batches in every step; rank 1's masks are now drawn by rank 0's generator, so the loss
    # follows the two-process curve to within the masking's noise, not bitwise
    assert [r["loss"] for r in one] == pytest.approx([r["loss"] for r in two[2:]], rel=0.02)
    settings = json.loads((Path("runs/one/checkpoints/step_0000004/resume_settings.json")).read_text())
    assert (settings["world_size"], settings["gradient_accumulation_steps"]) == (1, 2)


def test_yaml_config_with_cli_override(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("learning_rate: 0.002\nmax_steps: 7\npreset: tiny\nmasking: span\n")
    model_args, data_args, args = parse_args(["--config", str(path), "--max_steps", "9"])
    assert (args.learning_rate, args.max_steps, model_args.preset, data_args.masking) == (0.002, 9, "tiny", "span")
    path.write_text("learning_rat: 0.002\n")
    with pytest.raises(ValueError, match=r"unknown keys \['learning_rat'\]"):
        parse_args(["--config", str(path)])
    with pytest.raises(ValueError, match="--no_such_flag"):
        parse_args(["--no_such_flag", "1"])
    with pytest.raises(ValueError, match="preset='huge' is unknown"):
        parse_args(["--preset", "huge"])


@pytest.mark.loop
def test_concept_losses_kendall_gal_resume_exactly_and_health_is_logged():
    args = ["--max_steps", "6", "--save_steps", "3", "--eval_steps", "3"]
    args += ["--concept_losses", "orthogonality,uniformity", "--loss_weighting", "kendall_gal"]
    run("--run_name", "kg_full", *args)
    full = records("kg_full", "train")
    assert {"concept/orthogonality", "concept/uniformity", "concept/log_var/mlm"} <= set(full[0])
    log_vars = [r["concept/log_var/orthogonality"] for r in full]
    assert log_vars[0] != log_vars[-1]  # the uncertainty weights are trained

    resumed_dir = Path("runs/kg_resumed/checkpoints")
    resumed_dir.mkdir(parents=True)
    shutil.copytree(Path("runs/kg_full/checkpoints/step_0000003"), resumed_dir / "step_0000003")
    run("--run_name", "kg_resumed", *args, "--resume_from_checkpoint", "auto")
    resumed = records("kg_resumed", "train")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in full[3:]]
    assert [r["concept/log_var/orthogonality"] for r in resumed] == log_vars[3:]

    evals = records("kg_full", "eval")
    for key in (
        "effective_rank",
        "effective_rank_fraction",
        "batch_mean_effective_rank",
        "max_cosine",
        "collapsed_dims",
    ):
        assert math.isfinite(evals[-1][f"health/{key}"])
    assert 1.0 <= evals[-1]["health/effective_rank"] <= 16  # micro preset: C = 16


@pytest.mark.loop
def test_fixed_concept_weight_warms_up_linearly():
    run("--run_name", "warm", "--max_steps", "5", "--concept_losses", "vicreg", "--concept_loss_weight", "0.2",
        "--concept_loss_warmup_steps", "4")  # fmt: skip
    weights = [r["concept/weight/vicreg"] for r in records("warm", "train")]
    assert weights == pytest.approx([0.0, 0.05, 0.1, 0.15, 0.2])  # step k uses min(1, (k-1)/4) × 0.2


@pytest.mark.loop
def test_the_default_recipe_warms_its_concept_weights_up_in_the_loop():
    run("--run_name", "recipe", "--max_steps", "3")  # nothing about the concept losses given: the default recipe
    train = records("recipe", "train")
    for name in ("orthogonality", "uniformity"):  # 100 warm-up steps: step k trains with weight (k-1)/100
        assert [r[f"concept/weight/{name}"] for r in train] == pytest.approx([0.0, 0.01, 0.02])


def test_unknown_concept_loss_is_an_error_before_training():
    with pytest.raises(ValueError, match=r"unknown concept loss\(es\) \['orthogonal'\]"):
        run("--run_name", "bad_loss", "--max_steps", "2", "--concept_losses", "orthogonal")
    assert not Path("runs/bad_loss").exists()


@pytest.mark.loop
def test_health_cli_reports_and_rejects_non_finite_weights(tmp_path, capsys):
    final = Path("runs/learn/final")
    if not final.exists():
        run("--run_name", "learn", "--max_steps", "3")
    cmd = [
        sys.executable,
        "-m",
        "concept_encoder",
        "check_health",
        str(final),
        "--max_seq_length",
        "64",
        "--batches",
        "2",
    ]
    out = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, cwd=Path.cwd(), env={**os.environ, "PYTHONPATH": str(ROOT)}
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| effective_rank |" in out.stdout and "all finite" in out.stdout

    model = AutoModelForMaskedLM.from_pretrained(final)
    with torch.no_grad():
        model.encoder.concepts[0, 0] = float("nan")
    model.save_pretrained(tmp_path / "broken")
    from concept_encoder.decide import check_health  # the refusal is the tool's, not the process's: in process

    assert check_health.main([str(tmp_path / "broken"), *cmd[5:]]) == 1
    assert "encoder.concepts" in capsys.readouterr().err


@pytest.mark.loop
def test_held_out_language_check_scores_the_unigram_baseline_on_the_same_masked_positions(
    tmp_path, capsys, monkeypatch
):
    import re

    from concept_encoder.data import DataArguments, prepare_data
    from concept_encoder.decide import check_health
    from concept_encoder.training.evaluation import most_frequent_token

    final = Path("runs/learn/final")
    if not final.exists():
        run("--run_name", "learn", "--max_steps", "3")
    summary = json.loads(Path("runs/learn/summary.json").read_text())  # the loop sets every eval beside it too
    assert summary["eval_accuracy_over_unigram"] == pytest.approx(
        summary["eval_accuracy"] / summary["eval_unigram_accuracy"]
    )
    assert f"**{summary['eval_accuracy_over_unigram']:.2f}x**" in (final / "README.md").read_text()
    text = tmp_path / "other-domain.txt"  # English of another domain than the pretraining corpus
    text.write_text("\n\n".join(f"The river {i} runs past the old mill and the farm by the hill." for i in range(80)))
    from concept_encoder.training import evaluation

    grad_modes = []
    health = evaluation.concept_health
    monkeypatch.setattr(evaluation, "concept_health", lambda c: grad_modes.append(torch.is_grad_enabled()) or health(c))
    assert check_health.main([str(final), "--text", str(text), "--max_seq_length", "64", "--batch_size", "8"]) == 0
    assert grad_modes and not any(grad_modes)  # evaluation builds no autograd graph (it once grew without bound)
    out = capsys.readouterr().out
    found = re.search(r"accuracy ([\d.]+) against ([\d.]+) for always guessing '(.+)' on the same ([\d,]+) masked "
                      r"tokens: ([\d.]+)x", out)  # fmt: skip
    accuracy, unigram, token, masked, ratio = found.groups()
    # recount the baseline by hand on the same masks: every block of the file, the collator from its start state
    data = prepare_data(DataArguments(dataset=str(text), tokenizer=str(final), max_seq_length=64), cache_dir="Cache",
                        seed=0, held_out=True)  # fmt: skip
    blocks = data.validation
    assert data.train is None  # the whole file is one split, however short
    most = most_frequent_token(blocks, data.tokenizer)
    assert data.tokenizer.convert_ids_to_tokens(most) == token
    hits = total = 0
    for start in range(0, len(blocks), 8):
        labels = data.collator.mask(
            data.collator.collate([blocks[i] for i in range(start, min(start + 8, len(blocks)))])
        )
        chosen = labels["labels"][labels["labels"] != -100]
        hits, total = hits + int((chosen == most).sum()), total + chosen.numel()
    assert total == int(masked.replace(",", "")) and float(unigram) == pytest.approx(hits / total, abs=1e-4)
    one = tmp_path / "one-document.txt"  # a text of one document is read whole too, not split
    one.write_text(" ".join(f"The river {i} runs past the old mill." for i in range(60)))
    assert check_health.main([str(final), "--text", str(one), "--max_seq_length", "64", "--batch_size", "8"]) == 0
    assert float(ratio) == pytest.approx(float(accuracy) / float(unigram), abs=0.01)


RSS_AFTER_FREE = """
import psutil, torch
from concept_encoder.training.runtime import retain_freed_cpu_memory
enabled = retain_freed_cpu_memory()
before = psutil.Process().memory_info().rss
x = torch.ones(64 * 2**20)  # 256 MiB, touched
del x
print(enabled, (psutil.Process().memory_info().rss - before) / 2**20)
"""


@pytest.mark.parametrize("opt_out", [False, True])
def test_cpu_runs_keep_freed_tensor_memory_for_reuse_unless_opted_out(opt_out):
    env = {**os.environ, "CPU_RETAIN_FREED_MEMORY": "0" if opt_out else "1"}
    out = subprocess.run([sys.executable, "-c", RSS_AFTER_FREE], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    enabled, kept_mib = out.stdout.split()
    assert enabled == str(not opt_out)
    if opt_out:
        assert float(kept_mib) < 64  # glibc unmapped the freed 256 MiB
    else:
        assert float(kept_mib) > 192  # kept in the heap, so the next step reuses it without page faults


def test_without_offload_the_loop_steps_torchs_fused_adamw():
    from concept_encoder.training.deepspeed_setup import adamw_class
    from concept_encoder.training.optim import build_optimizer

    model = ConceptEncoderForMaskedLM(config_from_preset("micro", vocab_size=100))
    _, _, args = parse_args([])
    optimizer = build_optimizer(model, args, adamw=adamw_class(Accelerator()))
    assert isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults["fused"] is True


@pytest.mark.loop
def test_steps_without_a_masked_token_are_warned_about_and_never_logged_as_loss_0(workdir, capsys):
    os.chdir(workdir)
    run("--run_name", "sparse", "--max_steps", "4", "--mlm_probability", "0.0005", "--concept_losses", "none")
    out = capsys.readouterr()
    assert "about 78.0% of micro-batches will have no masked token" in out.out + out.err  # (1 - 0.0005) ** (8 * 62)
    losses = train_losses("sparse")
    summary = json.loads(Path("runs/sparse/summary.json").read_text())
    empty = summary["steps_without_masked_tokens"]
    assert empty >= 1 and losses.count(None) == empty and 0.0 not in losses  # no number: null, valid JSON


@pytest.mark.loop
def test_a_finite_blow_up_is_warned_about_and_recorded(capsys):
    run("--run_name", "blowup", "--max_steps", "30", "--learning_rate", "1.0", "--lr_scheduler_type", "constant",
        "--warmup_ratio", "0", "--max_grad_norm", "0")  # fmt: skip
    losses = train_losses("blowup")
    summary = json.loads(Path("runs/blowup/summary.json").read_text())
    assert max(losses) > 2 * min(losses), losses  # the run did blow up
    assert summary["divergence"]["loss"] > 1.5 * summary["divergence"]["running_min"]
    assert "the loss diverges" in capsys.readouterr().out


@pytest.mark.loop
def test_final_model_loads_without_the_package_and_carries_a_model_card(tmp_path):
    import torch

    from concept_encoder import ConceptEncoderForMaskedLM

    run("--run_name", "travel", "--max_steps", "3", "--eval_steps", "3")
    final = Path("runs/travel/final").resolve()
    assert {"config.py", "heads.py", "modeling.py", "attention.py", "README.md"} <= {p.name for p in final.iterdir()}
    _, module, remote_sum = load_without_the_package(final, tmp_path, trust_remote_code=True)
    local = ConceptEncoderForMaskedLM.from_pretrained(final).eval()
    with torch.no_grad():
        local_sum = float(local(input_ids=torch.arange(5, 21)[None]).logits.double().sum())
    assert module.startswith("transformers_modules") and remote_sum == pytest.approx(local_sum, rel=1e-6)
    card = (final / "README.md").read_text()
    summary = json.loads(Path("runs/travel/summary.json").read_text())
    assert "library_name: transformers" in card and "3 optimizer steps" in card
    assert f"{summary['eval_loss']:.4f}" in card and "| effective_rank |" in card
    assert "accelerate launch loops/mlm.py" in card and "--run_name travel" in card
    assert "| concept losses | orthogonality, uniformity (weight 1.0, warmed up over 100 steps) |" in card  # the recipe


@pytest.mark.loop
def test_a_tokenizer_that_leaves_nothing_to_mask_is_refused_before_the_model(workdir, monkeypatch):
    """A fixed vocabulary (the ListOps symbols) read over English text: every word is [UNK], no step would have a
    masked token, and the old loop trained to the end with a NaN loss at every step."""
    corpus = workdir / "english"
    corpus.mkdir(exist_ok=True)
    (corpus / "a.txt").write_text("\n\n".join(f"plain english words in paragraph {i} " * 8 for i in range(40)))
    monkeypatch.setattr(mlm, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(ValueError, match=r"reads \d+% of the data's tokens as \[UNK\]") as error:
        run("--run_name", "unmaskable", "--max_steps", "2", "--dataset", str(corpus), "--tokenizer", "listops")
    assert "\n" not in str(error.value)
