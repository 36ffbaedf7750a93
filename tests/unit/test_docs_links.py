"""Every relative link in the README, the changelog and ``docs/`` points at a file that exists
(``mkdocs build --strict`` in ``make lint`` checks the links between the pages and their
anchors; this covers links out of ``docs/`` and the README's)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL, or an anchor of the page itself
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            broken.append(target)
    assert not broken, f"{page.name}: links to missing files {broken}"


def test_the_readme_stays_short() -> None:
    """The README is the front door; the reference lives in docs/."""
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200
