"""Task metrics from scikit-learn and scipy (not hand-written), and the trivial baseline beside them.

`predictions`: class ids `[n]` (single-label), scores `[n]` (regression) or 0/1 `[n,K]` (multi-label).
"""

from __future__ import annotations

import numpy as np
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef, mean_squared_error

from ..constants import TASK_METRIC_NAMES, check_table_covers


def correlation(fn, predictions, labels) -> float:
    """Pearson/Spearman; 0 for a constant prediction (no correlation can be shown)."""
    if np.ptp(predictions) == 0 or np.ptp(labels) == 0:
        return 0.0
    return float(fn(predictions, labels)[0])


METRICS = {
    "accuracy": lambda p, y: float(accuracy_score(y, p)),
    "macro_f1": lambda p, y: float(f1_score(y, p, average="macro", zero_division=0)),
    "f1": lambda p, y: float(f1_score(y, p, zero_division=0)),  # binary, positive class 1 (GLUE MRPC/QQP)
    "matthews": lambda p, y: float(matthews_corrcoef(y, p)),
    "pearson": lambda p, y: correlation(pearsonr, p, y),
    "spearman": lambda p, y: correlation(spearmanr, p, y),
    "mse": lambda p, y: float(mean_squared_error(y, p)),
    "micro_f1": lambda p, y: float(f1_score(y, p, average="micro", zero_division=0)),
    "subset_accuracy": lambda p, y: float(accuracy_score(y, p)),
}
check_table_covers(METRICS, TASK_METRIC_NAMES, "METRICS")
LOWER_IS_BETTER = frozenset({"mse"})


def metric_sign(name: str) -> float:
    """+1 when a higher `name` is better, -1 when lower is (MSE): multiply before taking a maximum."""
    return -1.0 if name in LOWER_IS_BETTER else 1.0


def compute_metrics(names, predictions, labels) -> dict[str, float]:
    predictions, labels = np.asarray(predictions), np.asarray(labels)
    return {name: METRICS[name](predictions, labels) for name in names}


POSITION_BUCKETS = 8  # a 512-token window over a 4k-token input sees the first of eight


def accuracy_by_position(predictions, labels, positions, buckets: int = POSITION_BUCKETS) -> dict[str, dict]:
    """Accuracy of the examples whose needle starts in each of `buckets` equal ranges of the input
    (`positions`: fractions in [0, 1], the `needle` task's `needle_position`): `{"0-12%": {"accuracy", "count"}}`,
    in order; a range without examples is left out."""
    predictions, labels, positions = np.asarray(predictions), np.asarray(labels), np.asarray(positions, dtype=float)
    index = np.minimum((positions * buckets).astype(int), buckets - 1)
    result = {}
    for bucket in range(buckets):
        chosen = index == bucket
        if chosen.any():
            name = f"{100 * bucket // buckets}-{100 * (bucket + 1) // buckets}%"
            result[name] = {
                "accuracy": float((predictions[chosen] == labels[chosen]).mean()),
                "count": int(chosen.sum()),
            }
    return result


def accuracy_by_group(predictions, labels, groups) -> dict[str, dict]:
    """Accuracy of the examples of each group (`groups`: one name per example, e.g. ListOps' tree depth):
    `{"3": {"accuracy", "count"}}`, ordered by group (numerically where the names are numbers)."""
    predictions, labels, groups = np.asarray(predictions), np.asarray(labels), np.asarray(groups)

    def order(name: str):
        head = name.split("-")[0]
        return (0, int(head), name) if head.isdigit() else (1, 0, name)

    result = {}
    for name in sorted(set(groups.tolist()), key=order):
        chosen = groups == name
        result[name] = {"accuracy": float((predictions[chosen] == labels[chosen]).mean()), "count": int(chosen.sum())}
    return result


def baseline_predictions(task_type: str, train_labels, n: int) -> np.ndarray:
    """The trivial predictor fitted on the training labels: the majority class, the mean score, or each
    label's majority (multi-label), repeated `n` times."""
    train_labels = np.asarray(train_labels)
    if task_type == "regression":
        return np.full(n, float(train_labels.mean()))
    if task_type == "multi_label_classification":
        return np.tile((train_labels.mean(axis=0) > 0.5).astype(int), (n, 1))
    values, counts = np.unique(train_labels, return_counts=True)
    return np.full(n, values[counts.argmax()])


def predictions_from_logits(task_type: str, logits: np.ndarray) -> np.ndarray:
    """`logits [n,K]` → class ids, scores or 0/1 labels."""
    if task_type == "regression":
        return logits[:, 0]
    if task_type == "multi_label_classification":
        return (logits > 0).astype(int)
    return logits.argmax(axis=-1)
