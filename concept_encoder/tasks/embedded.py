"""The embedded fine-tuning tasks: sentences of Python standard-library docstrings, labelled by package.

Offline and deterministic: the sentences (`concept_encoder/data/stdlib_sentences.py`: first paragraphs of stdlib
docstrings, read with `ast`, nothing imported or executed) are real text whose label is where it comes from, and
the pretraining corpora (`pydoc_data`'s language reference; the docstring corpus, which drops every one of these
sentences) do not give them away. Each package contributes at most `PER_PACKAGE` examples, so the classes are
nearly balanced.

- `embedded`: single sentences, label = top-level package (9 classes).
- `embedded_pairs`: two sentences, label 1 when they come from the same package, else 0 (balanced).
"""

from __future__ import annotations

import random

from ..data.stdlib_sentences import PACKAGES, SEED, embedded_sentences

__all__ = ["PACKAGES", "embedded_pairs", "embedded_sentences"]  # the sentences are the task's too


def embedded_pairs() -> tuple[list[str], list[str], list[int]]:
    """(first texts, second texts, labels) of the pair task: as many pairs as sentences, half of them
    from one package (label 1), half from two different packages (label 0)."""
    texts, labels, _ = embedded_sentences()
    rng = random.Random(SEED + 1)
    by_label: dict[int, list[str]] = {}
    for text, label in zip(texts, labels, strict=True):
        by_label.setdefault(label, []).append(text)
    firsts, seconds, same = [], [], []
    for i, (text, label) in enumerate(zip(texts, labels, strict=True)):
        if i % 2 == 0:
            partner = rng.choice([t for t in by_label[label] if t != text])
        else:
            other = rng.choice([x for x in by_label if x != label])
            partner = rng.choice(by_label[other])
        firsts.append(text)
        seconds.append(partner)
        same.append(int(i % 2 == 0))
    return firsts, seconds, same
