"""Padding a batch's length up to a multiple (torch-free, so the plan check and `fail_fast` use it before torch
is imported): the round-up every collator and check shares, and the `pad_to_multiple_of` argument the
pretraining and fine-tuning argument classes both declare."""

from __future__ import annotations

from dataclasses import field


def padded_length(length: int, multiple: int | None) -> int:
    """`length` rounded up to a multiple of `multiple` (unchanged when `multiple` is None or 0)."""
    return -(-length // multiple) * multiple if multiple else length


def pad_multiple_field(help_text: str):
    """The dataclass field `pad_to_multiple_of: int | None` (unset: batches padded to their longest input)."""
    return field(default=None, metadata={"help": help_text})


def check_pad_multiple(multiple: int | None) -> None:
    """ValueError unless `multiple` is unset or a whole number >= 1."""
    if multiple is not None and multiple < 1:
        raise ValueError(f"pad_to_multiple_of={multiple} must be >= 1 (or unset)")
