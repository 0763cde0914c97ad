"""The docstring corpus (`--dataset docstrings[:folder]`) on a fake site-packages tree: what is read, what
is left out (stdlib names, short or duplicated docstrings, task sentences, undecodable files), order,
cache key and the statistics a run records; and the license texts (`--dataset licenses[:folder]`) read from the
same kind of tree."""

import random
import sysconfig
import time
from pathlib import Path

import pytest

from concept_encoder.data import DataArguments, DataSourceError, load_raw_dataset, prepare_data
from concept_encoder.data.docstrings import docstring_corpus, installed_files, normalised, site_roots
from concept_encoder.data.sources import source_fingerprint
from concept_encoder.tasks.embedded import embedded_sentences

VOCABULARY = "tensor gradient module layer shape batch vector matrix token concept model value".split()


def prose(seed: int, words: int = 14) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(VOCABULARY) for _ in range(words)).capitalize() + f" number {seed}."


def write_distribution(root, name: str, version: str, files: dict[str, bytes]) -> None:
    """A package as pip leaves it: its files, and a dist-info folder whose RECORD lists them."""
    for relative, content in files.items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content)
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text("".join(f"{relative},,\n" for relative in [*files, f"{info.name}/METADATA"]))


def module(docstring: str, functions: dict[str, str]) -> bytes:
    body = "".join(f'\n\ndef {name}():\n    """{doc}"""\n' for name, doc in functions.items())
    return f'"""{docstring}"""\n{body}'.encode()


@pytest.fixture
def site(tmp_path):
    """Two packages, a stdlib backport, a vendored task sentence, a duplicate, a latin-1 file with and without
    its coding cookie, a short docstring and a script outside the tree."""
    root = tmp_path / "site-packages"
    root.mkdir()
    task_sentence = embedded_sentences()[0][0]
    write_distribution(root, "zeta-pkg", "2.0", {
        "zeta_pkg/__init__.py": module(prose(1), {"f": prose(2), "g": "Too short to keep."}),
        "zeta_pkg/copy.py": module(prose(1), {"h": prose(2).upper().replace(".", " !")}),  # exact, normalised
        "zeta_pkg/vendored.py": module(task_sentence + "\n\nMore text of a vendored stdlib copy here.", {}),
        "zeta_pkg/latin.py": f'"""{prose(3)} caf\xe9."""\n'.encode("latin-1"),
        "zeta_pkg/cookie.py": f'# -*- coding: latin-1 -*-\n"""{prose(4)} caf\xe9."""\n'.encode("latin-1"),
        "../../bin/zeta-tool": b"#!python\n",
    })  # fmt: skip
    write_distribution(root, "alpha-pkg", "1.5", {
        f"alpha_pkg/m{i}.py": module(prose(100 + i), {f"f{j}": prose(1000 + 10 * i + j) for j in range(8)})
        for i in range(8)
    })  # fmt: skip
    write_distribution(root, "json-backport", "0.1", {"json/__init__.py": module(prose(9), {})})
    return root, task_sentence


def test_reader_keeps_third_party_prose_and_names_what_it_leaves_out(site):
    root, task_sentence = site
    corpus = docstring_corpus(f"docstrings:{root}", cache_dir=None)
    docs, manifest = corpus.documents, corpus.manifest
    assert list(manifest["packages"]) == ["alpha-pkg", "zeta-pkg"]  # json-backport shadows the stdlib
    assert manifest["packages"]["alpha-pkg"] == {"version": "1.5", "files": 8, "documents": 72}
    assert manifest["packages"]["zeta-pkg"] == {"version": "2.0", "files": 4, "documents": 3}
    assert prose(9) not in docs
    # deterministic order: distributions by name, files by path, module docstring before its functions
    assert docs[:2] == [prose(100), prose(1000)] and docs[-3:] == [prose(1), prose(2), prose(4) + " café."]
    assert manifest["dropped"] == {"short": 1, "exact_duplicates": 1, "normalised_duplicates": 1, "task_sentences": 1}
    assert not any(normalised(task_sentence) in normalised(d) for d in docs)
    assert len(set(map(normalised, docs))) == len(docs) == manifest["documents"]
    assert manifest["words"] == sum(len(d.split()) for d in docs)
    [skipped] = manifest["skipped_files"]  # latin-1 bytes without a cookie: named, with the byte offset
    assert skipped.startswith(str(root / "zeta_pkg" / "latin.py")) and "not utf-8 text (byte" in skipped
    assert docstring_corpus(f"docstrings:{root}", cache_dir=None).documents == docs


