"""Pretraining objectives beside MLM: how a batch is corrupted, which positions are decoded, how each
position's loss is weighted.

Every corruption has the interface of the masking collators (`concept_encoder.data.collators`): the
loop collates (pads) in the DataLoader and calls `corruption.mask(batch)` when it consumes a batch,
and `state_dict()`/`load_state_dict()` carry the corruption's own generator for exact resume. `mask`
takes a padded batch (`input_ids`, `attention_mask` `[B,N]`) and returns the model's inputs:

    input_ids [B,N_enc], attention_mask [B,N_enc]   what the encoder sees
    labels [B,N]                                    ids to predict, IGNORE_INDEX elsewhere
    label_weights [B,N]                             optional per-position loss weights
    loss_normalizer []                              the token count the summed loss is divided by
    source_tokens []                                tokens of the uncorrupted batch (the budget counts these)

`mlm` is the masking collator itself (`--masking mlm|whole_word|span`); the loss is the mean
cross-entropy over the masked tokens.
"""

from __future__ import annotations

import torch
from torch._dynamo.decorators import mark_unbacked
from transformers import PreTrainedTokenizerBase

from ..constants import DIFFUSION_WEIGHTINGS, EVAL_MASK_RATES, LOSS_NORMALIZER, OBJECTIVES, eval_suffixes
from ..model.constants import IGNORE_INDEX
from ..model.heads import labelled_slots

SOURCE_TOKENS = "source_tokens"


