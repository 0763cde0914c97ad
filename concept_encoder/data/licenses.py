"""`--dataset licenses`: the license texts of the installed packages, offline English of another domain.

The pretraining corpora are technical prose about Python (`embedded` is CPython's documentation,
`docstrings` the packages' docstrings); legal English is a different register and vocabulary, and every
environment that runs this project has some. It is the held-out language check's default text:
`python -m concept_encoder check_health MODEL --text licenses`, `ablate --heldout licenses`.

Every LICENSE / LICENCE / COPYING / NOTICE file an installed distribution lists in its RECORD
(`licenses:<site-packages folder>` reads another folder), in a fixed order (distributions by name, files
by path), cut into paragraphs at blank lines. A paragraph of at least `MIN_WORDS` words is kept once,
by its normalised text (the same MIT or Apache-2.0 paragraph ships in dozens of packages); consecutive
kept paragraphs are grouped into documents of at least `DOCUMENT_WORDS` words. Files that are not UTF-8
are skipped. Nothing is cached: reading a few hundred small files takes about a second.
"""

from __future__ import annotations

from pathlib import Path

from ..constants import LICENSES_DATASET
from .base import DataSourceError, group_paragraphs, paragraphs_of
from .docstrings import digest, installed_files, normalised, site_fingerprint, site_roots

MIN_WORDS = 8  # "Copyright (c) 2020 Someone" lines and headings carry little language
DOCUMENT_WORDS = 120


def is_licenses_spec(spec: str) -> bool:
    return spec == LICENSES_DATASET or spec.startswith(f"{LICENSES_DATASET}:")


def license_paragraphs(paths: list[Path], min_words: int = MIN_WORDS) -> list[str]:
    """The distinct paragraphs (by normalised text) of at least `min_words` words of `paths`, in order;
    files that are not UTF-8 are skipped."""
    seen: set[bytes] = set()
    kept = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        for paragraph in paragraphs_of(text):
            if len(paragraph.split()) < min_words:
                continue
            key = digest(normalised(paragraph))
            if key not in seen:
                seen.add(key)
                kept.append(paragraph)
    return kept


def license_documents(spec: str) -> list[str]:
    """The documents of `licenses` / `licenses:<folder>`; DataSourceError when there is no license text."""
    roots = site_roots(spec)
    files, _ = installed_files(roots, kind="license")
    documents = group_paragraphs(license_paragraphs([f.path for f in files]), DOCUMENT_WORDS)
    if not documents:
        raise DataSourceError(
            f"--dataset {spec!r}: no installed distribution under {', '.join(map(str, roots))} lists a license text "
            f"with a paragraph of {MIN_WORDS} words or more; pass another English text file instead"
        )
    return documents


def licenses_fingerprint(spec: str) -> str:
    """The cache key of `spec`'s text: every license file's path, size and modification time, and this
    module's rules (a changed rule changes the documents, so the block caches must not be reused)."""
    return site_fingerprint(spec, "license", ("licenses", MIN_WORDS, DOCUMENT_WORDS))