def test_corpus_is_cached_by_the_files_it_reads(site, tmp_path):
    root, _ = site
    spec = f"docstrings:{root}"
    first = docstring_corpus(spec, cache_dir=tmp_path / "cache")
    key = first.manifest["fingerprint"]
    assert source_fingerprint(spec) == key
    assert (tmp_path / "cache" / "datasets" / f"docstrings-{key}" / "documents.jsonl").exists()
    assert docstring_corpus(spec, cache_dir=tmp_path / "cache").documents == first.documents  # read back
    time.sleep(0.01)
    (root / "alpha_pkg" / "m0.py").write_bytes(module(prose(555), {}))  # a package file changes
    assert source_fingerprint(spec) != key
    changed = docstring_corpus(spec, cache_dir=tmp_path / "cache")
    assert prose(555) in changed.documents and prose(100) not in changed.documents


def test_docstrings_feed_the_pipeline_with_packages_and_versions_in_the_stats(site, tmp_path):
    root, _ = site
    raw = load_raw_dataset(f"docstrings:{root}", validation_split_percentage=10)
    assert len(raw["train"]) + len(raw["validation"]) == 75 and len(raw["validation"]) >= 7
    args = DataArguments(dataset=f"docstrings:{root}", tokenizer="train:wordpiece:300", max_seq_length=32,
                         validation_split_percentage=10)  # fmt: skip
    data = prepare_data(args, cache_dir=tmp_path / "cache")
    source = data.stats["source"]
    assert {name: p["version"] for name, p in source["packages"].items()} == {"alpha-pkg": "1.5", "zeta-pkg": "2.0"}
    assert source["documents"] == 75 and data.stats["train"]["examples"] > 0
    assert data.tokenizer.cls_token_id == data.train[0]["input_ids"][0]  # blocks start with [CLS]


def test_bad_docstring_sources_say_what_to_do(tmp_path):
    with pytest.raises(DataSourceError, match="is not a folder; give a site-packages folder"):
        docstring_corpus(f"docstrings:{tmp_path / 'missing'}", cache_dir=None)
    empty = tmp_path / "empty"
    empty.mkdir()
    write_distribution(empty, "json-backport", "0.1", {"json/__init__.py": module(prose(9), {})})
    with pytest.raises(DataSourceError, match="no third-party .py file found under .*stdlib files are excluded"):
        docstring_corpus(f"docstrings:{empty}", cache_dir=None)
    terse = tmp_path / "terse"
    terse.mkdir()
    write_distribution(terse, "terse-pkg", "1.0", {"terse_pkg/__init__.py": module("Short.", {})})
    with pytest.raises(DataSourceError, match="no docstring has 8 words or more"):
        docstring_corpus(f"docstrings:{terse}", cache_dir=None)


def test_the_installed_environment_is_read_from_its_records_without_the_stdlib():
    files, _ = installed_files(site_roots("docstrings"))
    assert {"torch", "transformers", "datasets"} <= {f.package.lower() for f in files}
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    assert not any(f.path.is_relative_to(stdlib) and "site-packages" not in f.path.parts for f in files)


APACHE = "Licensed under the Apache License, Version 2.0 (the License); you may not use this file except\nin compliance with the License."


