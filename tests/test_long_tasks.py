"""The long-document tasks (tasks/long_documents.py): `needle:N` and `modules_package`, built from a generated
site-packages tree (the real corpus takes minutes to read)."""

import random
import re
from collections import Counter

import numpy as np
import pytest
from test_docstrings import prose, write_distribution

from concept_encoder.data.base import DataSourceError
from concept_encoder.tasks import TaskArguments, load_task
from concept_encoder.tasks.embedded import embedded_sentences
from concept_encoder.tasks.metrics import accuracy_by_position


def long_module(seed: int, paragraphs: int = 12, *, extra: str = "") -> bytes:
    """A module of `paragraphs` docstring/comment paragraphs (14 words each) and `extra` in its docstring."""
    functions = "".join(f'\n\ndef f{i}():\n    """{prose(seed * 100 + i)}"""\n' for i in range(paragraphs))
    return f'"""{prose(seed * 100 + 99)} {extra}"""\n{functions}'.encode()


@pytest.fixture
def long_site(tmp_path, monkeypatch):
    """Three packages of long modules (30+ words each, the bound lowered to 30), the working folder `tmp_path`."""
    from concept_encoder.data import modules
    from concept_encoder.tasks import long_documents

    monkeypatch.setattr(modules, "MIN_DOCUMENT_WORDS", 30)
    monkeypatch.setattr(long_documents, "MIN_CLASS_DOCUMENTS", 3)
    monkeypatch.chdir(tmp_path)
    root = tmp_path / "site-packages"
    root.mkdir()
    for k, name in enumerate(("torchy-core", "alpha-pkg", "beta")):
        files = {
            f"{name.replace('-', '_')}/m{i}.py": long_module(
                1000 * k + i, extra=f"See {name.replace('-', '_')}.sub.mod.fn() and TorchyCore, Alpha-pkg or BETA."
            )
            for i in range(4 + k)
        }
        write_distribution(root, name, "1.0", files)
    return f"modules:{root}"


def needle(task: str, corpus: str):
    return load_task(TaskArguments(task=task, long_corpus=corpus))


def test_needle_splits_inherit_embedded_and_hide_each_sentence_once_at_its_recorded_position(long_site):
    data = needle("needle:64", long_site)
    embedded = load_task(TaskArguments(task="embedded"))
    sentences, labels, _ = embedded_sentences()
    for split in ("train", "dev", "validation"):
        hidden, plain = getattr(data, split), getattr(embedded, split)
        assert list(hidden["id"]) == list(plain["id"]) and list(hidden["label"]) == list(
            plain["label"]
        )  # the same rows, split alike
        for text, row, position in zip(hidden["text_a"], hidden["id"], hidden["needle_position"], strict=True):
            words, sentence = text.split(), sentences[row].split()
            assert len(words) == 64 + len(sentence)  # N words of haystack plus the needle
            at = round(position * 64)  # the share of the haystack before the needle
            assert words[at : at + len(sentence)] == sentence, "the needle starts where needle_position says"
    ids = [set(getattr(data, s)["id"]) for s in ("train", "dev", "validation")]
    assert not (ids[0] & ids[1] or ids[0] & ids[2] or ids[1] & ids[2])
    texts = {s: {sentences[i] for i in getattr(data, s)["id"]} for s in ("train", "dev", "validation")}
    assert not (texts["train"] & texts["validation"] or texts["dev"] & texts["validation"])  # no sentence in two
    assert data.label_names == embedded.label_names
    assert data.validation_positions == list(data.validation["needle_position"])


def test_needle_positions_are_uniform_seeded_and_independent_of_the_label(long_site):
    first, again = needle("needle:40", long_site), needle("needle:40", long_site)
    assert list(first.train["text_a"]) == list(again.train["text_a"])  # seeded: the same haystacks and places
    positions = np.array([*first.train["needle_position"], *first.dev["needle_position"]])
    counts = np.histogram(positions, bins=4, range=(0, 1))[0]
    expected = len(positions) / 4
    assert ((counts - expected) ** 2 / expected).sum() < 16.3  # chi-square, 3 degrees of freedom, p = 0.001
    by_label = Counter(
        int(p * 4) for p, y in zip(positions, [*first.train["label"], *first.dev["label"]], strict=True) if y == 0
    )
    assert len(by_label) >= 4  # one class's needles are everywhere too
    other = needle("needle:48", long_site)
    assert list(other.train["needle_position"]) != list(first.train["needle_position"])  # another length, other draws


