"""Every link between the project's Markdown files leads somewhere: the file exists, and an
#anchor names one of its headings as GitHub writes heading anchors. Docs are moved and split
as the work goes on; a link into a section that moved is found here, not by a reader."""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~)")


def markdown_files() -> list[Path]:
    listed = subprocess.run(
        ["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return [ROOT / name for name in listed]


def prose_lines(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks, where a bracket is just code."""
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (hyphens and underscores
    kept), each space a hyphen."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: Counter[str] = Counter()
    found = set()
    for line in prose_lines(path):
        if match := re.match(r"#{1,6}\s+(.*)", line):
            base = slug(match.group(1))
            found.add(base if not seen[base] else f"{base}-{seen[base]}")
            seen[base] += 1
    return found


def broken_links(path: Path) -> list[str]:
    broken = []
    for line in prose_lines(path):
        for target in LINK.findall(line):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            name, _, anchor = target.partition("#")
            linked = (path.parent / name).resolve() if name else path
            if not linked.exists():
                broken.append(f"{target}: no such file")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
                broken.append(f"{target}: no such heading")
    return broken


def test_the_slugs_are_githubs():
    assert slug("The host sampler's draw inside llama_decode (`--backend-sampling draw`)") == (
        "the-host-samplers-draw-inside-llama_decode---backend-sampling-draw"
    )
    assert slug("Fewer operations a row, and no copies (2026-11-27, later)") == (
        "fewer-operations-a-row-and-no-copies-2026-11-27-later"
    )


def test_a_missing_heading_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Two words\n\n[ok](#two-words) [gone](#three-words)\n")
    assert broken_links(page) == ["#three-words: no such heading"]


@pytest.mark.parametrize("path", markdown_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_leads_somewhere(path: Path):
    assert broken_links(path) == []
