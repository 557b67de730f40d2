"""The documentation keeps its shape (issue 38): a README for users, short, opening with the two commands,
and every relative link in README.md and docs/*.md pointing to a file that exists."""
from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 250
TWO_COMMANDS = (
    "make pipeline   # creates/reuses .venv from pinned requirements, then runs `snakemake --cores 4`\n"
    "make test       # creates/reuses .venv from pinned requirements, then runs the test suite\n"
)
# [text](target) and ![alt](target), with an optional "title"; <https://...> autolinks are absolute anyway
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def documents() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def relative_links(text: str) -> list[str]:
    """The link targets of a Markdown text that are neither absolute URLs nor in-page anchors; code (fenced
    blocks and inline spans) is left out, since a link there is an example, not a link."""
    prose = INLINE_CODE.sub("", FENCE.sub("", text))
    targets = []
    for target in LINK.findall(prose):
        if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target) or target.startswith("#"):
            continue   # https:, mailto: ..., or an anchor in the same page
        targets.append(target)
    return targets


def test_the_readme_stays_short():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES}): move details to docs/"


def test_the_readme_opens_with_the_two_commands():
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", README.read_text(encoding="utf-8"), re.M | re.S)
    assert blocks, "README.md has no code block"
    assert blocks[0] == TWO_COMMANDS, f"README.md's first code block is not the two commands:\n{blocks[0]}"


@pytest.mark.parametrize("document", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files_that_exist(document):
    missing = []
    for target in relative_links(document.read_text(encoding="utf-8")):
        path = unquote(target.split("#", 1)[0].split("?", 1)[0])
        if not (document.parent / path).exists():
            missing.append(target)
    assert not missing, f"{document.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_the_link_check_sees_links():
    """The checker itself: it finds relative links, skips URLs, anchors and code, and keeps a file's anchor."""
    text = ("[a](docs/x.md) ![b](img.png \"t\") [c](https://e.org/y) [d](#here) [e](y.md#part)\n"
            "`[f](code.md)`\n```\n[g](fenced.md)\n```\n")
    assert relative_links(text) == ["docs/x.md", "img.png", "y.md#part"]
    assert len(documents()) > 1, "docs/ has no pages"
