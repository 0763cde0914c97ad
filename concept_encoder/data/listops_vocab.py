"""The ListOps symbols (torch-free): what `tasks/listops.py` writes trees in and `--tokenizer listops`
(`tokenizer.symbol_tokenizer`) gives ids to."""

from __future__ import annotations

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
CLOSE = "]"
DIGITS = tuple(str(d) for d in range(10))
SYMBOLS = (*OPERATORS, CLOSE, *DIGITS)
VOCAB_VERSION = 1  # part of the tokenizer's cache folder name: a changed vocabulary is a new folder
