"""The long-document tasks: inputs of thousands of tokens, built offline from the `modules` corpus.

- `needle:N`: a haystack of N words of long-corpus text with one `embedded` task sentence (the needle) inserted
  at a uniformly drawn word position; the label is the needle's class (the `embedded` package). The sentences
  are split exactly as `embedded` splits them (no sentence is in two splits); each haystack is drawn independently
  of the label (random documents joined, seeded by N and the split), so it carries no information about it. Each
  example keeps `needle_position`: the share of the haystack that comes before the needle (0: the needle opens
  the input, 1: it closes it), uniform over [0, 1].
  Lengths are in whitespace words so that every model and baseline reads the same text; with the default
  tokenizer (wordpiece, 8,000) this corpus runs about 1.9 tokens per word, so `needle:2048` is about 4k tokens.
- `modules_package`: which installed package a module's documentation (one `modules` document: its docstrings
  and comments in source order) comes from. Classes are the `PACKAGE_CLASSES` largest packages with at least
  `MIN_CLASS_DOCUMENTS` documents, at most `PER_CLASS` documents each (seeded); every word holding a
  class package's distribution or import name (`PyTorch`, `torch.nn`, `sklearn` for scikit-learn) and every
  dotted path (`a.b.c`, `obj.method(`) is removed, since either names the answer. Split like a local file without
  validation (`--validation_fraction`). A bag of words reads the package from the vocabulary: TF-IDF scores 0.95
  here (docs/long_context.md), at the ceiling, which is why the long-context driver's natural task is the next one.
- `modules_spliced`: is this one module's documentation, or the first half of one module joined to the second half
  of another module of the same package? Documents are paired within their package (seeded); a pair gives two
  examples, both whole (label 1) or both crossed (label 0), so no half is read twice. Each half is cut at the
  paragraph boundary nearest the middle. Both halves are on the package's topic: what tells a crossed document
  apart is order and coherence across the whole input, which a bag of words does not keep and a window of the
  first 512 tokens does not reach.

Both read `--long_corpus` (default `modules`, or `modules:<site-packages folder>`), cached like the corpus. The
pretraining corpus is the same text: a model pretrained on `modules` has read the haystacks and the documents (not
the needles, which the corpus drops, nor the labels); a twin from scratch has not, which is what the comparison
measures.
"""

from __future__ import annotations

import random
import re

from datasets import Dataset

from ..data.base import DataSourceError
from ..data.modules import module_corpus
from .arguments import MODULES_PACKAGE, MODULES_SPLICED, NEEDLE_PREFIX, needle_words
from .embedded import embedded_sentences

PACKAGE_CLASSES = 8
MIN_CLASS_DOCUMENTS = 40
PER_CLASS = 150
SEED = 4321  # fixed: the task must not change with the training seed
DOTTED = re.compile(r"\S*\w\.\w+\.\w\S*|\S*[A-Za-z_]\w*\.[a-z_]\w*\(\S*")  # a.b.c, obj.method(


def is_long_task(task: str) -> bool:
    return task.startswith(NEEDLE_PREFIX) or task == MODULES_PACKAGE


def haystack(documents: list[str], words: int, rng: random.Random) -> list[str]:
    """`words` words of text: documents drawn at random (with replacement) and joined, cut at `words`."""
    drawn: list[str] = []
    while len(drawn) < words:
        drawn += documents[rng.randrange(len(documents))].split()
    return drawn[:words]


def with_needles(split: Dataset, documents: list[str], words: int, name: str) -> Dataset:
    """`split` (`text_a` a sentence, `label`, `id`) with each sentence hidden in its own haystack of `words` words
    at a uniformly drawn position, kept as `needle_position` (the share of the haystack's words before the needle)."""
    rng = random.Random(f"{NEEDLE_PREFIX}{words}:{name}:{SEED}")  # str seeds are stable across runs and machines
    texts, positions = [], []
    for sentence in split["text_a"]:
        hay = haystack(documents, words, rng)
        at = rng.randint(0, words)  # the needle goes before word `at`: every place, both ends included
        texts.append(" ".join([*hay[:at], sentence, *hay[at:]]))
        positions.append(at / words)
    return split.remove_columns("text_a").add_column("text_a", texts).add_column("needle_position", positions)


def needle_splits(task: str, corpus: str, carve) -> tuple[Dataset, Dataset, list[str]]:
    """(train, validation, class names) of `needle:N`: `embedded`'s sentences split by `carve` as `embedded`
    splits them, each hidden in a haystack of the `corpus` documents."""
    words = needle_words(task)
    texts, labels, names = embedded_sentences()
    table = Dataset.from_dict({"text_a": texts, "label": labels, "id": list(range(len(texts)))})
    train, validation = carve(table)
    documents = module_corpus(corpus).documents
    return (
        with_needles(train, documents, words, "train"),
        with_needles(validation, documents, words, "validation"),
        names,
    )


