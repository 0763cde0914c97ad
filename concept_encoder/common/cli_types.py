"""argparse types shared by the project's command-line tools (torch-free), so every numeric argument of
every tool is range-checked the same way: `--batches 0` is one usage line, not a traceback later."""

from __future__ import annotations

import argparse


def at_least(minimum: int):
    """argparse type: an int >= `minimum` (a usage error naming the bound otherwise)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        return value

    parse.__name__ = f"int >= {minimum}"
    return parse


def yes_no(text: str) -> bool:
    """argparse type: true/false (also yes/no, 1/0, any case); a usage error for any other word, which a plain
    `text in ("true", ...)` would read as false."""
    value = text.strip().lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
