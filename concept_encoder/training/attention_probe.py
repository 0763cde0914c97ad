"""Step 8 of the init order: which of PyTorch's attention kernels (SDPA backends) can serve the run's attention,
probed before training, so that a first GPU run's log says which kernel it will train with.

The probe runs every attention call of one training forward of the model (`attention_calls`) with the model's
head count and head size, the lengths and padding mask of a real batch (`probe_rows`), the run's compute dtype
(`compute_dtype`), the model's attention dropout, and gradients (training has constraints of its own: on sm86/sm89
GPUs flash trains no head size from 193 to 224, nor to 256 with dropout), on random queries, keys and values laid
out as the models' projections lay them out ([B,L,h,d] viewed as [B,h,L,d]), one backend at a time under
`sdpa_kernel([backend])`. A backend that cannot serve a call raises and is reported unavailable; PyTorch uses the
first available in its own priority order (`sdpa_priority`). Probing calls rather than the model keeps the model
where it is: a ZeRO-3 model stays partitioned, and a model larger than the GPU is never moved onto it.

What it cannot tell (docs/troubleshooting.md): a kernel's speed, what torch.compile's generated code chooses,
the choice for lengths, masks or batches it did not probe (evaluation, without gradients or dropout, may choose
another), and anything of attention computed outside SDPA (MPNet's eager matmuls, or an architecture it does not
model: it says so in one line and probes nothing).
"""

from __future__ import annotations

import itertools
import logging
import warnings
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from accelerate import PartialState
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..accounting.architectures import CONCEPT_MODEL_TYPE, TOKEN_ENCODERS, unmodelled
from .preflight import effective_precision