def removed_names(text: str, pattern: re.Pattern) -> str:
    """`text` without the words `pattern` finds (package names, dotted paths), whitespace kept to one space."""
    return " ".join(word for word in DOTTED.sub(" ", text).split() if not pattern.search(word))


def name_pattern(names: list[str]) -> re.Pattern:
    """Any word holding one of `names` (distribution names also with `_` or nothing for `-`; import names), in
    any case: `torch` also finds `PyTorch` and `torch.nn`."""
    variants = {v for n in names for v in (n, n.replace("-", "_"), n.replace("-", "")) if len(v) >= 3}
    return re.compile("|".join(sorted(map(re.escape, variants), key=len, reverse=True)), re.IGNORECASE)


def documents_by_package(corpus: str) -> tuple[dict[str, list[str]], dict]:
    """The `corpus` documents grouped by the package each comes from (in corpus order), and its manifest."""
    source = module_corpus(corpus)
    origins = source.manifest.get("document_packages")
    if origins is None or len(origins) != len(source.documents):
        raise DataSourceError(f"{corpus}: the cached corpus does not record each document's package; remove it")
    by_package: dict[str, list[str]] = {}
    for document, package in zip(source.documents, origins, strict=True):
        by_package.setdefault(package, []).append(document)
    return by_package, source.manifest


def shuffled_table(texts: list[str], labels: list[int], rng: random.Random) -> Dataset:
    """`text_a`, `label` and `id` (the row) of the examples in an order drawn from `rng`."""
    order = list(range(len(texts)))
    rng.shuffle(order)
    table = {"text_a": [texts[i] for i in order], "label": [labels[i] for i in order], "id": list(range(len(order)))}
    return Dataset.from_dict(table)


def modules_package_table(corpus: str) -> tuple[Dataset, list[str]]:
    """(table with `text_a`, `label`, `id`; class names) of `modules_package` from the `corpus` documents."""
    by_package, manifest = documents_by_package(corpus)
    large = sorted(
        (p for p, d in by_package.items() if len(d) >= MIN_CLASS_DOCUMENTS), key=lambda p: (-len(by_package[p]), p)
    )
    names = sorted(large[:PACKAGE_CLASSES], key=str.lower)
    if len(names) < 2:
        raise DataSourceError(
            f"--task {MODULES_PACKAGE}: {corpus} has {len(names)} package(s) with {MIN_CLASS_DOCUMENTS}+ long "
            "documents; the task needs two; point --long_corpus modules:<folder> at a site-packages folder with more"
        )
    imports = manifest.get("package_imports", {})
    rng, pattern = random.Random(SEED), name_pattern([*names, *(i for n in names for i in imports.get(n, []))])
    texts, labels = [], []
    for label, package in enumerate(names):
        chosen = rng.sample(by_package[package], min(PER_CLASS, len(by_package[package])))
        texts += [removed_names(document, pattern) for document in chosen]
        labels += [label] * len(chosen)
    return shuffled_table(texts, labels, rng), names


def halves(document: str) -> tuple[str, str] | None:
    """`document` cut at the paragraph boundary nearest its middle word; None for a single paragraph."""
    paragraphs = document.split("\n\n")
    if len(paragraphs) < 2:
        return None
    counts = [len(p.split()) for p in paragraphs]
    total, running, best = sum(counts), 0, (float("inf"), 1)
    for cut in range(1, len(paragraphs)):
        running += counts[cut - 1]
        best = min(best, (abs(running - total / 2), cut))
    cut = best[1]
    return "\n\n".join(paragraphs[:cut]), "\n\n".join(paragraphs[cut:])


def modules_spliced_table(corpus: str) -> tuple[Dataset, list[str]]:
    """(table with `text_a`, `label`, `id`; class names) of `modules_spliced` (see the module docstring)."""
    documents, _ = documents_by_package(corpus)
    by_package = {package: [p for d in found if (p := halves(d)) is not None] for package, found in documents.items()}
    rng = random.Random(SEED + 1)
    texts, labels = [], []
    for package in sorted(by_package):
        documents = by_package[package]
        rng.shuffle(documents)
        for (head_a, tail_a), (head_b, tail_b) in zip(documents[0::2], documents[1::2], strict=False):
            whole = rng.random() < 0.5
            texts += [f"{head_a}\n\n{tail_a if whole else tail_b}", f"{head_b}\n\n{tail_b if whole else tail_a}"]
            labels += [int(whole)] * 2
    if len(set(labels)) < 2:
        raise DataSourceError(
            f"--task {MODULES_SPLICED}: {corpus} has too few long documents of one package to pair ({len(texts)} "
            "examples); point --long_corpus modules:<folder> at a site-packages folder with more"
        )
    return shuffled_table(texts, labels, rng), ["crossed", "whole"]
