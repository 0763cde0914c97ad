"""Baselines beside every fine-tuning number, on exactly the task's rows: the trivial predictor (majority
class / mean score) and a strong simple one, TF-IDF of word unigrams and bigrams + a linear model
(LogisticRegression, or Ridge for regression) with its regularisation chosen on the dev split.

A neural number means little until it beats a bag of words: on `embedded` this baseline is hard to beat.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..common.paths import written_aside
from .linear import fit_linear, label_arrays
from .metrics import baseline_predictions, compute_metrics

TFIDF_NAME = "TF-IDF (word 1-2 grams) + linear"


def split_rows(split) -> dict:
    """The rows a split holds: their count and a digest of their `id`s (each the row of the task's source
    table), in order: equal digests, equal rows."""
    ids = ",".join(str(i) for i in split["id"])
    return {"count": len(split), "ids_sha256": hashlib.sha256(ids.encode()).hexdigest()}


def tfidf_features(task) -> dict:
    """split → TF-IDF matrix `[n,F]`, the vectorizer fitted on the training split's texts only. A pair is
    `[tfidf(a), tfidf(b), tfidf(a) * tfidf(b)]`: each text, and the n-grams they share (what "same
    package?" needs and a linear model cannot form from the two halves alone)."""
    from scipy.sparse import hstack
    from sklearn.feature_extraction.text import TfidfVectorizer

    splits = {"train": task.train, "dev": task.dev, "validation": task.validation}
    texts = list(task.train["text_a"]) + (list(task.train["text_b"]) if task.pair else [])
    # a symbolic task's words are its symbols (`[MAX`, `7`): sklearn's default pattern drops one-character tokens
    words = {"token_pattern": r"\S+", "lowercase": False} if getattr(task, "symbolic", False) else {}
    vectorizer = TfidfVectorizer(ngram_range=(1, 2), sublinear_tf=True, min_df=1, **words).fit(texts)
    features = {}
    for name, split in splits.items():
        a = vectorizer.transform(list(split["text_a"]))
        if task.pair:
            b = vectorizer.transform(list(split["text_b"]))
            a = hstack([a, b, a.multiply(b)]).tocsr()
        features[name] = a
    return features


def task_digest(task) -> str:
    """A digest of everything the baselines depend on: the task's name, type, metrics and every split's rows."""
    hasher = hashlib.sha256(json.dumps([task.name, task.task_type, list(task.metric_names)]).encode())
    for split in (task.train, task.dev, task.validation):
        hasher.update(json.dumps(split.to_dict(), sort_keys=True, default=str).encode())
    return hasher.hexdigest()[:16]


def task_baselines(task, cache_dir: str | Path | None = None) -> dict:
    """`{"majority": validation metrics, "tfidf": fit_linear's result + "rows"}` on the task's splits. With
    `cache_dir`, kept in `<cache_dir>/baselines/<task>-<digest of its rows>.json` (the TF-IDF C grid takes
    half a minute on `embedded`; every fine-tuning invocation, e.g. each point of a learning curve, needs it)."""
    path = None if cache_dir is None else Path(cache_dir) / "baselines" / f"{task.name}-{task_digest(task)}.json"
    if path is not None and path.is_file():
        return json.loads(path.read_text())
    splits = {"train": task.train, "dev": task.dev, "validation": task.validation}
    labels = label_arrays(splits)
    majority = compute_metrics(
        task.metric_names,
        baseline_predictions(task.task_type, labels["train"], len(labels["validation"])),
        labels["validation"],
    )
    tfidf = fit_linear(task.task_type, task.metric_names, tfidf_features(task), labels,
                       positions=task.validation_positions)  # fmt: skip
    tfidf["rows"] = {name: split_rows(split) for name, split in splits.items()}
    tfidf["name"] = TFIDF_NAME
    result = {"majority": majority, "tfidf": tfidf}
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with written_aside(path) as partial:  # ranks may write at once: each its own partial file
            partial.write_text(json.dumps(result, indent=2, default=float))
        result = json.loads(path.read_text())  # as a later invocation will read it (JSON keys and numbers)
    return result