class SeededCorruption:
    """A corruption that draws from its own `torch.Generator` (checkpointed) and never touches special tokens."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, seed: int | None):
        if tokenizer.mask_token_id is None or tokenizer.pad_token_id is None:
            raise ValueError("this objective needs a tokenizer with pad and mask tokens")
        self.mask_token_id = tokenizer.mask_token_id
        self.pad_token_id = tokenizer.pad_token_id
        self.special_ids = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long)
        self.generator = torch.Generator()
        if seed is None:
            self.generator.seed()  # a fresh non-deterministic seed for this generator only (not the global RNG)
        else:
            self.generator.manual_seed(seed)

    def eligible(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """`[B,N]` bool: real (non-pad) tokens that are not special tokens."""
        return batch["attention_mask"].bool() & ~torch.isin(batch["input_ids"], self.special_ids)

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


class MaskedDiffusion(SeededCorruption):
    """Masked discrete diffusion: per sample a rate t ~ U(t_min, t_max); each eligible token becomes
    `[MASK]` with probability t (always `[MASK]`, no random replacements).

    With `weighting="elbo"` each masked token's cross-entropy is weighted by 1/t and the sum is divided
    by the number of eligible tokens: the masked-diffusion ELBO per token (Sahoo et al. 2024, MDLM;
    Shi et al. 2024), an upper bound on the negative log-likelihood. With `"none"` the loss is the
    plain mean cross-entropy over the masked tokens. A fixed rate (`t_min == t_max`, weighting none)
    is the evaluation yardstick of `evaluation_corruptions`.
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        t_min: float = 0.1,
        t_max: float = 1.0,
        weighting: str = "elbo",
        seed: int | None = None,
    ):
        super().__init__(tokenizer, seed)
        if not 0 < t_min <= t_max <= 1:
            raise ValueError(f"masking rates t_min={t_min}, t_max={t_max} must satisfy 0 < t_min <= t_max <= 1")
        if weighting not in DIFFUSION_WEIGHTINGS:
            raise ValueError(f"diffusion weighting {weighting!r} is unknown; choose one of {DIFFUSION_WEIGHTINGS}")
        self.t_min, self.t_max, self.weighting = t_min, t_max, weighting

    def mask(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Padded `input_ids, attention_mask [B,N]` → masked inputs, `labels`, `label_weights [B,N]`, `rate [B]`."""
        input_ids = batch["input_ids"]
        eligible = self.eligible(batch)
        rate = self.t_min + (self.t_max - self.t_min) * torch.rand(input_ids.shape[0], generator=self.generator)  # [B]
        chosen = eligible & (torch.rand(input_ids.shape, generator=self.generator) < rate[:, None])  # [B,N]
        out = {
            "input_ids": torch.where(chosen, self.mask_token_id, input_ids),
            "attention_mask": batch["attention_mask"],
            "labels": torch.where(chosen, input_ids, IGNORE_INDEX),
            "rate": rate,
        }
        if self.weighting == "elbo":
            out["label_weights"] = chosen / rate[:, None]  # [B,N]: 1/t at masked positions
            out[LOSS_NORMALIZER] = eligible.sum()
        return out


class TokenDeletion(SeededCorruption):
    """TSDAE's noise (Wang et al. 2021): `round(deletion_rate × eligible)` tokens of each sample are
    deleted from the encoder's view (absent, not masked: the kept tokens close up and take positions
    0..n-1), and every non-pad token of the original, special tokens included, is a target.

    The decoder must query positions only (`posonly` or `weighted`): a token-query decoder would be
    handed the very tokens it has to reconstruct.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, deletion_rate: float = 0.6, seed: int | None = None):
        super().__init__(tokenizer, seed)
        if not 0 <= deletion_rate < 1:
            raise ValueError(f"deletion_rate={deletion_rate} must be in [0, 1)")
        self.deletion_rate = deletion_rate

    def mask(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Padded `input_ids, attention_mask [B,N]` → encoder `input_ids, attention_mask [B,N_kept]`,
        `labels [B,N]` (the whole original) and `deleted [B,N]` (bool)."""
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
        eligible = self.eligible(batch)
        to_delete = torch.round(self.deletion_rate * eligible.sum(dim=1))  # [B]
        scores = torch.rand(input_ids.shape, generator=self.generator).masked_fill(~eligible, 2.0)  # [B,N]
        rank = scores.argsort(dim=1).argsort(dim=1)  # [B,N]: rank of each position's score in its row
        deleted = rank < to_delete[:, None]  # the lowest-scored eligible tokens
        kept = attention_mask.bool() & ~deleted
        kept_count = kept.sum(dim=1)  # [B]
        width = int(kept_count.max()) if kept.numel() else 0
        order = torch.sort(kept.to(torch.uint8), dim=1, descending=True, stable=True).indices[:, :width]  # [B,W]
        encoder_mask = torch.arange(width)[None, :] < kept_count[:, None]  # [B,W]
        return {
            "input_ids": torch.where(encoder_mask, input_ids.gather(1, order), self.pad_token_id),
            "attention_mask": encoder_mask.to(attention_mask.dtype),
            "labels": torch.where(attention_mask.bool(), input_ids, IGNORE_INDEX),
            "deleted": deleted,
            SOURCE_TOKENS: attention_mask.sum(),
        }


MODEL_INPUTS = ("input_ids", "attention_mask", "labels", "label_weights")
LABELLED_POSITIONS, LABELLED_ROWS, PADDED = "labelled_positions", "labelled_rows", "padded"  # `prepare_batch`'s keys


def prepare_batch(batch: dict) -> dict:
    """A corrupted batch, still on the CPU → the same batch plus what the step must know of it, found here so
    that nothing in a training micro-batch waits for the device (each of these read there is a host sync):

        labelled_positions [B,M], labelled_rows [L]   int64: the labelled slots (`heads.labelled_slots`), which
                                                      the models gather by index instead of a boolean mask
        padded                                        bool: whether `attention_mask` holds a 0
        loss_normalizer, source_tokens                int: the loss normaliser and the uncorrupted tokens

    The loops call it before the batch moves (`loops/mlm.py`: on the masking thread); `model_inputs` calls it on
    a batch that was not (then on its device). A padding-free batch's all-ones `attention_mask` is then left out
    of the model's inputs (the model needs no mask, eager or compiled: `modeling.padding_mask`), which keeps
    SDPA's flash kernel eligible."""
    if LABELLED_ROWS in batch:
        return batch
    positions, rows = (t.clone() for t in labelled_slots(batch["labels"]))  # not views: compile sees their sizes
    normalizer = batch.get(LOSS_NORMALIZER)
    tokens = batch.get(SOURCE_TOKENS)
    return {
        **batch,
        LABELLED_POSITIONS: positions,
        LABELLED_ROWS: rows,
        PADDED: not bool(batch["attention_mask"].all()),
        LOSS_NORMALIZER: len(rows) if normalizer is None else int(normalizer),
        SOURCE_TOKENS: int(batch["attention_mask"].sum() if tokens is None else tokens),
    }


def model_inputs(batch: dict) -> tuple[dict[str, torch.Tensor], int, int]:
    """A corrupted batch (`prepare_batch`'s, or one it is applied to here) → (the model's keyword inputs, the
    loss normaliser: the batch's own `loss_normalizer` or, by default, its labelled-position count, and the
    tokens of the uncorrupted batch: its `source_tokens` or the encoder's non-pad count).

    The labelled slots' sizes vary from batch to batch and may be 0 or 1: they are marked unbacked for
    torch.compile (`torch._dynamo.decorators.mark_unbacked`), which then traces one graph for every batch,
    as it did when the model read them itself (a no-op in eager mode)."""
    batch = prepare_batch(batch)
    inputs = {k: batch[k] for k in (*MODEL_INPUTS, LABELLED_POSITIONS, LABELLED_ROWS) if k in batch}
    if batch[PADDED]:
        inputs[PADDED] = True
    else:
        del inputs["attention_mask"]
    mark_unbacked(inputs[LABELLED_POSITIONS], 1)
    mark_unbacked(inputs[LABELLED_ROWS], 0)
    return inputs, batch[LOSS_NORMALIZER], batch[SOURCE_TOKENS]


def build_corruption(objective: str, mlm_collator, tokenizer, args, seed: int | None):
    """The training corruption of `objective` in `OBJECTIVES` (`mlm`, `distill`: `mlm_collator` itself)."""
    if objective in ("mlm", "distill"):  # distill: the student reads the MLM view (training/distill.py)
        return mlm_collator
    if objective == "diffusion":
        return MaskedDiffusion(tokenizer, t_min=args.t_min, weighting=args.diffusion_weighting, seed=seed)
    if objective == "tsdae":
        return TokenDeletion(tokenizer, deletion_rate=args.deletion_rate, seed=seed)
    raise ValueError(f"objective={objective!r} is unknown; choose one of {OBJECTIVES}")


def evaluation_corruptions(objective: str, tokenizer, args, seed: int) -> dict[str, object]:
    """Evaluations besides the 15% MLM yardstick every run gets, by metric suffix (`eval_suffixes`): masked
    diffusion at each fixed rate of `EVAL_MASK_RATES` (plain masked-token CE), TSDAE's reconstruction at its rate."""
    if objective == "diffusion":
        return {
            suffix: MaskedDiffusion(tokenizer, t_min=rate, t_max=rate, weighting="none", seed=seed)
            for suffix, rate in zip(eval_suffixes(objective), EVAL_MASK_RATES, strict=True)
        }
    if objective == "tsdae":
        return {"tsdae": TokenDeletion(tokenizer, deletion_rate=args.deletion_rate, seed=seed)}
    return {}
