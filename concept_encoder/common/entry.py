"""How the project's command-line tools end on Ctrl-C: one line naming the tool, exit code 130 (128 + SIGINT, what
shells report; 143 for SIGTERM while a tool waits on a launch), never a traceback. What a tool finished stays: runs
resume from their checkpoints, curve points, ablation runs and fine-tuning seeds are reused by the same command.

`run_tool(main, name)` wraps a tool's `main` (the `python -m concept_encoder` dispatcher, every module's `__main__`
block, the loops, the launch scripts) and ends a refused file or path in one line too. `interrupt_in_one_line(name)` covers the seconds before it: the
imports at the top of a module run as `python -m <module>` or as a script (torch alone takes seconds), through
`sys.excepthook`, which sees only what nothing else caught; other exceptions go on to the previous hook.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

INTERRUPTED = 130  # 128 + SIGINT
TERMINATED = 143  # 128 + SIGTERM
TRACEBACK_ENV = "CONCEPT_ENCODER_TRACEBACK"


class Terminated(KeyboardInterrupt):
    """SIGTERM (`kill`, `timeout`, a scheduler's stop) while a tool waits on a launch, handled as Ctrl-C is (the
    ranks stop at a checkpoint: `process_group.call_interrupting_ranks`); the tool then exits with `TERMINATED`."""


def interrupted_line(name: str) -> str:
    return f"{name}: interrupted (what finished is kept: rerun the same command to continue)"


def run_tool(main: Callable[..., int | None], name: str, argv: list[str] | None = None) -> int:
    """`main(argv)`'s exit code; `INTERRUPTED` after one line on standard error when Ctrl-C stops it (`TERMINATED`
    when SIGTERM stopped a launch it waited on: `Terminated`); 1 after one line when the system refuses a file or
    path the tool was given or writes (a name too long, no permission, no space: `OSError`, the input's or the
    machine's, not the tool's). `CONCEPT_ENCODER_TRACEBACK=1` shows the traceback instead."""
    try:
        return main(argv) or 0
    except KeyboardInterrupt as stop:
        print(f"\n{interrupted_line(name)}", file=sys.stderr)
        return TERMINATED if isinstance(stop, Terminated) else INTERRUPTED
    except OSError as error:
        if os.environ.get(TRACEBACK_ENV):
            raise
        print(f"error: {name}: {error}\n(set {TRACEBACK_ENV}=1 for the traceback)", file=sys.stderr)
        return 1


def interrupt_in_one_line(name: str) -> None:
    """From now on an uncaught KeyboardInterrupt ends this process with `interrupted_line(name)` (and the
    interpreter's own SIGINT exit) instead of a traceback."""
    previous = sys.excepthook

    def hook(kind, value, traceback) -> None:
        if issubclass(kind, KeyboardInterrupt):
            print(f"\n{interrupted_line(name)}", file=sys.stderr)
        else:
            previous(kind, value, traceback)

    sys.excepthook = hook