def test_license_texts_are_read_once_per_paragraph_in_a_fixed_order(tmp_path):
    from concept_encoder.data.licenses import DOCUMENT_WORDS, license_documents

    root = tmp_path / "site-packages"
    root.mkdir()
    unique = [prose(i, words=30) for i in range(12)]
    write_distribution(root, "zeta-pkg", "2.0", {
        "zeta_pkg/__init__.py": module(prose(1), {}),
        "zeta_pkg/license.py": module("LICENSE module: code, not a license text " + prose(2), {}),
        "zeta-2.0.dist-info/licenses/LICENSE.txt": f"Copyright (c) 2020 Zeta\n\n{APACHE}\n\n{unique[0]}\n".encode(),
        "zeta_pkg/COPYING": f"{unique[1]}\n\ncaf\xe9".encode("latin-1"),  # not UTF-8: skipped whole
    })  # fmt: skip
    write_distribution(root, "alpha-pkg", "1.5", {
        "LICENSE": ("\n\n".join([APACHE.upper().replace("\n", " "), *unique[2:]]) + "\n").encode(),
        "NOTICE.md": f"{unique[2]}\n".encode(),  # a paragraph already read
    })  # fmt: skip
    docs = license_documents(f"licenses:{root}")
    paragraphs = [p for doc in docs for p in doc.split("\n\n")]
    # alpha-pkg first (distributions by name); the Apache paragraph once (normalised), the short line and the
    # .py file and the latin-1 COPYING not at all
    assert paragraphs == [APACHE.upper().replace("\n", " "), *unique[2:], unique[0]]
    assert all(len(doc.split()) >= DOCUMENT_WORDS for doc in docs[:-1])
    assert load_raw_dataset(f"licenses:{root}", validation_split_percentage=10)["train"].num_rows >= 1

    before = source_fingerprint(f"licenses:{root}")
    time.sleep(0.01)
    (root / "NOTICE.md").write_text(unique[3] + " changed\n")
    assert source_fingerprint(f"licenses:{root}") != before  # block caches see the new text


def test_the_license_texts_cache_key_carries_their_reading_rules(tmp_path, monkeypatch):
    from concept_encoder.data import licenses

    root = tmp_path / "site-packages"
    root.mkdir()
    write_distribution(root, "alpha-pkg", "1.5", {"LICENSE": (prose(1, words=30) + "\n").encode()})
    before = source_fingerprint(f"licenses:{root}")
    monkeypatch.setattr(licenses, "MIN_WORDS", 40)  # other rules, other documents: not the same cache entry
    assert source_fingerprint(f"licenses:{root}") != before


def test_no_license_text_is_one_clear_error(tmp_path):
    root = tmp_path / "site-packages"
    root.mkdir()
    write_distribution(root, "bare", "1.0", {"bare/__init__.py": module(prose(1), {}), "LICENSE": b"MIT\n"})
    with pytest.raises(DataSourceError, match="no installed distribution .* lists a license text"):
        load_raw_dataset(f"licenses:{root}")
    with pytest.raises(DataSourceError, match="is not a folder"):
        load_raw_dataset(f"licenses:{tmp_path / 'missing'}")


