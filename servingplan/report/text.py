"""Free text from the config as it may appear in report.md: literal text, never Markdown structure."""
from __future__ import annotations

import re

# Characters that start inline Markdown anywhere on a line (emphasis, code, links and images, tables,
# strikethrough, closing heading hashes) and the backslash that escapes them. <, > and & are left to
# the template's HTML autoescaping, whose entities Markdown renders as the characters themselves.
MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]|~#])")


def markdown_text(text: str) -> str:
    """`text` on one line (every run of whitespace, newlines included, becomes one space) with
    Markdown's inline syntax backslash-escaped, so it renders as written."""
    return MARKDOWN_SPECIAL.sub(r"\\\1", " ".join(str(text).split()))
