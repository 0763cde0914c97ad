"""Masking collators: standard 80/10/10 MLM, whole-word masking and span masking.

All three return `input_ids [B,N]`, `attention_mask [B,N]` and `labels [B,N]` (original ids
at chosen positions, -100 elsewhere); special and pad tokens are never chosen.

Each collator has two halves: `collate(examples)` pads (deterministic, fine in DataLoader
workers and prefetch) and `mask(batch)` draws the masks; `collator(examples)` does both.
The training loop collates in the DataLoader but masks when it consumes a batch, so the
masking generator advances exactly once per consumed batch: accelerate prefetches one
batch ahead, and a checkpoint must not include masks drawn for a batch not yet trained on.
With a `seed`, each collator draws from its own `torch.Generator`, whose state is exposed
through `state_dict()`/`load_state_dict()` for exact resume.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DataCollatorForLanguageModeling, PreTrainedTokenizerBase

from ..common.padding import padded_length
from ..constants import MASKING_STRATEGIES
from ..model.constants import IGNORE_INDEX
from .recall_vocab import QUERY


class MLMCollator(DataCollatorForLanguageModeling):
    """Standard MLM: transformers' `DataCollatorForLanguageModeling`, plus two things it lacks here:

    it drops the `word_start` column (which it would try to pad as a model input), and it
    checkpoints its generator state for exact resume.
    """

    def collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """`examples`: dicts with `input_ids [N_i]` → padded `input_ids, attention_mask [B,N]`."""
        return dict(
            self.tokenizer.pad(
                {"input_ids": [e["input_ids"] for e in examples]},
                return_tensors="pt",
                pad_to_multiple_of=self.pad_to_multiple_of,
            )
        )

    def mask(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Padded batch → `input_ids` with masks applied, `attention_mask`, `labels` (all `[B,N]`)."""
        if self.seed is not None and self.generator is None:
            self.create_rng("pt")
        input_ids, labels = self.torch_mask_tokens(batch["input_ids"].clone())
        return {"input_ids": input_ids, "attention_mask": batch["attention_mask"], "labels": labels}

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return self.mask(self.collate(examples))

    def state_dict(self) -> dict:
        if self.seed is None:
            return {}
        if self.generator is None:
            self.create_rng("pt")
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if "generator" in state:
            if self.generator is None:
                self.create_rng("pt")
            self.generator.set_state(state["generator"])


