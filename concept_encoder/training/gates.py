"""Decision gates: "if effective rank > X at step S, proceed; if not, the hypothesis is wrong: stop".

A gate is `metric op threshold[@first_step]`, e.g. `health/effective_rank_fraction>=0.25@500`, checked
at every evaluation from `first_step` on. Torch-free: the argument dataclasses and the plan checker
parse and validate gates without importing torch.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

GATE_EXIT_CODE = 3  # a run stopped by a failed gate: "hypothesis rejected", not "crashed" (1) or done (0)
GATE_ACTIONS = ("stop", "warn")
COMPARISONS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt}
GATE_PATTERN = re.compile(
    r"^\s*(?P<metric>[A-Za-z_][\w/.\-]*)\s*(?P<op>>=|<=|>|<)\s*(?P<threshold>[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?)"
    r"\s*(@\s*(?P<step>\d+))?\s*$"
)


@dataclass(frozen=True)
class Gate:
    metric: str
    op: str
    threshold: float
    first_step: int = 0

    @property
    def text(self) -> str:
        return f"{self.metric}{self.op}{self.threshold:g}" + (f"@{self.first_step}" if self.first_step else "")

    def passes(self, value: float) -> bool:
        return value == value and COMPARISONS[self.op](value, self.threshold)  # NaN fails every gate


def parse_gate(text: str) -> Gate:
    """`"metric>=0.25@500"` → `Gate`; ValueError naming the text and the syntax otherwise."""
    match = GATE_PATTERN.match(str(text))
    if not match:
        raise ValueError(
            f"gate {text!r} is not `metric<op>threshold[@step]` with op one of {', '.join(COMPARISONS)}; "
            'e.g. --gate "health/effective_rank_fraction>=0.25@500" or --gate "eval_loss<6"'
        )
    step = int(match["step"]) if match["step"] else 0
    return Gate(match["metric"], match["op"], float(match["threshold"]), step)


def parse_gates(texts: list[str], known_metrics: tuple[str, ...] | None = None, where: str = "") -> list[Gate]:
    """Each text parsed; with `known_metrics`, a metric outside them is an error naming the valid ones."""
    gates = [parse_gate(text) for text in texts]
    if known_metrics is not None:
        for gate in gates:
            if gate.metric not in known_metrics:
                raise ValueError(
                    f"gate {gate.text!r}: {where or 'this loop'} evaluates no metric {gate.metric!r}; "
                    f"gateable metrics: {', '.join(known_metrics)}"
                )
    return gates


class GateMonitor:
    """Checks the gates at each evaluation and keeps each gate's outcome (checkpointed for resume).

    An outcome is `{gate, value, step, passed}`: the first failure if the gate ever failed, else its
    latest passing check; `passed` is None (and value/step None) while the gate has not been checked.
    """

    def __init__(self, gates: list[Gate]):
        self.gates = gates
        self.outcomes = {g.text: {"gate": g.text, "value": None, "step": None, "passed": None} for g in gates}

    def check(self, step: int, results: dict) -> list[dict]:
        """Check every gate due at `step` against `results`; returns the gates that fail now."""
        failed = []
        for gate in self.gates:
            if step < gate.first_step or gate.metric not in results:
                continue
            value = float(results[gate.metric])
            outcome = self.outcomes[gate.text]
            if outcome["passed"] is False:
                continue  # keep its first failure
            outcome.update(value=value, step=step, passed=gate.passes(value))
            if not outcome["passed"]:
                failed.append(dict(outcome))
        return failed

    def failed(self) -> list[dict]:
        return [dict(o) for o in self.summary() if o["passed"] is False]

    def summary(self) -> list[dict]:
        return [dict(self.outcomes[g.text]) for g in self.gates]

    def state_dict(self) -> dict:
        return {"outcomes": self.summary()}

    def load_state_dict(self, state: dict) -> None:
        for outcome in state.get("outcomes", []):
            if outcome["gate"] in self.outcomes:
                self.outcomes[outcome["gate"]] = dict(outcome)


GATE_ACTION_TEXT = {"stop": "stopping (--gate_action stop)", "warn": "going on (--gate_action warn)"}


def describe_outcome(outcome: dict) -> str:
    """`gate: value at step S` (or `not reached`)."""
    if outcome["passed"] is None:
        return f"{outcome['gate']}: not reached"
    verdict = "passed" if outcome["passed"] else "failed"
    return f"{outcome['gate']} {verdict}: {outcome['value']:.4g} at step {outcome['step']}"


def gate_stop_message(failed: list[dict], resumed: bool = False) -> str:
    """The line a loop ends with when a gate stopped it (exit code `GATE_EXIT_CODE`)."""
    what = "; ".join(describe_outcome(o) for o in failed)
    if resumed:
        return (
            f"this run was stopped by a gate ({what}); nothing resumed. To train past it, resume with "
            f"--gate_action warn (or without that --gate)"
        )
    return f"stopped by a gate ({what}): checkpoint and final model saved, exit code {GATE_EXIT_CODE}"
