"""Downstream tasks for fine-tuning: the embedded offline task, GLUE, local files; metrics and baselines."""

from ..common.lazy import lazy_attributes

EXPORTS = {
    "TaskArguments": "arguments",
    "TaskData": "loading",
    "load_task": "loading",
    "compute_metrics": "metrics",
    "baseline_predictions": "metrics",
    "embedded_sentences": "embedded",
    "embedded_pairs": "embedded",
}
__all__ = sorted(EXPORTS)
__getattr__, __dir__ = lazy_attributes(__name__, EXPORTS)
