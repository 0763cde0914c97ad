"""The documentation names only what exists: every `make` target, `python -m` command, script path and relative
link in README.md, docs/ and the folder READMEs; and the front page stays a front page."""

import importlib.util
import re
from pathlib import Path

import pytest

from concept_encoder.__main__ import TOOLS

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted(
    [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / f / "README.md" for f in ("launch", "benchmarks"))]
)
FENCE = re.compile(r"^```.*?^```", re.M | re.S)
SPAN = re.compile(r"`([^`\n]+)`")
MAKE = re.compile(r"(?:^|[;&|(]\s*|\$ )make\s+([a-z][\w-]*)(?![\w<-])")  # `make train-<profile>`: a placeholder
MODULE = re.compile(r"python -m (concept_encoder[\w.]*)((?:\s+[a-z_]+)?)")
SCRIPT = re.compile(
    r"(?<![\w/.])((?:loops|launch|benchmarks|concept_encoder|ds_configs|tests)/[\w/.-]+\.(?:py|json|yaml))"
)
LINK = re.compile(r"\]\(([^)#\s]*)(#[^)\s]*)?\)")


def code_of(text: str) -> list[str]:
    """The lines of fenced blocks and the inline code spans outside them: where commands are written."""
    blocks = [line for block in FENCE.findall(text) for line in block.splitlines()[1:-1]]
    return blocks + SPAN.findall(FENCE.sub("", text))


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([a-z0-9][\w-]*):(?!=)", (ROOT / "Makefile").read_text(), re.M))


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation but `-`/`_` dropped, spaces to `-`."""
    headings = re.findall(r"^#+\s+(.*)$", FENCE.sub("", page.read_text()), re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_the_pages_exist_and_the_front_page_is_short_and_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300, "README.md is the front page: move detail to docs/"
    for page in (ROOT / "docs").glob("*.md"):
        assert f"docs/{page.name}" in readme, f"README.md does not link docs/{page.name}"
    assert len(PAGES) >= 8


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_make_target_and_python_module_a_page_names_exists(page):
    targets, code = makefile_targets(), code_of(page.read_text())
    named_targets = {t for line in code for t in MAKE.findall(line)}
    assert named_targets - targets == set(), f"{page.relative_to(ROOT)} names make targets the Makefile lacks"
    for line in code:
        for module, tool in MODULE.findall(line):
            if module == "concept_encoder" and tool.strip():
                assert tool.strip() in TOOLS, f"{page.name}: `python -m concept_encoder {tool.strip()}` is no tool"
            else:
                spec = importlib.util.find_spec(module)
                runnable = spec and (spec.origin or "").endswith(".py")
                assert runnable, f"{page.name}: `python -m {module}` names no module"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_and_link_a_page_names_exists(page):
    text = page.read_text()
    for path in {p for line in code_of(text) for p in SCRIPT.findall(line)}:
        if "<" not in path and "*" not in path:
            assert (ROOT / path).exists(), f"{page.name} names {path}, which does not exist"
    for target, anchor in LINK.findall(text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        linked = (page.parent / target).resolve() if target else page
        assert linked.exists(), f"{page.name} links {target}, which does not exist"
        if anchor and linked.suffix == ".md":
            assert anchor[1:] in anchors(linked), f"{page.name} links {target}{anchor}: no such heading"


def test_the_checker_sees_commands_and_misses_prose():
    code = code_of(
        "Run `make train` or\n```bash\nmake curve TOKENS=1M && make plan\n.venv/bin/python -m concept_encoder ablate\n```\nto make sense"
    )
    assert {t for line in code for t in MAKE.findall(line)} == {"train", "curve", "plan"}
    assert [m for line in code for m in MODULE.findall(line)] == [("concept_encoder", " ablate")]
