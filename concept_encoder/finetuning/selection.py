"""Model selection on a dev split: the best step so far, kept with its weights and checkpointed with the run."""

from __future__ import annotations

import math


class BestStep:
    """The step whose dev metric is best so far: its (signed) score, step, dev metrics and weights on the CPU.

    Registered with `accelerator.register_for_checkpointing`, so a resumed run continues the selection
    exactly where it stopped. `sign` is +1 when higher is better, -1 when lower is (e.g. MSE).
    """

    def __init__(self, metric: str, sign: float):
        self.metric, self.sign = metric, sign
        self.score, self.step, self.dev, self.weights = -math.inf, 0, None, None

    def offer(self, step: int, dev: dict, state_dict) -> bool:
        """Keep `step` if its dev metric beats the best so far; `state_dict()` is called only then."""
        score = self.sign * dev[self.metric]
        if score <= self.score:
            return False
        self.score, self.step, self.dev = score, step, dev
        self.weights = {name: tensor.detach().cpu().clone() for name, tensor in state_dict().items()}
        return True

    def reached(self, target: float | None) -> bool:
        """Whether the best dev metric so far has reached `target` (at or above it, or at or below for a metric
        where lower is better): `--stop_at_dev`'s test, True again after a resume since the selection is restored."""
        return target is not None and self.dev is not None and self.score >= self.sign * target

    def state_dict(self) -> dict:
        return {"score": self.score, "step": self.step, "dev": self.dev, "weights": self.weights}

    def load_state_dict(self, state: dict) -> None:
        self.score, self.step, self.dev, self.weights = state["score"], state["step"], state["dev"], state["weights"]