logger = logging.getLogger("concept_encoder")
COMPUTE_DTYPES = {"no": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # --mixed_precision → dtype
DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
SDPA_BACKENDS = {SDPBackend.FLASH_ATTENTION: "flash", SDPBackend.EFFICIENT_ATTENTION: "memory_efficient",
                 SDPBackend.MATH: "math", SDPBackend.CUDNN_ATTENTION: "cudnn"}  # fmt: skip


def compute_dtype(mixed_precision: str | None) -> torch.dtype:
    """The dtype the run's attention computes in: `--mixed_precision` (None: the launch's, `effective_precision`)
    bf16 → bfloat16, fp16 → float16, no → float32. Autocast (accelerate) and DeepSpeed's bf16/fp16 (the module cast
    to 16 bits) both hand SDPA its queries, keys and values in this dtype, on the CPU too (CPU autocast runs the
    linear layers in bf16), so the probe tests this dtype on every device."""
    precision = effective_precision(mixed_precision)
    if precision not in COMPUTE_DTYPES:
        raise ValueError(
            f"mixed precision {precision!r} (--mixed_precision or the launch config): use no, bf16 or fp16"
        )
    return COMPUTE_DTYPES[precision]


def attention_calls(config, seq_len: int, decoder: bool = True) -> list[tuple[str, int, int, bool]] | None:
    """The SDPA calls one training forward of a model with `config` makes on `seq_len` tokens, as (what, queries,
    keys, masked by padding): a Concept Encoder's concepts reading the tokens and each other, and with `decoder` the
    MLM decoder's masked positions (15%) reading the concepts; a token encoder's tokens reading each other
    (`architectures.TOKEN_ENCODERS`, sizes read through transformers' own names), or no call at all when its
    `attn_implementation` is not sdpa (MPNet's is eager; a config not yet in a model: transformers' default,
    sdpa). None for an architecture whose calls this does not know."""
    if config.model_type == CONCEPT_MODEL_TYPE:
        concepts = config.concept_num
        calls = [("concepts ← tokens", concepts, seq_len, True), ("concepts ← concepts", concepts, concepts, False)]
        if decoder and config.decoder_type != "weighted":
            calls.append(("positions ← concepts", max(1, round(0.15 * seq_len)), concepts, False))
        return calls
    if config.model_type in TOKEN_ENCODERS:
        sdpa = (getattr(config, "_attn_implementation", None) or "sdpa") == "sdpa"
        return [("tokens ← tokens", seq_len, seq_len, True)] if sdpa else []
    return None


def attention_dropout(config) -> float:
    """The dropout a training forward applies to the attention probabilities (BERT's and the Concept Encoder's
    name for it, else DistilBERT's), which decides kernels too: the CPU's flash kernel has none."""
    for name in ("attention_probs_dropout_prob", "attention_dropout"):
        if isinstance(value := getattr(config, name, None), int | float):
            return float(value)
    return 0.0


def examples_of_two_lengths(examples: Iterable[dict], look: int = 64) -> list[dict]:
    """The first example and the first of another length among the next `look` (else the second): collated, a
    batch padded as the run's batches are, unless all of them have one length (packed blocks), as the run's do."""
    chosen: list[dict] = []
    for example in itertools.islice(examples, look):
        if not chosen or len(chosen) == 1 and len(example["input_ids"]) == len(chosen[0]["input_ids"]):
            chosen.append(example)
        elif len(example["input_ids"]) != len(chosen[0]["input_ids"]):
            return [chosen[0], example]
    return chosen[:2]


def probe_rows(batch: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`batch`'s `input_ids` and `attention_mask` cut to two rows, its shortest and its longest: the longest sets
    the padded length, and the shortest is padded when any row is. Two rows bound the probe's memory (the math
    kernel holds rows × heads × N² scores)."""
    ids, mask = batch["input_ids"], batch.get("attention_mask")
    if mask is None or len(ids) <= 2:
        return ids[:2], None if mask is None else mask[:2]
    lengths = mask.sum(dim=1)
    rows = torch.stack([lengths.argmin(), lengths.argmax()])
    return ids[rows], mask[rows]


def sdpa_priority() -> list[str]:
    """PyTorch's SDPA backends (`SDPA_BACKENDS` names) in the order it tries them, read from torch itself
    (`torch._C._get_sdp_priority_order()`, which `sdpa_kernel(..., set_priority=True)` changes): the installed
    torch 2.13's default is flash, memory-efficient, math, cuDNN. On CUDA the first SDPA call may put cuDNN first
    (PyTorch's aten/src/ATen/native/transformers/cuda/sdp_utils.cpp, `priority_order` and
    `check_prefer_cudnn_attention`: compute capability 9.x/10.x, H100/B200, with a recent cuDNN, unless
    `TORCH_CUDNN_SDPA_DEPRIORITIZED=1`), so it is read after the probe's calls. The CPU tries flash, then math
    (sdp_utils_cpp.cpp, `priority_order_cpp`): memory-efficient and cuDNN attention are CUDA kernels."""
    order = getattr(torch._C, "_get_sdp_priority_order", None)
    backends = [SDPBackend(number) for number in order()] if order else list(SDPA_BACKENDS)  # torch < 2.6: default
    return [SDPA_BACKENDS[backend] for backend in backends if backend in SDPA_BACKENDS]


def probe_attention_kernels(config, batch: dict, state: PartialState, dtype: torch.dtype, decoder: bool = True):
    """Step 8 (the module doc): which SDPA backends serve the attention calls of a model with `config` on `batch`'s
    shapes and padding in `dtype` (`compute_dtype`), logged in one line with the ones PyTorch will use. Returns, on
    the main process ({} elsewhere), `dtype`, `padded`, `dropout`, by backend name whether it serves every call,
    `calls` (each call → the backend PyTorch picks for it: torch chooses call by call) and `chosen` (that backend,
    or each call's when they differ; None, with `not_probed` saying why, for a model whose calls it does not know
    or that computes attention outside SDPA)."""
    if not state.is_main_process:
        return {}
    ids, mask = probe_rows(batch)
    rows, seq_len = ids.shape
    padded = mask is not None and not bool(mask.all())
    verdict = {"dtype": DTYPE_NAMES[dtype], "padded": padded, "dropout": attention_dropout(config)}
    calls = attention_calls(config, seq_len, decoder)
    if calls is None:
        why = unmodelled(config.model_type, "the attention calls")
    elif not calls:
        why = (f"{config.model_type} computes its attention with attn_implementation={config._attn_implementation!r} "
               "(its own matmuls), not torch's SDPA: there is no kernel to choose")  # fmt: skip
    if not calls:
        logger.info("attention kernels: not probed: %s", why)
        return {**verdict, "chosen": None, "not_probed": why}
    key_mask = mask.bool().to(state.device)[:, None, None, :] if padded else None  # [B,1,1,N]
    heads = config.num_attention_heads

    def serves(backend, queries: int, keys: int, masked: bool) -> bool:
        """Whether `backend` alone runs the call forward and backward (queries, keys and values laid out as the
        models' projections are: [B,L,h,d] viewed as [B,h,L,d])."""
        try:
            with sdpa_kernel([backend]):
                q, k, v = (torch.randn(rows, length, heads, config.hidden_size // heads, device=state.device,
                                       dtype=dtype, requires_grad=True).transpose(1, 2)
                           for length in (queries, keys, keys))  # fmt: skip
                attention = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=key_mask if masked else None, dropout_p=verdict["dropout"]
                )
                attention.sum().backward()
            return True
        except RuntimeError:
            return False

    # the run's random streams are left as they were (the probe's draws and dropout masks are its own);
    # each refusal's reasons are silenced: the verdict says yes or no
    devices = [state.device] if state.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.enable_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        served = {name: [serves(backend, *call[1:]) for call in calls] for backend, name in SDPA_BACKENDS.items()}
    order = sdpa_priority()  # after the calls: CUDA settles its order at the first one
    picked = {call[0]: next((name for name in order if served[name][i]), "none") for i, call in enumerate(calls)}
    distinct = set(picked.values())
    chosen = distinct.pop() if len(distinct) == 1 else ", ".join(f"{name} for {what}" for what, name in picked.items())
    logger.info(
        "attention kernels on %s (%s, %s batch of %d rows, attention dropout %g, with gradients; %s): %s, in "
        "PyTorch's order → PyTorch will use %s",
        state.device, verdict["dtype"], "padded" if padded else "unpadded", rows, verdict["dropout"],
        ", ".join(f"{what} {q}×{k}" for what, q, k, _ in calls),
        ", ".join(f"{name}={availability(served[name])}" for name in order), chosen,
    )  # fmt: skip
    return {**verdict, **{name: all(served[name]) for name in order}, "calls": picked, "chosen": chosen}


def availability(served: list[bool]) -> str:
    """`yes`, `no`, or how many of the calls a backend serves."""
    return "yes" if all(served) else "no" if not any(served) else f"{sum(served)} of {len(served)} calls"
