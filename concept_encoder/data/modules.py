"""`--dataset modules`: long documents, one per module file of the installed third-party packages.

A Concept Encoder's reason to exist is long input, and the other offline corpora are short (`embedded`: a
paragraph of CPython's documentation; `docstrings`: one docstring). Here every `.py` file an installed
distribution lists (the same files, exclusions and bounds as the docstring corpus, `docstrings.py`) becomes one
document: its docstrings and comments in source order, as the file's author wrote about it from top to bottom.

- **What is read**: module, class and function docstrings (`ast`, no code imported or run) and comments
  (`tokenize`); consecutive whole-line comments form one paragraph (a comment after code stands alone); tool directives (`# noqa`, `# type:`,
  `# pragma`, `# fmt:`, `# pylint:`, shebang and coding lines) and comments of fewer than `MIN_COMMENT_WORDS`
  words (commented-out code is mostly short) are left out.
- **Each paragraph once** across the corpus, by normalised text, first occurrence kept: the license header
  repeated atop thousands of files and vendored copies appear once. A paragraph that begins with an `embedded`
  task sentence is dropped (the long-document tasks are built from those sentences).
- **Long only**: a document keeps its file's remaining paragraphs in order and is kept when it has at least
  `MIN_DOCUMENT_WORDS` words (the corpus' length statistics: `python -m concept_encoder data --dataset modules`).
- **Cached** like the docstring corpus, under `<cache_dir>/datasets/modules-<key>` (files read and these rules).

Why hand-written: as for the docstring corpus, nothing reads an environment's sources without importing them.
"""

from __future__ import annotations

import ast
import io
import logging
import re
import tokenize
import warnings
from pathlib import Path

from tqdm.auto import tqdm

from ..constants import MODULES_DATASET
from .docstrings import (
    DOCSTRING_NODES,
    DocstringCorpus,
    SourceFile,
    cached_site_corpus,
    read_source,
    seen_or_task,
    task_sentence_keys,
)

logger = logging.getLogger(__name__)

MIN_COMMENT_WORDS = 4
MIN_DOCUMENT_WORDS = 800
RULES = ("modules", 2, MIN_COMMENT_WORDS, MIN_DOCUMENT_WORDS)  # part of the cache key: change with the rules
DIRECTIVE = re.compile(r"^(!|-\*-|noqa|type:|pragma|fmt:|pylint:|isort:|mypy:|ruff:|coding[:=]|vim:)", re.IGNORECASE)


def is_modules_spec(spec: str) -> bool:
    return spec == MODULES_DATASET or spec.startswith(f"{MODULES_DATASET}:")


def module_paragraphs(text: str) -> list[str]:
    """A module's docstrings and comment paragraphs in source order; SyntaxError or ValueError when it is not
    Python this interpreter reads (too deeply nested for `ast` included)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            tree = ast.parse(text)
        except (RecursionError, MemoryError) as error:
            raise ValueError(f"too deeply nested to parse ({type(error).__name__})") from None
    pieces = []  # (line, paragraph)
    for node in ast.walk(tree):
        if isinstance(node, DOCSTRING_NODES) and (doc := ast.get_docstring(node, clean=True)):
            pieces.append((node.body[0].lineno, doc.strip()))
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (tokenize.TokenError, SyntaxError) as error:
        raise ValueError(f"not tokenisable ({error})") from None
    group, last_line = [], -2
    for token in tokens:
        if token.type != tokenize.COMMENT:
            continue
        comment = token.string.lstrip("#").strip()
        if not comment or DIRECTIVE.match(comment):
            continue
        line = token.start[0]
        whole_line = token.line.lstrip().startswith("#")  # a comment after code stands alone
        if group and (line != last_line + 1 or not whole_line):
            pieces.append(comment_paragraph(group))
            group = []
        group.append((line, comment))
        last_line = line if whole_line else -2
    if group:
        pieces.append(comment_paragraph(group))
    return [paragraph for _, paragraph in sorted(pieces, key=lambda piece: piece[0])
            if paragraph and (paragraph.count(" ") + 1 >= MIN_COMMENT_WORDS or "\n" in paragraph)]  # fmt: skip


def comment_paragraph(group: list[tuple[int, str]]) -> tuple[int, str]:
    """Consecutive comment lines → (first line, their text joined); "" when too short to be prose."""
    text = " ".join(comment for _, comment in group)
    return group[0][0], text if len(text.split()) >= MIN_COMMENT_WORDS else ""


def extract(files: list[SourceFile]) -> tuple[list[str], dict]:
    """Documents (see the module docstring) and a manifest: documents, words, files read, what was dropped, and
    `document_packages`, the distribution each document's file belongs to (the `modules_package` task's labels),
    and `package_imports`, each such distribution's import names (the words that task removes)."""
    task_keys = task_sentence_keys()
    seen: set[bytes] = set()
    documents, origins, skipped, packages, imports = [], [], [], {}, {}
    dropped = {"repeated_paragraphs": 0, "task_sentences": 0, "short_documents": 0}
    words = 0
    for f in tqdm(files, desc="reading modules", unit="file", mininterval=2.0, disable=len(files) < 200):
        try:
            paragraphs = module_paragraphs(read_source(f.path))
        except (SyntaxError, ValueError) as error:
            skipped.append(f"{f.path}: {error.msg if isinstance(error, SyntaxError) else error}")
            continue
        kept = []
        for paragraph in paragraphs:
            if why := seen_or_task(paragraph, seen, task_keys):
                dropped["repeated_paragraphs" if why == "repeated" else "task_sentences"] += 1
                continue
            kept.append(paragraph)
        document = "\n\n".join(kept)
        count = len(document.split())
        if count < MIN_DOCUMENT_WORDS:
            dropped["short_documents"] += bool(kept)
            continue
        documents.append(document)
        origins.append(f.package)
        imports.setdefault(f.package, set()).add(f.top_level)
        words += count
        entry = packages.setdefault(f.package, {"version": f.version, "documents": 0})
        entry["documents"] += 1
    for path in skipped:
        logger.warning("modules corpus: skipped %s", path)
    manifest = {"documents": len(documents), "words": words, "files_read": len(files) - len(skipped),
                "min_document_words": MIN_DOCUMENT_WORDS, "dropped": dropped, "skipped_files": skipped,
                "packages": {name: packages[name] for name in sorted(packages, key=str.lower)},
                "document_packages": origins,
                "package_imports": {name: sorted(found) for name, found in sorted(imports.items())}}  # fmt: skip
    return documents, manifest


def module_corpus(spec: str, cache_dir: str | Path | None = "Cache") -> DocstringCorpus:
    """The long documents of `modules` / `modules:<site-packages folder>`, cached per fingerprint."""
    return cached_site_corpus(spec, MODULES_DATASET, RULES, extract, cache_dir,
                              f"no module has {MIN_DOCUMENT_WORDS} words of docstrings and comments")  # fmt: skip
