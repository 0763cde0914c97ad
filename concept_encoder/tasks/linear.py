"""Linear models on fixed features with their regularisation chosen on the dev split (scikit-learn).

Two users: the TF-IDF baseline (`baselines.py`, sparse bag-of-n-gram features) and the linear probe
(`concept_encoder/finetuning/probe.py`, frozen features of a model). Both fit on `train`, choose the inverse
regularisation strength `C` (or Ridge's `alpha`) by the task's main metric on `dev`, and report that one
fit on `validation`: the same protocol as fine-tuning, so every number of a report is chosen the same way.
"""

from __future__ import annotations

import warnings

import numpy as np

from .metrics import accuracy_by_position, compute_metrics, metric_sign

C_GRID = (0.01, 0.1, 1.0, 10.0, 100.0, 1000.0)  # LogisticRegression's C = 1 / regularisation strength
ALPHA_GRID = (1000.0, 100.0, 10.0, 1.0, 0.1, 0.01)  # Ridge: alpha, strongest regularisation first


def estimator(task_type: str, strength: float):
    """The linear model of `task_type` at one regularisation value."""
    from sklearn.linear_model import LogisticRegression, Ridge
    from sklearn.multiclass import OneVsRestClassifier

    if task_type == "regression":
        return Ridge(alpha=strength)
    logistic = LogisticRegression(C=strength, max_iter=2000)
    return OneVsRestClassifier(logistic) if task_type == "multi_label_classification" else logistic


def fit_linear(
    task_type: str, metric_names, features: dict, labels: dict, standardize: bool = False, positions=None
) -> dict:
    """Fit on `features["train"]` for each value of the grid, keep the value whose main metric (the first of
    `metric_names`) is best on `features["dev"]`, evaluate that fit once on `features["validation"]`.

    `features`: split → `[n,F]` array (dense or scipy sparse); `labels`: split → `[n]` or `[n,K]`.
    `standardize`: scale each feature to zero mean and unit variance on train first (dense features whose
    scales differ, such as a network's hidden states; TF-IDF rows are already normalised).

    Returns `{"grid": {value: dev main metric}, "chosen": value, "dev": metrics, "validation": metrics,
    "parameter": "C" or "alpha"}`, and `validation_by_position` (`accuracy_by_position`) when the validation
    examples' needle `positions` are given.
    """
    features = dict(features)
    if standardize:
        from sklearn.preprocessing import StandardScaler

        scaler = StandardScaler().fit(features["train"])
        features = {split: scaler.transform(x) for split, x in features.items()}
    main = metric_names[0]
    sign = metric_sign(main)
    grid = ALPHA_GRID if task_type == "regression" else C_GRID
    scores, fits = {}, {}
    for value in grid:
        model = estimator(task_type, value)
        with warnings.catch_warnings():  # a weakly regularised fit may stop at max_iter: still a valid candidate
            warnings.simplefilter("ignore")
            model.fit(features["train"], labels["train"])
        scores[value] = compute_metrics(metric_names, model.predict(features["dev"]), labels["dev"])
        fits[value] = model
    chosen = max(grid, key=lambda v: sign * scores[v][main])  # the first best: ties go to stronger regularisation
    predictions = fits[chosen].predict(features["validation"])
    result = {
        "parameter": "alpha" if task_type == "regression" else "C",
        "grid": {str(v): scores[v][main] for v in grid},
        "chosen": chosen,
        "dev": scores[chosen],
        "validation": compute_metrics(metric_names, predictions, labels["validation"]),
    }
    if positions is not None:
        result["validation_by_position"] = accuracy_by_position(predictions, labels["validation"], positions)
    return result


def label_arrays(splits: dict) -> dict[str, np.ndarray]:
    """split → its `label` (or `labels`) column as an array."""
    return {
        name: np.asarray(split["labels" if "labels" in split.column_names else "label"])
        for name, split in splits.items()
    }
