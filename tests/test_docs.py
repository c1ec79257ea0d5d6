"""The front page and the docs/ pages link to files and headings that exist, and the index lists every page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _prose(path: Path) -> list[str]:
    """The lines of a markdown file outside fenced code blocks."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def _anchors(path: Path) -> set[str]:
    """GitHub's anchors for a file's headings: lower case, punctuation dropped, spaces as hyphens, repeats numbered."""
    anchors: set[str] = set()
    for line in _prose(path):
        heading = re.match(r"#{1,6} (.*)", line)
        if heading is None:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def _local_links(path: Path) -> list[str]:
    targets = [target for line in _prose(path) for target in LINK.findall(line)]
    return [target for target in targets if not re.match(r"[a-z]+:", target)]


def test_the_docs_exist_and_the_front_page_stays_short() -> None:
    assert len(PAGES) > 10
    assert len((ROOT / "README.md").read_text().splitlines()) <= 350


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_local_link_resolves_to_a_file_and_heading(page: Path) -> None:
    broken = []
    for target in _local_links(page):
        file_part, _, anchor = target.partition("#")
        destination = (page.parent / file_part).resolve() if file_part else page
        if not destination.exists():
            broken.append(f"{target}: no such file")
        elif anchor and destination.suffix == ".md" and anchor not in _anchors(destination):
            broken.append(f"{target}: no heading #{anchor} in {destination.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: {broken}"


def test_the_docs_index_and_the_front_page_link_every_page() -> None:
    pages = {path.name for path in (ROOT / "docs").glob("*.md")} - {"README.md"}
    index = {Path(target.partition("#")[0]).name for target in _local_links(ROOT / "docs" / "README.md")}
    front = {Path(target.partition("#")[0]).name for target in _local_links(ROOT / "README.md") if "docs/" in target}
    assert pages - index == set()
    assert pages - front == set()
