"""The embedded fine-tuning task: sentences of Python standard-library docstrings, labelled by package.

Offline and deterministic: the docstrings are read from this Python's standard-library source files
with `ast` (nothing is imported or executed), so the labels are real (where the text comes from) and
the pretraining corpus (the language reference in `pydoc_data`, see `concept_encoder.data.sources`)
does not give them away. Each example is the first paragraph of one docstring (a module, class or
function of the package), 5-60 words; each package contributes at most `PER_PACKAGE` examples, chosen
by a fixed-seed shuffle, so the classes are nearly balanced.

- `embedded`: single sentences, label = top-level package (9 classes).
- `embedded_pairs`: two sentences, label 1 when they come from the same package, else 0 (balanced).
"""

from __future__ import annotations

import ast
import random
import sysconfig
from pathlib import Path

# Packages present (as source) in CPython 3.11-3.13 with at least ~160 usable docstrings each.
PACKAGES = ("asyncio", "email", "idlelib", "importlib", "logging", "multiprocessing", "tkinter", "unittest", "xml")
PER_PACKAGE = 300
SEED = 1234  # fixed: the task must not change with the training seed


def docstring_paragraphs(package: str) -> list[str]:
    """First paragraphs (5-60 words, whitespace collapsed) of every docstring in `package`'s source, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"]) / package
    found = set()
    for path in sorted(root.rglob("*.py")):
        if {"test", "tests", "idle_test"} & set(path.relative_to(root).parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, OSError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                doc = ast.get_docstring(node)
                if doc:
                    first = " ".join(doc.strip().split("\n\n")[0].split())
                    if 5 <= len(first.split()) <= 60:
                        found.add(first)
    return sorted(found)


def embedded_sentences() -> tuple[list[str], list[int], list[str]]:
    """(texts, labels, label names) of the single-sentence task, in a fixed shuffled order."""
    rng = random.Random(SEED)
    examples = []
    for label, package in enumerate(PACKAGES):
        paragraphs = docstring_paragraphs(package)
        rng.shuffle(paragraphs)
        examples += [(text, label) for text in paragraphs[:PER_PACKAGE]]
    rng.shuffle(examples)
    texts, labels = zip(*examples, strict=True)
    return list(texts), list(labels), list(PACKAGES)


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
