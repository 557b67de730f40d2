"""Free text as it may appear in report.md: literal text, never Markdown structure.

Every text the pipeline did not write itself (the config's title and hardware fields, a trace's file
name and column headers, a cost model's name and source) reaches report.md through markdown_text and
then the Markdown template, whose Jinja autoescaping turns <, > and & into entities: Markdown shows an
entity as its character, so raw HTML, autolinks (<javascript:...>) and the user's own entities
(&lt;) stay text. markdown_text handles everything else Markdown would read as structure.
"""
from __future__ import annotations

import re
import unicodedata

# Characters that start inline Markdown anywhere on a line (emphasis, code, links and images, tables,
# strikethrough, headings, footnotes) and the backslash that escapes them.
MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]|~#!])")
# What starts a block at the beginning of a line or a table cell: a list item (-, + or 1. / 1)), a
# setext underline (=) or a blockquote (>); an indented code block's spaces go with the whitespace.
LEADING_MARKER = re.compile(r"^([-+=>])")
ORDERED_LIST = re.compile(r"^(\d{1,9})([.)])(?=\s|$)")  # CommonMark: a space or the end must follow
# GitHub's autolink extension links bare www., http:// and e-mail addresses: break the trigger.
BARE_LINK = re.compile(r"(?i)(?<=www)\.|(?<=[a-z0-9])(:)(?=//)|@")


def _printable(char: str) -> bool:
    # control characters and the invisible format ones (bidirectional overrides reorder what a reader
    # sees, so a file name could display as something else)
    return unicodedata.category(char) not in ("Cc", "Cf") or char in "\t\n\r"


def markdown_text(text) -> str:
    """`text` on one line (every run of whitespace, newlines included, becomes one space; control and
    bidirectional-format characters dropped) with Markdown's inline syntax backslash-escaped, a
    leading block marker escaped and bare links broken, so it renders as written wherever it is put:
    in a paragraph, at the start of a line or in a table cell. For the autoescaped Markdown template
    (see the module's docstring)."""
    line = " ".join("".join(c for c in str(text) if _printable(c)).split())
    line = MARKDOWN_SPECIAL.sub(r"\\\1", line)
    line = BARE_LINK.sub(lambda m: "\\" + m.group(0), line)
    ordered = ORDERED_LIST.match(line)
    if ordered:
        return f"{ordered.group(1)}\\{ordered.group(2)}{line[ordered.end():]}"
    return LEADING_MARKER.sub(r"\\\1", line)
