"""The front door and the reference pages: their links resolve, and their code is the tested code.

A link or an anchor that points nowhere is how a reader gets lost after a page is split or a
heading renamed; these tests catch it in CI instead.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks/README.md"]

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def prose(text: str) -> str:
    """The page without its code blocks and code spans, where a link or a heading can be."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def slugs(page: Path) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces
    to hyphens, and -1, -2, ... after a repeated one."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in HEADING.findall(FENCE.sub("", page.read_text())):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


def links(page: Path) -> list[str]:
    return [
        target
        for target in LINK.findall(prose(page.read_text()))
        if not re.match(r"[a-z][a-z0-9+.-]*:", target)  # http:, https:, mailto:
    ]


def test_the_pages_exist() -> None:
    names = {page.name for page in (ROOT / "docs").glob("*.md")}
    assert {
        "http-api.md",
        "models.md",
        "generation.md",
        "operating.md",
        "architecture.md",
        "performance.md",
    } <= names


def test_the_slugs_are_githubs() -> None:
    page = ROOT / "docs" / "operating.md"
    assert "live-reconfiguration---config-and-sighup" in slugs(page)
    assert "flags" in slugs(page)


def test_every_relative_link_points_to_a_file_and_a_heading_that_exist() -> None:
    broken = []
    for page in PAGES:
        for target in links(page):
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in slugs(file):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_readme_python_example_is_the_tested_example_file() -> None:
    # examples/embedded.py is run by tests/test_engine.py; README shows lines of it, in order,
    # so what a reader copies is what the tests run.
    readme = (ROOT / "README.md").read_text()
    (block,) = re.findall(r"^```python\n(.*?)^```$", readme, re.M | re.S)
    example = iter((ROOT / "examples" / "embedded.py").read_text().splitlines())
    for line in block.splitlines():
        if line.strip():
            assert any(line == candidate for candidate in example), line