class UnitMaskingCollator:
    """Shared mechanics of whole-word and span masking: padding, eligibility, 80/10/10 replacement.

    Written here rather than taken from transformers because its whole-word collator needs
    character offset mappings carried through packing (two ints per token), forces 100%
    `[MASK]` replacement, and transformers has no span-masking collator. Subclasses only
    decide which positions to mask (`choose`).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        mlm_probability: float = 0.15,
        mask_replace_prob: float = 0.8,
        random_replace_prob: float = 0.1,
        pad_to_multiple_of: int | None = None,
        seed: int | None = None,
    ):
        if not 0 < mlm_probability < 1:
            raise ValueError(f"mlm_probability={mlm_probability} must be in (0, 1)")
        if mask_replace_prob < 0 or random_replace_prob < 0 or mask_replace_prob + random_replace_prob > 1:
            raise ValueError("mask_replace_prob and random_replace_prob must be >= 0 and sum to at most 1")
        if tokenizer.mask_token_id is None or tokenizer.pad_token_id is None:
            raise ValueError("masking needs a tokenizer with pad and mask tokens")
        self.tokenizer = tokenizer
        self.mlm_probability = mlm_probability
        self.mask_replace_prob = mask_replace_prob
        self.random_replace_prob = random_replace_prob
        self.pad_to_multiple_of = pad_to_multiple_of
        self.generator = torch.Generator().manual_seed(seed) if seed is not None else None
        self.special_ids = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long)

    def state_dict(self) -> dict:
        return {} if self.generator is None else {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        if "generator" in state and self.generator is not None:
            self.generator.set_state(state["generator"])

    def collate(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """→ `input_ids`, `attention_mask`, `word_start`, each `[B,N]` (N rounded up to `pad_to_multiple_of`)."""
        length = padded_length(max(len(e["input_ids"]) for e in examples), self.pad_to_multiple_of)
        ids = torch.full((len(examples), length), self.tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        starts = torch.ones((len(examples), length), dtype=torch.bool)  # no word info: every token is a word
        for i, e in enumerate(examples):
            n = len(e["input_ids"])
            ids[i, :n] = torch.as_tensor(e["input_ids"], dtype=torch.long)
            mask[i, :n] = 1
            if "word_start" in e:
                starts[i, :n] = torch.as_tensor(e["word_start"], dtype=torch.bool)
        return {"input_ids": ids, "attention_mask": mask, "word_start": starts}

    def choose(self, eligible: torch.Tensor, word_start: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """`eligible [B,N]` bool, `word_start [B,N]` bool, `input_ids [B,N]` → positions to mask `[B,N]` bool."""
        raise NotImplementedError

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        """`examples`: dicts with `input_ids [N_i]` (and `word_start [N_i]`) → `input_ids, attention_mask, labels [B,N]`."""
        return self.mask(self.collate(examples))

    def mask(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Padded batch (with `word_start`) → masked `input_ids`, `attention_mask`, `labels` (all `[B,N]`)."""
        input_ids, attention_mask, word_start = batch["input_ids"], batch["attention_mask"], batch["word_start"]
        eligible = attention_mask.bool() & ~torch.isin(input_ids, self.special_ids)
        chosen = self.choose(eligible, word_start, input_ids) & eligible
        labels = torch.where(chosen, input_ids, IGNORE_INDEX)
        draw = torch.rand(input_ids.shape, generator=self.generator)
        to_mask = chosen & (draw < self.mask_replace_prob)
        to_random = (
            chosen & (draw >= self.mask_replace_prob) & (draw < self.mask_replace_prob + self.random_replace_prob)
        )
        random_ids = torch.randint(len(self.tokenizer), input_ids.shape, generator=self.generator)
        input_ids = torch.where(to_mask, self.tokenizer.mask_token_id, input_ids)
        input_ids = torch.where(to_random, random_ids, input_ids)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class WholeWordMaskingCollator(UnitMaskingCollator):
    """Each word is chosen with probability `mlm_probability`; all its tokens are masked together.

    Words come from `word_start` (1 at a word's first token), which preprocessing derives from
    the fast tokenizer's word ids. The expected masked-token fraction equals `mlm_probability`.
    """

    def choose(self, eligible: torch.Tensor, word_start: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        word_index = (word_start.long().cumsum(dim=1) - 1).clamp(min=0)  # [B,N]: word of each token
        draw = torch.rand(eligible.shape, generator=self.generator) < self.mlm_probability
        picked_starts = (draw & word_start & eligible).long()  # one draw per word, taken at its first token
        picked_words = torch.zeros_like(picked_starts).scatter_add_(1, word_index, picked_starts)  # [B,words]
        return picked_words.gather(1, word_index).bool()


class SpanMaskingCollator(UnitMaskingCollator):
    """SpanBERT-style spans: lengths ~ Geometric(1/mean_span_length) clipped to `max_span_length`.

    Spans are placed at random eligible positions, never overlapping or touching another span
    (so each masked run is one span), until `round(mlm_probability × eligible tokens)` tokens of
    the sample are masked; the last span is shortened to hit the budget exactly.
    """

    def __init__(self, tokenizer, mean_span_length: float = 3.0, max_span_length: int = 10, **kwargs):
        super().__init__(tokenizer, **kwargs)
        if mean_span_length < 1:
            raise ValueError(f"mean_span_length={mean_span_length} must be >= 1")
        if max_span_length < 1:
            raise ValueError(f"max_span_length={max_span_length} must be >= 1")
        self.mean_span_length = mean_span_length
        self.max_span_length = max_span_length

    def choose(self, eligible: torch.Tensor, word_start: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        chosen = torch.zeros_like(eligible)
        for row in range(eligible.shape[0]):
            chosen[row] = self.spans_for_row(eligible[row])
        return chosen

    def spans_for_row(self, eligible: torch.Tensor) -> torch.Tensor:
        """`eligible [N]` bool → masked `[N]` bool made of separated contiguous spans."""
        n = eligible.numel()
        budget = round(self.mlm_probability * int(eligible.sum()))
        masked = torch.zeros(n, dtype=torch.bool)
        free = eligible.clone()  # eligible and not adjacent to a span
        done, attempts = 0, 0
        while done < budget and attempts < 50 * (budget + 1):
            attempts += 1
            length = int(torch.empty(1).geometric_(1 / self.mean_span_length, generator=self.generator))
            length = min(length, self.max_span_length, budget - done)
            start = int(torch.randint(n - length + 1, (1,), generator=self.generator))
            if not bool(free[start : start + length].all()):
                continue
            masked[start : start + length] = True
            free[max(start - 1, 0) : start + length + 1] = False
            done += length
        return masked


class QueryValueMaskingCollator(UnitMaskingCollator):
    """Associative recall's masked form (`tasks/recall.py`): the value after each `[QUERY] <key>` is masked, always
    by `[MASK]`, and nothing else, so the MLM head is trained on exactly what recall asks: a key's value, found
    by binding it to the pair earlier in the text (a random rate would mostly mask pairs, which no rule predicts)."""

    def __init__(self, tokenizer, **kwargs):
        super().__init__(tokenizer, **{**kwargs, "mask_replace_prob": 1.0, "random_replace_prob": 0.0})
        self.query_id = tokenizer.convert_tokens_to_ids(QUERY)
        if self.query_id is None or self.query_id == tokenizer.unk_token_id:
            raise ValueError(f"--masking query_values masks the value after each {QUERY} key, which this tokenizer "
                             "lacks: use --tokenizer recall (or recall:<keys>:<values>) with --dataset task:recall:<K>")  # fmt: skip

    def choose(self, eligible: torch.Tensor, word_start: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        chosen = torch.zeros_like(eligible)
        chosen[:, 2:] = input_ids[:, :-2] == self.query_id
        return chosen


def build_collator(
    tokenizer: PreTrainedTokenizerBase,
    masking: str = "mlm",
    mlm_probability: float = 0.15,
    mean_span_length: float = 3.0,
    max_span_length: int = 10,
    pad_to_multiple_of: int | None = None,
    seed: int | None = None,
):
    """The collator for `masking` in `MASKING_STRATEGIES`."""
    if masking == "mlm":
        return MLMCollator(tokenizer, mlm_probability=mlm_probability, pad_to_multiple_of=pad_to_multiple_of, seed=seed)
    common = dict(mlm_probability=mlm_probability, pad_to_multiple_of=pad_to_multiple_of, seed=seed)
    if masking == "whole_word":
        return WholeWordMaskingCollator(tokenizer, **common)
    if masking == "span":
        return SpanMaskingCollator(
            tokenizer, mean_span_length=mean_span_length, max_span_length=max_span_length, **common
        )
    if masking == "query_values":
        return QueryValueMaskingCollator(tokenizer, **common)
    raise ValueError(f"masking={masking!r} is unknown; choose one of {MASKING_STRATEGIES}")
