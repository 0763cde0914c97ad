"""The standard-library docstring sentences: the `embedded` fine-tuning task's examples, and what the pretraining
corpora keep out.

Read from this Python's standard-library source files with `ast` (nothing is imported or executed). Each example
is the first paragraph (`first_paragraph`, the one rule for both uses) of one docstring of a module, class or
function of the package, 5-60 words; each package contributes at most `PER_PACKAGE` examples, chosen by a
fixed-seed shuffle. `tasks/embedded.py` labels them by package; `data/docstrings.py` drops any docstring whose first
paragraph is one of them, so the task's text cannot leak into pretraining.
"""

from __future__ import annotations

import ast
import functools
import random
import sysconfig
from pathlib import Path

# Packages present (as source) in CPython 3.11-3.13 with at least ~160 usable docstrings each.
PACKAGES = ("asyncio", "email", "idlelib", "importlib", "logging", "multiprocessing", "tkinter", "unittest", "xml")
PER_PACKAGE = 300
SEED = 1234  # fixed: the task must not change with the training seed


def first_paragraph(text: str) -> str:
    """The first paragraph (up to the first blank line) with whitespace collapsed."""
    return " ".join(text.split("\n\n")[0].split())


def docstring_paragraphs(package: str) -> list[str]:
    """First paragraphs (5-60 words, whitespace collapsed) of every docstring in `package`'s source, sorted."""
    return list(read_paragraphs(str(Path(sysconfig.get_paths()["stdlib"]) / package)))


@functools.cache  # the standard library does not change under a running process; parsing it takes a second or two
def read_paragraphs(folder: str) -> tuple[str, ...]:
    """`docstring_paragraphs` of the package at `folder`, read once per process (every task load asks)."""
    root = Path(folder)
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
                    first = first_paragraph(doc.strip())
                    if 5 <= len(first.split()) <= 60:
                        found.add(first)
    return tuple(sorted(found))


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