def test_links_out_of_the_folder_are_not_followed_and_huge_or_too_deep_files_are_skipped_and_named(
    tmp_path, monkeypatch
):
    from concept_encoder.data import docstrings
    from concept_encoder.data.licenses import license_documents

    outside = tmp_path / "outside"
    (outside / "private").mkdir(parents=True)
    secret = "Secret text outside the folder that must never reach the corpus, kept private here."
    (outside / "secret.py").write_text(f'"""{secret}"""\n')
    (outside / "private" / "inner.py").write_text(f'"""{secret} Inner."""\n')
    (outside / "LICENSE").write_text(f"{secret}\n")
    root = tmp_path / "site-packages"
    root.mkdir()
    deep = "x = " + "(" * 200 + "1" + ")" * 200 + "\n" + "y = " + "-" * 100_000 + "1\n"
    write_distribution(root, "kept", "1.0", {"kept/__init__.py": module(prose(5), {}), "kept/deep.py": deep.encode(),
                                             "kept/huge.py": module(prose(6), {}) + b"#" * 300_000})  # fmt: skip
    write_distribution(root, "links", "1.0", {"links/__init__.py": module(prose(7), {})})
    (root / "links" / "secret.py").symlink_to(outside / "secret.py")  # a linked file
    (root / "links" / "private").symlink_to(outside / "private", target_is_directory=True)  # a linked folder
    (root / "links" / "LICENSE").symlink_to(outside / "LICENSE")
    record = root / "links-1.0.dist-info" / "RECORD"
    record.write_text(record.read_text() + "links/secret.py,,\nlinks/private/inner.py,,\nlinks/LICENSE,,\n")
    monkeypatch.setattr(docstrings, "MAX_FILE_BYTES", 200_000)  # huge.py is over it, deep.py (100 kB) under
    monkeypatch.setattr(docstrings, "_listings", {})

    corpus = docstring_corpus(f"docstrings:{root}", cache_dir=None)
    assert not any("Secret text" in d for d in corpus.documents)
    assert corpus.documents == [prose(5), prose(7)]  # deep.py (RecursionError in ast) ended no more than itself
    notes = "\n".join(corpus.manifest["notes"])
    assert "links/secret.py: a link to" in notes and "links/private/inner.py: a link to" in notes
    assert f"huge.py: {len(module(prose(6), {})) + 300_000:,} bytes, over the 200,000-byte bound" in notes
    [deep_skipped] = corpus.manifest["skipped_files"]
    assert "deep.py: too deeply nested to parse" in deep_skipped
    with pytest.raises(DataSourceError, match="no installed distribution .* lists a license text"):
        license_documents(f"licenses:{root}")  # the only license text is a link out of the folder


def test_the_long_document_corpus_reads_each_module_in_source_order_once_per_paragraph(tmp_path, monkeypatch):
    from concept_encoder.data import modules

    monkeypatch.setattr(modules, "MIN_DOCUMENT_WORDS", 30)  # the tree's modules are short
    root = tmp_path / "site-packages"
    root.mkdir()
    header = "# Copyright 2024 The Example Authors. Licensed under the Apache License, Version 2.0.\n"
    task_sentence = embedded_sentences()[0][0]

    def source(i: int) -> bytes:
        return (
            f'{header}# -*- coding: utf-8 -*-\n"""{prose(10 * i)}"""\n\n'
            f"# {prose(10 * i + 1)}\n# which goes on in a second comment line\nimport os  # noqa: F401\n\n"
            f'def f():\n    """{prose(10 * i + 2)}"""\n    # x = 1\n    return os.sep  # {prose(10 * i + 3)}\n'
        ).encode()

    write_distribution(root, "beta-pkg", "1.0", {
        "beta_pkg/a.py": source(1),
        "beta_pkg/b.py": source(2),
        "beta_pkg/tiny.py": b'"""Too short."""\n',
        "beta_pkg/task.py": f'"""{task_sentence}"""\n# {prose(90)}\n'.encode(),
    })  # fmt: skip
    corpus = modules.module_corpus(f"modules:{root}", cache_dir=None)
    first, second = corpus.documents
    assert first.split("\n\n") == [
        header[2:].strip(),
        prose(10),
        f"{prose(11)} which goes on in a second comment line",
        prose(12),
        prose(13),
    ]  # source order: header, module docstring, a two-line comment as one paragraph, function docstring, comment
    assert second.split("\n\n") == [prose(20), f"{prose(21)} which goes on in a second comment line", prose(22),
                                    prose(23)]  # the license header once across the corpus  # fmt: skip
    assert corpus.manifest["dropped"] == {"repeated_paragraphs": 1, "task_sentences": 1, "short_documents": 1}
    assert not any(task_sentence in d for d in corpus.documents) and "noqa" not in first and "x = 1" not in first
    assert source_fingerprint(f"modules:{root}") != source_fingerprint(f"docstrings:{root}")  # own cache key
