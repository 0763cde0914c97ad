"""The attention-kernel probe (training/attention_probe.py) describes the run: the compute dtype of its
--mixed_precision, a batch of two rows that is padded when the run pads, and PyTorch's SDPA backends (cuDNN among
them) in PyTorch's order; what it does not model it says in one line instead of failing."""

import logging
from types import SimpleNamespace

import pytest
import torch
from token_encoders import tiny_config
from torch.nn.attention import SDPBackend
from transformers import AutoModel, ElectraConfig

from concept_encoder import config_from_preset
from concept_encoder.training.attention_probe import (
    SDPA_BACKENDS,
    attention_calls,
    compute_dtype,
    examples_of_two_lengths,
    probe_attention_kernels,
    probe_rows,
    sdpa_priority,
)

CPU = SimpleNamespace(is_main_process=True, device=torch.device("cpu"))  # what the probe reads of accelerate's state


def padded_batch(*lengths: int) -> dict[str, torch.Tensor]:
    """Rows of `lengths` real tokens, padded to the longest, as the loops' collators pad."""
    mask = torch.tensor([[1] * n + [0] * (max(lengths) - n) for n in lengths])
    return {"input_ids": torch.randint(5, 100, mask.shape) * mask, "attention_mask": mask}


def kernel_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("attention kernels")]


@pytest.mark.parametrize(
    ("precision", "launched", "dtype"),
    [("bf16", None, torch.bfloat16), ("fp16", None, torch.float16), ("no", "bf16", torch.float32),
     (None, "bf16", torch.bfloat16), (None, "fp16", torch.float16), (None, None, torch.float32)],
)  # fmt: skip
def test_the_compute_dtype_is_the_runs_mixed_precision_else_the_launchs(precision, launched, dtype, monkeypatch):
    if launched:
        monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", launched)  # what `accelerate launch` passes on
    else:
        monkeypatch.delenv("ACCELERATE_MIXED_PRECISION", raising=False)
    assert compute_dtype(precision) is dtype
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    with pytest.raises(ValueError, match="mixed precision 'fp8' \\(--mixed_precision or the launch config\\): use no"):
        compute_dtype(None)


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_the_probe_runs_the_runs_dtype_on_a_padded_batch_and_names_both(precision, caplog):
    config, batch = config_from_preset("micro", vocab_size=100), padded_batch(20, 12, 7)
    before = torch.get_rng_state()
    with caplog.at_level(logging.INFO, logger="concept_encoder"):
        verdict = probe_attention_kernels(config, batch, CPU, compute_dtype(precision))
    assert torch.equal(torch.get_rng_state(), before)  # the run's random stream is left as it was
    name = {"no": "fp32", "bf16": "bf16"}[precision]
    assert verdict["dtype"] == name and verdict["padded"] is True and verdict["dropout"] == 0.0
    order = sdpa_priority()
    assert set(order) == {"flash", "memory_efficient", "math", "cudnn"}
    assert [key for key in verdict if key in order] == order  # every backend, cuDNN too, in PyTorch's order
    assert verdict["math"] and not verdict["memory_efficient"] and not verdict["cudnn"]  # those two are CUDA kernels
    assert verdict["chosen"] == next(backend for backend in order if verdict[backend])
    [line] = kernel_lines(caplog)
    assert f"({name}, padded batch of 2 rows" in line and "concepts ← tokens 16×20" in line
    assert "cudnn=no" in line and line.endswith(f"PyTorch will use {verdict['chosen']}")


@pytest.mark.parametrize("kind", ["bert", "roberta", "distilbert"])
def test_token_encoders_are_probed_with_their_own_heads_and_attention_dropout(kind, caplog):
    config = AutoModel.from_config(tiny_config(kind, vocab_size=100)).config  # as the loop has it: sdpa
    assert attention_calls(config, 20) == [("tokens ← tokens", 20, 20, True)]
    with caplog.at_level(logging.INFO, logger="concept_encoder"):
        verdict = probe_attention_kernels(config, padded_batch(20, 9), CPU, torch.bfloat16, decoder=False)
    assert verdict["dtype"] == "bf16" and verdict["dropout"] == 0.1 and verdict["math"]
    [line] = kernel_lines(caplog)
    assert "(bf16, padded batch of 2 rows, attention dropout 0.1, with gradients; tokens ← tokens 20×20)" in line


@pytest.mark.parametrize("kind", ["concept_encoder", "roberta"])
def test_each_call_gets_the_kernel_torchs_own_dispatcher_picks_for_it(kind):
    if kind == "concept_encoder":
        config = config_from_preset("micro", vocab_size=100)  # no attention dropout: flash on the CPU
    else:
        config = AutoModel.from_config(tiny_config(kind, vocab_size=100)).config  # dropout 0.1: not flash on the CPU
    batch = padded_batch(20, 9)
    verdict = probe_attention_kernels(config, batch, CPU, torch.bfloat16)
    mask, head_dim = batch["attention_mask"].bool()[:, None, None, :], config.hidden_size // config.num_attention_heads
    for what, queries, keys, masked in attention_calls(config, 20):
        q, k, v = (torch.randn(2, n, config.num_attention_heads, head_dim, dtype=torch.bfloat16, requires_grad=True)
                   .transpose(1, 2) for n in (queries, keys, keys))  # fmt: skip
        dispatched = torch._fused_sdp_choice(q, k, v, attn_mask=mask if masked else None, dropout_p=verdict["dropout"])
        assert verdict["calls"][what] == SDPA_BACKENDS[SDPBackend(dispatched)], what


def test_what_the_probe_does_not_model_it_says_in_one_line_and_probes_nothing(caplog):
    mpnet = AutoModel.from_config(tiny_config("mpnet", vocab_size=100)).config  # eager attention, not SDPA
    electra = ElectraConfig(hidden_size=32, num_attention_heads=2, num_hidden_layers=1, intermediate_size=64)
    with caplog.at_level(logging.INFO, logger="concept_encoder"):
        verdicts = [probe_attention_kernels(c, padded_batch(8, 5), CPU, torch.float32) for c in (mpnet, electra)]
    assert all(v["dtype"] == "fp32" and v["chosen"] is None for v in verdicts)
    assert "attn_implementation='eager' (its own matmuls), not torch's SDPA" in verdicts[0]["not_probed"]
    assert "the attention calls of model_type 'electra' are not modelled" in verdicts[1]["not_probed"]
    assert kernel_lines(caplog) == [f"attention kernels: not probed: {v['not_probed']}" for v in verdicts]


def test_the_probe_batch_is_padded_when_the_runs_batches_are():
    same = [{"input_ids": [1] * 8} for _ in range(3)]
    assert examples_of_two_lengths(iter(same)) == same[:2]  # packed blocks: one length, as the run's batches
    mixed = [*same, {"input_ids": [1] * 5}]
    assert examples_of_two_lengths(iter(mixed)) == [mixed[0], mixed[3]]
    assert examples_of_two_lengths(iter(mixed), look=3) == same[:2] and examples_of_two_lengths(same[:1]) == same[:1]
    ids, mask = probe_rows(padded_batch(12, 20, 7, 20))  # the shortest row and the longest
    assert ids.shape == (2, 20) and mask.sum(dim=1).tolist() == [7, 20]
