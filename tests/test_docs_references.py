"""Every reference the code makes to documentation resolves inside the repository.

Users have only the repository: a citation such as `docs/authors.md §2.5` or
`docs/honest_rl.md rule 4` must name a page and a section heading that exist, and nothing may
cite notes that are not shipped (the research notes the project was built from)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
_SOURCES = ("cleaner_jax", "tests", "bench", "launch", "configs", "notebooks", "data", "docs")
_SUFFIXES = (".py", ".sh", ".md", ".ipynb", ".cc", ".toml", ".cfg")
_UNSHIPPED = re.compile(r"research/|open_cleaner\.md|(?<!docs/)sglang\.md|perf_anchors|user_needs\.md|DESIGN\b")


def _files() -> list[Path]:
    out = [ROOT / "README.md"]
    for d in _SOURCES:
        out += [p for p in (ROOT / d).rglob("*") if p.suffix in _SUFFIXES and p.is_file() and p != Path(__file__)]
    return out


def _headings(page: Path) -> set[str]:
    """Section numbers of a page's headings (`## 2.5 Splice ...` -> "2.5"), plus the numbered
    items of `authors.md` §9 ("9.12")."""
    text = page.read_text()
    heads = set(re.findall(r"^#+ (\d+(?:\.\d+)*)\.? ", text, re.M))
    if page.name == "authors.md" and "## 9." in text:
        body = text.split("## 9.", 1)[1].split("\n## 10.", 1)[0]
        heads |= {f"9.{n}" for n in re.findall(r"^(\d+)\. ", body, re.M)}
    return heads


def _citations() -> list[tuple[str, str, str | None, str | None]]:
    """(where, page, section or None, rule or None) for every docs citation."""
    found = []
    for f in _files():
        for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            where = f"{f.relative_to(ROOT)}:{i}"
            for page, secs in re.findall(r"docs/(\w+\.md)`?((?:[ ,]*§[0-9.]+(?:-§[0-9.]+)?)*)", line):
                found.append((where, page, None, None))
                found += [(where, page, s.rstrip("."), None) for s in re.findall(r"§([0-9.]+)", secs)]
            found += [(where, "honest_rl.md", None, n) for n in re.findall(r"docs/honest_rl\.md rule (\d+)", line)]
    return found


def test_the_code_cites_the_docs() -> None:
    pages = {page for _, page, _, _ in _citations()}
    assert {"authors.md", "sglang_api.md", "honest_rl.md"} <= pages


def test_every_docs_citation_resolves() -> None:
    heads = {p.name: _headings(p) for p in DOCS.glob("*.md")}
    rules = set(re.findall(r"^## Rule (\d+):", (DOCS / "honest_rl.md").read_text(), re.M))
    bad = []
    for where, page, section, rule in _citations():
        if page not in heads:
            bad.append(f"{where}: docs/{page} does not exist")
        elif section is not None and section not in heads[page]:
            bad.append(f"{where}: docs/{page} has no section {section}")
        elif rule is not None and rule not in rules:
            bad.append(f"{where}: docs/honest_rl.md has no rule {rule}")
    assert not bad, "\n".join(bad)


def test_nothing_cites_unshipped_notes() -> None:
    bad = [f"{f.relative_to(ROOT)}:{i}: {line.strip()}" for f in _files() if f.parent != DOCS
           for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1) if _UNSHIPPED.search(line)]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("page", ["architecture.md", "authors.md", "sglang_api.md", "honest_rl.md"])
def test_core_pages_exist(page: str) -> None:
    assert (DOCS / page).stat().st_size > 1000
