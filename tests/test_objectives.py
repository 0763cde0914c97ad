"""Objectives beside MLM (masked diffusion, TSDAE) and the BERT baseline, in the library and the loop."""

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from loop_runs import (  # noqa: F401 (fixtures)
    ROOT,
    fresh_accelerate,
    load_without_the_package,
    records,
    run,
    train_losses,
    workdir,
)
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import loops.mlm as mlm
from concept_encoder import ConceptEncoderForMaskedLM, config_from_preset
from concept_encoder.constants import LOSS_NORMALIZER
from concept_encoder.data.objectives import MaskedDiffusion, TokenDeletion, model_inputs
from concept_encoder.model import vocab_projection
from concept_encoder.model.constants import IGNORE_INDEX
from concept_encoder.model.vocab_projection import linear_cross_entropy
from concept_encoder.training.args import parse_args

PAD, CLS, SEP, MASK = 0, 2, 3, 4


class Tokens:
    """The part of a tokenizer the corruptions read."""

    pad_token_id, mask_token_id, all_special_ids = PAD, MASK, [PAD, 1, CLS, SEP, MASK]


def padded_batch(rows: int, length: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """`[CLS] tokens [SEP] pad...`: row i has `length - 3 * i` real tokens (ids >= 10)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 500, (rows, length), generator=g)
    mask = torch.zeros_like(ids)
    for i in range(rows):
        n = max(length - 3 * i, 4)
        ids[i, 0], ids[i, n - 1], ids[i, n:] = CLS, SEP, PAD
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask}


# ---------------------------------------------------------------- masked diffusion


def test_diffusion_masks_each_sample_at_its_own_rate():
    batch = padded_batch(64, 600)
    out = MaskedDiffusion(Tokens(), t_min=0.1, seed=0).mask(batch)
    eligible = batch["attention_mask"].bool() & (batch["input_ids"] >= 10)
    masked = out["labels"] != IGNORE_INDEX
    assert not (masked & ~eligible).any()  # never a special or pad token
    assert torch.equal(out["input_ids"][masked], torch.full((int(masked.sum()),), MASK))  # always [MASK]
    assert torch.equal(out["labels"][masked], batch["input_ids"][masked])
    rate = out["rate"]
    assert ((rate >= 0.1) & (rate <= 1.0)).all() and rate.max() - rate.min() > 0.5  # spread over [t_min, 1]
    fraction = masked.sum(1) / eligible.sum(1)  # [B]
    n = eligible.sum(1).float()
    z = (fraction - rate) / torch.sqrt(rate * (1 - rate) / n).clamp(min=1e-3)  # binomial z-score per sample
    assert z.abs().max() < 4.5, z  # each sample follows its own t (64 tests at ~1e-5 each)
    assert torch.corrcoef(torch.stack([fraction, rate]))[0, 1] > 0.99


def test_diffusion_elbo_weights_are_one_over_t_and_the_loss_uses_them():
    batch = padded_batch(4, 40)
    out = MaskedDiffusion(Tokens(), t_min=0.2, seed=1).mask(batch)
    masked = out["labels"] != IGNORE_INDEX
    expected = (1 / out["rate"])[:, None].expand_as(masked) * masked
    torch.testing.assert_close(out["label_weights"], expected)
    eligible = batch["attention_mask"].bool() & (batch["input_ids"] >= 10)
    assert out[LOSS_NORMALIZER] == eligible.sum()  # ELBO per token: divided by the eligible tokens

    model = ConceptEncoderForMaskedLM(config_from_preset("micro", vocab_size=500)).eval()
    inputs, normalizer, tokens = model_inputs(out)
    assert tokens == batch["attention_mask"].sum() and normalizer == eligible.sum()
    with torch.no_grad():
        dense = model(**inputs)  # logits at the labelled positions, row-major
        fused = model(**inputs, return_logits=False)
    ce = F.cross_entropy(dense.logits, out["labels"][masked], reduction="none")
    by_hand = (ce / out["rate"][masked.nonzero()[:, 0]]).sum()
    torch.testing.assert_close(dense.loss_sum, by_hand)
    torch.testing.assert_close(fused.loss_sum, by_hand)

    plain = MaskedDiffusion(Tokens(), t_min=0.2, weighting="none", seed=1).mask(batch)
    assert "label_weights" not in plain and model_inputs(plain)[1] == masked.sum()


@pytest.mark.loop
def test_diffusion_resumes_exactly():
    args = ["--objective", "diffusion", "--max_steps", "6", "--save_steps", "3", "--eval_steps", "3"]
    run("--run_name", "diff_full", *args)
    full = records("diff_full", "train")
    resumed_dir = Path("runs/diff_resumed/checkpoints")
    resumed_dir.mkdir(parents=True)
    shutil.copytree(Path("runs/diff_full/checkpoints/step_0000003"), resumed_dir / "step_0000003")
    run("--run_name", "diff_resumed", *args, "--resume_from_checkpoint", "auto")
    assert train_losses("diff_resumed") == [r["loss"] for r in full[3:]]  # bitwise: same rates, masks, dropout
    evals = records("diff_full", "eval")
    assert {"eval_loss_t0.15", "eval_loss_t0.50", "eval_loss_t0.90", "eval_accuracy_t0.50"} <= set(evals[-1])
    assert records("diff_resumed", "eval")[-1]["eval_loss_t0.50"] == evals[-1]["eval_loss_t0.50"]


# ---------------------------------------------------------------- TSDAE


def test_tsdae_deletes_from_the_encoder_and_targets_every_token():
    batch = padded_batch(6, 50)
    out = TokenDeletion(Tokens(), deletion_rate=0.6, seed=0).mask(batch)
    real = batch["attention_mask"].bool()
    eligible = real & (batch["input_ids"] >= 10)
    assert torch.equal(out["labels"], torch.where(real, batch["input_ids"], IGNORE_INDEX))  # every non-pad token
    assert torch.equal(out["deleted"].sum(1), torch.round(0.6 * eligible.sum(1)).long())
    assert not (out["deleted"] & ~eligible).any()  # [CLS], [SEP] and pads stay
    for row in range(6):  # the encoder sees the kept tokens, in order, closed up, and nothing else
        kept = batch["input_ids"][row][real[row] & ~out["deleted"][row]]
        seen = out["input_ids"][row][out["attention_mask"][row].bool()]
        assert torch.equal(seen, kept) and MASK not in seen.tolist()
    assert out["input_ids"].shape[1] == int((real & ~out["deleted"]).sum(1).max())


def test_tsdae_deleted_tokens_are_invisible_to_the_encoder():
    torch.manual_seed(0)
    model = ConceptEncoderForMaskedLM(config_from_preset("micro", vocab_size=500, decoder_type="posonly")).eval()
    batch = padded_batch(3, 40)
    first = TokenDeletion(Tokens(), seed=7).mask(batch)
    changed = {**batch, "input_ids": batch["input_ids"].clone()}
    changed["input_ids"][first["deleted"]] = 499  # other tokens where the deleted ones were
    second = TokenDeletion(Tokens(), seed=7).mask(changed)
    assert not torch.equal(first["labels"], second["labels"])  # the targets did change
    with torch.no_grad():
        a = model(**model_inputs(first)[0])
        b = model(**model_inputs(second)[0])
    assert torch.equal(a.concepts, b.concepts)
    assert a.num_labelled == batch["attention_mask"].sum()  # every non-pad position decoded


@pytest.mark.loop
def test_tsdae_run_with_concept_losses_logs_terms_health_and_reconstruction():
    run("--run_name", "tsdae_run", "--objective", "tsdae", "--concept_losses", "orthogonality", "--max_steps", "3",
        "--eval_steps", "3")  # fmt: skip
    train, evals = records("tsdae_run", "train"), records("tsdae_run", "eval")
    assert all("concept/orthogonality" in r and math.isfinite(r["loss"]) for r in train)
    assert train[-1]["tokens_seen"] == 3 * 8 * 64  # the budget counts original tokens, not the kept ones
    assert {"eval_loss", "eval_accuracy", "health/effective_rank", "eval_loss_tsdae"} <= set(evals[-1])
    config = json.loads(Path("runs/tsdae_run/final/config.json").read_text())
    assert config["decoder_type"] == "posonly"


class PeakTensorBytes(TorchDispatchMode):
    """Peak bytes of the tensors created inside the mode and still alive (storages tracked by weak reference)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in self.live or self.live[key][0].expired():
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


def loss_peak_bytes(vocab: int, rows: int, hidden: int = 16) -> int:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(rows, hidden, generator=g, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=g, requires_grad=True)
    b = torch.zeros(vocab, requires_grad=True)
    t = torch.randint(0, vocab, (rows,), generator=g)
    with PeakTensorBytes() as meter:
        linear_cross_entropy(h, w, b, t).backward()
    return meter.peak


def test_dense_loss_memory_is_bounded_by_the_chunk_not_vocab_times_positions(monkeypatch):
    chunk = 2**17
    monkeypatch.setattr(vocab_projection, "VOCAB_CHUNK_ELEMENTS", chunk)
    rows, hidden = 1024, 16  # TSDAE-like: every position of 8 × 128 tokens is a target
    small, large = loss_peak_bytes(1000, rows, hidden), loss_peak_bytes(8000, rows, hidden)
    # Growth allowed: the kept gradients of the larger vocabulary ([V,H] weight, [V] bias, float32 and
    # the returned copies) and one working chunk; a kept [L,V] would add 4·1024·7000 bytes = 29 MB.
    allowed = 3 * 4 * (8000 - 1000) * (hidden + 1) + 2 * 4 * chunk
    assert large - small <= allowed, (small, large, allowed)
    assert large < 4 * rows * 8000 / 10


# ---------------------------------------------------------------- all objectives


def merged(batches: list[dict]) -> dict:
    """One batch holding `batches` (each `[B,N]` entry right-padded to the widest; normalisers summed)."""
    out = {}
    for key in batches[0]:
        parts = [b[key] for b in batches]
        if parts[0].dim() == 0:
            out[key] = torch.stack(parts).sum()
            continue
        width = max(p.shape[1] for p in parts)
        fill = IGNORE_INDEX if key == "labels" else 0
        out[key] = torch.cat([F.pad(p, (0, width - p.shape[1]), value=fill) for p in parts])
    return out


@pytest.mark.parametrize("objective", ["mlm", "diffusion", "tsdae"])
def test_accumulation_gives_the_gradient_of_one_big_batch(objective):
    """The step's loss is token-normalised over the whole window: two unequal micro-batches accumulated
    update the model exactly as one batch holding both (a mean of per-batch means would not)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import GradientAccumulationPlugin

    torch.manual_seed(0)
    decoder = "posonly" if objective == "tsdae" else "perceiver"
    config = config_from_preset("micro", vocab_size=500, hidden_dropout_prob=0.0, decoder_type=decoder)
    base = ConceptEncoderForMaskedLM(config)
    corrupt = {
        "diffusion": lambda seed: MaskedDiffusion(Tokens(), t_min=0.1, seed=seed).mask,
        "tsdae": lambda seed: TokenDeletion(Tokens(), seed=seed).mask,
    }
    if objective == "mlm":  # masked-token labels at very different rates per batch
        batches = []
        for i, rate in enumerate((0.05, 0.4)):
            batch = padded_batch(3 + i, 30, seed=i)
            chosen = (torch.rand(batch["input_ids"].shape) < rate) & batch["attention_mask"].bool()
            chosen[:, 1] = True
            batches.append({**batch, "labels": torch.where(chosen, batch["input_ids"], IGNORE_INDEX)})
    else:
        batches = [corrupt[objective](i)(padded_batch(3 + i, 30 - 10 * i, seed=i)) for i in range(2)]
    batches = [{k: v for k, v in b.items() if k not in ("rate", "deleted")} for b in batches]
    results = []
    for window, accumulation in (([merged(batches)], 1), (batches, 2)):
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
        accelerator = Accelerator(
            gradient_accumulation_plugin=GradientAccumulationPlugin(num_steps=accumulation, sync_with_dataloader=False)
        )
        model = ConceptEncoderForMaskedLM(config)
        model.load_state_dict(base.state_dict())
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
        model, optimizer = accelerator.prepare(model, optimizer)
        step = mlm.train_step(accelerator, model, optimizer, window, max_grad_norm=0.0)
        results.append((step, [p.detach().clone() for p in model.parameters()]))
    (one, params_one), (two, params_two) = results
    assert one["labelled"] == two["labelled"] and one["tokens"] == two["tokens"]
    assert abs(one["loss"] - two["loss"]) < 1e-5
    for a, b in zip(params_one, params_two, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- BERT baseline


def recorded_windows(monkeypatch, *args: str) -> list[dict]:
    seen = []
    real = mlm.train_step

    def record(accelerator, model, optimizer, window, *rest, **kwargs):
        seen.append([{k: v.clone() for k, v in b.items() if k in ("input_ids", "labels")} for b in window])
        return real(accelerator, model, optimizer, window, *rest, **kwargs)

    monkeypatch.setattr(mlm, "train_step", record)
    run(*args)
    monkeypatch.setattr(mlm, "train_step", real)
    return seen


@pytest.mark.loop
def test_bert_sees_the_concept_runs_batches_and_masks_and_learns(monkeypatch):
    concept = recorded_windows(monkeypatch, "--run_name", "twin_concept", "--max_steps", "3")
    bert = recorded_windows(
        monkeypatch, "--run_name", "twin_bert", "--architecture", "bert", "--max_steps", "12",
        "--learning_rate", "3e-3", "--warmup_ratio", "0", "--eval_steps", "12",
    )  # fmt: skip
    for a, b in zip(concept, bert[:3], strict=True):  # the first steps: same batches, same masked positions
        for x, y in zip(a, b, strict=True):
            assert torch.equal(x["labels"], y["labels"]) and torch.equal(x["input_ids"], y["input_ids"])
    losses = train_losses("twin_bert")
    assert sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
    summary = json.loads(Path("runs/twin_bert/summary.json").read_text())
    assert summary["export_max_abs_diff"] == 0.0 and not any(k.startswith("health/") for k in summary)
    config = json.loads(Path("runs/twin_bert/final/config.json").read_text())
    assert config["model_type"] == "bert" and config["architectures"] == ["BertForMaskedLM"]
    assert config["hidden_size"] == 64 and config["num_hidden_layers"] == 2 and config["intermediate_size"] == 128


@pytest.mark.loop
def test_bert_final_model_loads_with_transformers_alone(tmp_path):
    from transformers import BertForMaskedLM

    run("--run_name", "bert_travel", "--architecture", "bert", "--max_steps", "2")
    final = Path("runs/bert_travel/final").resolve()
    name, module, remote_sum = load_without_the_package(final, tmp_path, trust_remote_code=False)
    local = BertForMaskedLM.from_pretrained(final).eval()
    with torch.no_grad():
        local_sum = float(local(input_ids=torch.arange(5, 21)[None]).logits.double().sum())
    assert name == "BertForMaskedLM" and module.startswith("transformers.")
    assert remote_sum == pytest.approx(local_sum, rel=1e-6)
    assert "BertForMaskedLM" in (final / "README.md").read_text()


# ---------------------------------------------------------------- bad combinations


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--objective", "tsdae", "--decoder_type", "perceiver"], "--decoder_type posonly"),
        (["--t_min", "0"], "t_min=0.0 must be in (0, 1)"),
        (["--deletion_rate", "1"], "deletion_rate=1.0 must be in [0, 1)"),
        (["--objective", "bert"], "objective='bert' is unknown"),
        (["--architecture", "bert", "--objective", "tsdae"], "use --objective mlm or diffusion with bert"),
        (["--architecture", "bert", "--concept_losses", "uniformity"], "bert has none: drop --concept_losses"),
        (["--architecture", "bert", "--concept_num", "8"], "--concept_num and --token_kv_sharing apply to"),
        (["--token_kv_sharing", "groups:9"], "use none, all, or groups:K with 1 <= K <= num_hidden_layers"),
        (["--diffusion_weighting", "sqrt"], "diffusion_weighting='sqrt'"),
    ],
)
def test_bad_combinations_are_one_clear_error_in_the_loop_and_the_plan_checker(argv, message):
    with pytest.raises(ValueError) as error:
        parse_args(argv)
    assert message in str(error.value)
    out = subprocess.run(
        [sys.executable, str(ROOT / "launch/check_plan.py"), "--profile", "cpu", *argv],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and message in out.stderr + out.stdout


def test_decoder_defaults_to_posonly_for_tsdae_only():
    assert parse_args(["--objective", "tsdae"])[0].decoder_type == "posonly"
    assert parse_args([])[0].decoder_type == "perceiver"
    assert parse_args(["--objective", "tsdae", "--decoder_type", "weighted"])[0].decoder_type == "weighted"


def test_plan_checker_estimates_bert_and_dense_objectives():
    from concept_encoder.accounting import memory

    def peak(*argv):
        out = subprocess.run(
            [sys.executable, str(ROOT / "launch/check_plan.py"), "--profile", "rtx3080_10gb", "--json", *argv],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        return json.loads(out.stdout)["estimate"]["gpu_peak_gib"]

    mlm_peak, bert_peak, tsdae_peak = peak(), peak("--architecture", "bert"), peak("--objective", "tsdae")
    assert bert_peak != mlm_peak and tsdae_peak > mlm_peak  # tsdae decodes every position
    shape = {"model_type": "bert", "hidden_size": 1536, "num_hidden_layers": 24, "intermediate_size": 4096,
             "vocab_size": 8000, "max_position_embeddings": 2048, "num_attention_heads": 16}  # fmt: skip
    assert memory.model_parameter_count(shape)["total"] == memory.bert_parameter_count(**shape)["total"]
    assert math.isfinite(bert_peak)
