"""The rule "an unstable run has no percentile or goodput", checked on every output of a run where
nothing keeps up: the figures' data, the Markdown, the HTML, and Exercise 2's sweeps."""
from __future__ import annotations

import re
from pathlib import Path

import pandas as pd
import pytest

import test_report
from servingplan.costmodel import CostModel
from servingplan.report import figures
from servingplan.report.render import seed_means
from servingplan.seeds import UNDEFINED_WHEN_UNSTABLE

# Steps so slow that no configuration keeps up at any swept rate, and an Exercise 2 load no cap keeps up with.
SLOW = CostModel(decode_fixed_s=0.4, decode_per_seq_s=5e-3, decode_per_ctx_token_s=1e-6,
                 prefill_fixed_s=0.1, prefill_per_token_s=6e-3)
EXERCISE2_RATE = 400.0
UNDEFINED_HEADINGS = re.compile(r"TTFT|TPOT|gap|Goodput|goodput|Meeting the SLO|Seeds' range", re.I)


@pytest.fixture(scope="module")
def all_unstable(tmp_path_factory, monkeypatch_module):
    monkeypatch_module.setitem(test_report.SCENARIOS, "all_unstable",
                               {"cost": SLOW, "budget_gb": 2.0, "price_per_hour": 1.0})
    original = test_report.small_config

    def config(scenario, title=test_report.HOSTILE_TITLE):
        cfg = original(scenario, title)
        cfg["exercise2"].update(rate=EXERCISE2_RATE, num_requests=120)
        return cfg

    monkeypatch_module.setattr(test_report, "small_config", config)
    return test_report.render_scenario(tmp_path_factory.mktemp("all_unstable"), "all_unstable")


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def markdown_tables(md: str) -> list[list[dict]]:
    """Every pipe table as a list of rows keyed by header."""
    tables, lines = [], md.splitlines()
    for i, line in enumerate(lines[:-1]):
        if line.startswith("|") and re.fullmatch(r"\|(-+\|)+", lines[i + 1]):
            headers = [h.strip() for h in line.strip("|").split("|")]
            rows = []
            for body in lines[i + 2:]:
                if not body.startswith("|"):
                    break
                rows.append(dict(zip(headers, (c.strip() for c in body.strip("|").split("|")))))
            tables.append(rows)
    return tables


def html_tables(html: str) -> list[list[dict]]:
    """Every table with a one-row header as rows keyed by header (the two-level Exercise 2 table is
    checked by its cells' text instead)."""
    tables = []
    for table in re.findall(r"<table\b.*?</table>", html, flags=re.S):
        head = re.search(r"<thead>(.*?)</thead>", table, flags=re.S)
        if not head or head.group(1).count("<tr") != 1:
            continue
        headers = [re.sub(r"<[^>]+>", "", h).strip() for h in re.findall(r"<th\b[^>]*>(.*?)</th>", head.group(1), re.S)]
        body = re.search(r"<tbody>(.*?)</tbody>", table, flags=re.S).group(1)
        rows = [dict(zip(headers, (re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td\b[^>]*>(.*?)</td>", tr, re.S))))
                for tr in re.findall(r"<tr\b.*?</tr>", body, flags=re.S)]
        tables.append(rows)
    return tables


def test_the_case_is_all_unstable(all_unstable):
    latency = pd.read_csv(all_unstable["inputs"]["latency"])
    assert not latency["stable"].any()
    caps = pd.read_csv(all_unstable["inputs"]["ex2_caps"])
    assert not caps["stable"].any()


def test_figures_get_no_percentile_or_goodput(all_unstable):
    latency = pd.read_csv(all_unstable["inputs"]["latency"])
    for column in ("ttft_ms_p90", "tpot_ms_p95", "itl_ms_p99", "goodput_rps", "attainment"):
        cells = figures.cell_means(latency, column)
        assert cells[["mean", "min", "max"]].isna().all().all(), column
    for sweep in ("ex2_caps", "ex2_chunks"):
        means = seed_means(pd.read_csv(all_unstable["inputs"][sweep]), "chunk_size" if "chunks" in sweep else "max_num_seqs")
        undefined = [c for c in means.columns if c.startswith(UNDEFINED_WHEN_UNSTABLE)]
        assert undefined and means[undefined].isna().all().all(), sweep


@pytest.mark.parametrize("kind", ["md", "html"])
def test_every_table_marks_unstable_cells(all_unstable, kind):
    text = all_unstable[kind].read_text()
    tables = markdown_tables(text) if kind == "md" else html_tables(text)
    checked = 0
    for rows in tables:
        for row in rows:
            for header, cell in row.items():
                if UNDEFINED_HEADINGS.search(header) and not header.startswith("Verdict"):
                    assert re.search(r"\d", cell) is None or "unstable" in cell, (header, cell)
                    checked += 1
    assert checked >= 20


def test_no_sentence_quotes_a_percentile_or_goodput(all_unstable):
    md = all_unstable["md"].read_text()
    prose = [line for line in md.splitlines() if line and not line.startswith(("|", "!", "*", "#"))]
    for line in prose:
        for sentence in re.split(r"(?<=\.) ", line):
            # the prefill floor is a property of the prompts, not of a run, and is quoted as such
            if "prefilling the prompts alone" in sentence or "Prefill alone" in sentence:
                continue
            assert not re.search(r"\bgoodput\b[^.]*?\d[\d,.]* (req/s|good requests)", sentence), sentence
            assert not re.search(r"\bp\d+ (inter-token gap|TPOT|TTFT)[^.]*?\bis [\d,.]+ ms", sentence), sentence
            assert not re.search(r"[\d.]+% (of requests )?(meet|within) the SLO", sentence), sentence
            assert not re.search(r"\b(p\d+|mean TPOT|mean TTFT)( gap)? (is|of) [\d,.]+ ms", sentence), sentence


def test_no_none_or_nan_leaks(all_unstable):
    assert test_report.LEAKS.findall(test_report.visible_md_text(all_unstable["md"].read_text())) == []
    assert test_report.LEAKS.findall(test_report.visible_html_text(all_unstable["html"].read_text())) == []


def test_summary_says_unstable_instead_of_numbers(all_unstable):
    md = all_unstable["md"].read_text()
    assert re.search(r"^\| Latency \|[^|]*\| unstable: the queue grows \|", md, flags=re.M)
    assert re.search(r"^\| Cost \|[^|]*\| no cost: the queue does not keep up \|", md, flags=re.M)
    assert "no swept cap keeps up" in md
