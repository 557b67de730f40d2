"""The report's blocks, each drawn once in HTML and once in Markdown.

reports/templates/report.sections.j2 declares every section once, as a sequence of these blocks
(paragraph, table with a link to its data, figure, list, heading, quote); rendering it with HtmlBlocks
gives the page, with MarkdownBlocks the Markdown. Text arrives autoescaped (Markup, or plain str that
is escaped here), so free text from the config stays text in both outputs; in Markdown every text goes
through servingplan.report.text.markdown_text.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from markupsafe import Markup, escape

from servingplan.report.text import markdown_text

# a cell whose text starts like a number: its column is right-aligned in HTML
NUMERIC = re.compile(r"^[-−+$~]?\d")
# the quote entities of HTML escaping, which Markdown does not need (<, > and & stay entities)
QUOTE_ENTITIES = (("&#39;", "'"), ("&#34;", '"'))


@dataclass(frozen=True)
class Verdict:
    """A table cell holding a pass or fail, styled so in HTML."""
    text: object
    passed: bool


def oneline(text) -> Markup:
    """Autoescaped text with every run of whitespace made one space."""
    return Markup(" ".join(str(escape(text)).split()))


def md(text) -> str:
    """Autoescaped text as Markdown: one line, inline syntax escaped, quotes as characters."""
    flat = str(escape(text))
    for entity, char in QUOTE_ENTITIES:
        flat = flat.replace(entity, char)
    return markdown_text(flat)


def _cell_text(cell) -> object:
    return cell.text if isinstance(cell, Verdict) else cell


def numeric_columns(rows: list[list]) -> set[int]:
    """The columns holding a number in some row: right-aligned, with their 'unstable' cells too."""
    return {i for row in rows for i, cell in enumerate(row)
            if NUMERIC.match(Markup(str(escape(_cell_text(cell)))).striptags())}


class HtmlBlocks:
    """The blocks as HTML."""

    def __init__(self, sources: dict, figure_src: dict, figure_size: dict):
        self.sources, self.figure_src, self.figure_size = sources, figure_src, figure_size

    def title(self, text) -> Markup:
        return oneline(text)

    def para(self, text) -> Markup:
        return Markup("<p>{}</p>\n").format(oneline(text))

    def heading(self, text, anchor: str | None = None) -> Markup:
        if anchor:
            return Markup('<h3 id="{}">{}</h3>\n').format(anchor, oneline(text))
        return Markup("<h3>{}</h3>\n").format(oneline(text))

    def quote(self, text) -> Markup:
        return Markup("<blockquote>{}</blockquote>\n").format(oneline(text))

    def items(self, entries: list) -> Markup:
        """A bulleted list; an entry (lead, text) opens with its lead in bold."""
        lines = []
        for entry in entries:
            if isinstance(entry, (list, tuple)):
                lines.append(Markup("  <li><strong>{}.</strong> {}</li>").format(oneline(entry[0]), oneline(entry[1])))
            else:
                lines.append(Markup("  <li>{}</li>").format(oneline(entry)))
        return Markup("<ul>\n{}\n</ul>\n").format(Markup("\n").join(lines))

    def source(self, keys) -> Markup:
        links = Markup(", ").join(Markup('<a href="{}">{}</a>').format(self.sources[k]["href"], self.sources[k]["path"])
                                  for k in keys if k in self.sources)
        return Markup('<p class="source">Data: {}</p>\n').format(links) if links else Markup("")

    def link_para(self, text, key: str) -> Markup:
        """A paragraph ending in the link to one data file (nothing when the run has no such file)."""
        if key not in self.sources:
            return Markup("")
        return Markup('<p>{} <a href="{}">{}</a>.</p>\n').format(
            oneline(text), self.sources[key]["href"], self.sources[key]["path"])

    def table(self, headers: list, rows: list[list], sources=(), id: str | None = None, row_ids=None) -> Markup:
        numeric = numeric_columns(rows)

        def cell(i, value):
            if isinstance(value, Verdict):
                return Markup('<td class="verdict {}">{}</td>').format("pass" if value.passed else "fail",
                                                                      oneline(value.text))
            return Markup("<td{}>{}</td>").format(Markup(' class="num"') if i in numeric else "", oneline(value))

        body = []
        for n, row in enumerate(rows):
            row_id = Markup(' id="{}"').format(row_ids[n]) if row_ids else ""
            body.append(Markup("    <tr{}>{}</tr>").format(row_id, Markup("").join(cell(i, v) for i, v in enumerate(row))))
        head = Markup("").join(Markup("<th>{}</th>").format(oneline(h)) for h in headers)
        table_id = Markup(' id="{}"').format(id) if id else ""
        return (Markup("<table{}>\n  <thead><tr>{}</tr></thead>\n  <tbody>\n{}\n  </tbody>\n</table>\n")
                .format(table_id, head, Markup("\n").join(body)) + self.source(sources))

    def figure(self, name: str, caption, omitted) -> Markup:
        if name not in self.figure_src:
            return self.para(omitted)
        width, height = self.figure_size[name]
        return Markup('<figure id="fig-{}">\n  <img src="{}" alt="{}" width="{}" height="{}">\n'
                      '  <figcaption>{}</figcaption>\n</figure>\n').format(
            name, self.figure_src[name], Markup(oneline(caption)).striptags(), width, height, oneline(caption))

    def cost_chart(self, caption, omitted, live_note, data: dict) -> Markup:
        """The cost chart the page's script draws, so that it follows the price input."""
        return Markup('<figure id="fig-cost">\n  <svg id="cost-chart" viewBox="0 0 900 330" role="img" aria-label="{}"></svg>\n'
                      '  <figcaption>{} {}</figcaption>\n</figure>\n'
                      '<script type="application/json" id="cost-data">{}</script>\n').format(
            Markup(oneline(caption)).striptags(), oneline(caption), oneline(live_note), _json_for_script(data))

    def price_control(self, label, live_note, caveat, price: float) -> Markup:
        return Markup('<div class="price-control">\n  <label for="price">{}</label>\n'
                      '  <input id="price" type="text" inputmode="decimal" value="{}" aria-describedby="price-message">\n'
                      '  <span id="price-message" class="price-error" role="alert"></span>\n'
                      '  <small>{} {}</small>\n</div>\n').format(oneline(label), price, oneline(live_note), oneline(caveat))

    def box(self, caller) -> Markup:
        return Markup('<div class="summary-box">\n{}</div>\n').format(caller())