def test_needle_and_long_corpus_errors_name_the_form():
    for task in ("needle:abc", "needle:8", "needle:"):
        with pytest.raises(ValueError, match=r"haystack's length in words, a whole number >= 16"):
            TaskArguments(task=task)
    with pytest.raises(ValueError, match=r"long_corpus='docstrings': use modules or modules:<site-packages folder>"):
        TaskArguments(task="needle:64", long_corpus="docstrings")


def test_modules_package_labels_documents_by_package_with_the_names_removed(long_site):
    data = load_task(TaskArguments(task="modules_package", long_corpus=long_site))
    assert data.label_names == ["alpha-pkg", "beta", "torchy-core"]
    rows = [*data.train, *data.dev, *data.validation]
    assert Counter(r["label"] for r in rows) == {0: 5, 1: 6, 2: 4}  # every long module, by its package
    for row in rows:
        text = row["text_a"].lower()
        assert "See and" in row["text_a"] and "or" in text  # the sentence's other words stay
        for name in ("torchy", "alpha", "beta", ".sub.mod", "fn()"):
            assert name not in text, f"{name} gives the package away"
    assert data.validation_positions is None


def test_modules_package_needs_two_large_packages(long_site, monkeypatch):
    from concept_encoder.tasks import long_documents

    monkeypatch.setattr(long_documents, "MIN_CLASS_DOCUMENTS", 6)  # only beta has six
    with pytest.raises(DataSourceError, match="has 1 package.s. with 6. long documents; the task needs two"):
        load_task(TaskArguments(task="modules_package", long_corpus=long_site))


def test_accuracy_by_position_counts_each_bucket():
    rng = random.Random(0)
    positions = [rng.random() for _ in range(400)]
    labels = [rng.randrange(3) for _ in positions]
    predictions = [y if p >= 0.5 else (y + 1) % 3 for p, y in zip(positions, labels, strict=True)]
    buckets = accuracy_by_position(predictions, labels, positions, buckets=4)
    assert list(buckets) == ["0-25%", "25-50%", "50-75%", "75-100%"]
    assert [b["accuracy"] for b in buckets.values()] == [0.0, 0.0, 1.0, 1.0]
    assert sum(b["count"] for b in buckets.values()) == 400
    assert accuracy_by_position([1], [1], [1.0], buckets=4) == {"75-100%": {"accuracy": 1.0, "count": 1}}


def test_modules_spliced_pairs_halves_within_a_package_and_reads_each_half_once(long_site):
    from concept_encoder.tasks.long_documents import halves

    assert halves("a b c\n\nd e\n\nf g h i j k") == ("a b c\n\nd e", "f g h i j k")  # nearest the middle word
    assert halves("one paragraph only") is None
    data = load_task(TaskArguments(task="modules_spliced", long_corpus=long_site))
    assert data.label_names == ["crossed", "whole"]
    rows = [*data.train, *data.dev, *data.validation]
    assert len(rows) == 2 * (2 + 2 + 3)  # 4, 5 and 6 modules a package: 2, 2 and 3 pairs, two examples each
    heads, tails = Counter(), Counter()
    for row in rows:
        head, tail = halves(row["text_a"]) or (None, None)
        heads[head] += 1
        tails[tail] += 1
    assert max(heads.values()) == 1 and max(tails.values()) == 1  # no half read twice
    for row in rows:  # each paragraph of a generated module ends "number <module seed><two digits>."
        modules = {int(n) // 100 for n in re.findall(r"number (\d+)\.", row["text_a"])}
        assert len({m // 1000 for m in modules}) == 1, "both halves come from one package"
        assert len(modules) == (1 if row["label"] == 1 else 2), "whole: one module; crossed: two"
    assert {r["label"] for r in rows} == {0, 1}
