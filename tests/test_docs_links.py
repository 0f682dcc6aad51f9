"""Every relative link in the project's markdown (README, results pages, cards, archived studies) resolves: the file
exists, and a #heading in a markdown file is one of its headings (GitHub's anchors: lower case, punctuation dropped,
spaces as hyphens)."""

from __future__ import annotations

import re
import shutil
import subprocess
from functools import cache
from pathlib import Path

import pytest

REPOSITORY = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)\s]+)\)")
LINK_TEXT = re.compile(r"\[([^\]]*)\]\([^)]*\)")
HEADING = re.compile(r"^#+\s+(.*?)\s*$", re.M)
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:")


def tracked_markdown() -> list[Path]:
    listed = subprocess.run(["git", "ls-files", "*.md"], cwd=REPOSITORY, capture_output=True, text=True, check=True)
    return [REPOSITORY / name for name in listed.stdout.split()]


def anchor_of(heading: str) -> str:
    text = LINK_TEXT.sub(r"\1", heading).strip().lower()  # a link in a heading anchors by its text
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors_in(path: Path) -> frozenset[str]:
    return frozenset(anchor_of(heading) for heading in HEADING.findall(path.read_text(errors="replace")))


def broken_links(page: Path) -> list[str]:
    broken = []
    for target in LINK.findall(page.read_text(errors="replace")):
        if SCHEME.match(target):
            continue
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and linked.suffix == ".md" and anchor not in anchors_in(linked):
            broken.append(f"{target} (no such heading)")
    return broken


@pytest.mark.skipif(shutil.which("git") is None or not (REPOSITORY / ".git").exists(), reason="needs a git checkout")
def test_every_relative_link_in_the_markdown_resolves():
    broken = {str(page.relative_to(REPOSITORY)): links for page in tracked_markdown() if (links := broken_links(page))}
    assert not broken, broken