class MarkdownBlocks:
    """The same blocks as Markdown; figures link the PNG files written beside it. Each block is Markup,
    so the template's autoescaping leaves the Markdown as built here."""

    def __init__(self, sources: dict, figure_src: dict):
        self.sources, self.figure_src = sources, figure_src

    def title(self, text) -> Markup:
        return Markup(md(text))

    def para(self, text) -> Markup:
        return Markup(f"{md(text)}\n\n")

    def heading(self, text, anchor: str | None = None) -> Markup:
        return Markup(f"### {md(text)}\n\n")

    def quote(self, text) -> Markup:
        return Markup(f"> {md(text)}\n\n")

    def items(self, entries: list) -> Markup:
        lines = [f"- **{md(e[0])}.** {md(e[1])}" if isinstance(e, (list, tuple)) else f"- {md(e)}" for e in entries]
        return Markup("\n".join(lines) + "\n\n")

    def source(self, keys) -> Markup:
        links = ", ".join(f"[{md(self.sources[k]['path'])}]({self.sources[k]['href']})" for k in keys if k in self.sources)
        return Markup(f"Data: {links}\n\n" if links else "")

    def link_para(self, text, key: str) -> Markup:
        if key not in self.sources:
            return Markup("")
        return Markup(f"{md(text)} [{md(self.sources[key]['path'])}]({self.sources[key]['href']}).\n\n")

    def table(self, headers: list, rows: list[list], sources=(), id: str | None = None, row_ids=None) -> Markup:
        lines = ["| " + " | ".join(md(h) for h in headers) + " |", "|" + "---|" * len(headers)]
        lines += ["| " + " | ".join(md(_cell_text(c)) for c in row) + " |" for row in rows]
        return Markup("\n".join(lines) + "\n\n") + self.source(sources)

    def figure(self, name: str, caption, omitted) -> Markup:
        if name not in self.figure_src:
            return self.para(omitted)
        return Markup(f"![{md(caption)}]({self.figure_src[name]})\n\n*{md(caption)}*\n\n")

    def cost_chart(self, caption, omitted, live_note, data: dict) -> Markup:
        return self.figure("cost", caption, omitted)

    def price_control(self, label, live_note, caveat, price: float) -> Markup:
        return self.para(caveat)

    def box(self, caller) -> Markup:
        return Markup(caller())


def _json_for_script(data: dict) -> Markup:
    """JSON safe inside a <script> element: no closing tag or comment opener can appear."""
    text = json.dumps(data, sort_keys=True, ensure_ascii=False)
    return Markup(text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026"))
