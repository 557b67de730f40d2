"""The simulated requests outside the cost model's profiled range (issue 21): counted by the pipeline
into results/plan/coverage.json and stated, with the count, in the report's workload section."""
from __future__ import annotations

from pathlib import Path

import jinja2
import numpy as np
import pytest

from servingplan import costmodel
from servingplan.io import write_json
from servingplan.report import coverage
from servingplan.report.render import environment, write_report
from servingplan.simulate.workload import EXERCISE2, Trace

from test_report import build_run

RANGE = {"prompt_tokens": [16, 512], "context_tokens": [16, 769]}


def profiled(ranges=RANGE) -> costmodel.CostModel:
    doc = costmodel.EXERCISE2.to_dict()
    doc["meta"] = {"profiled_range": ranges}
    return costmodel.CostModel.from_dict(doc)


def test_each_request_outside_the_range_is_counted_once():
    trace = Trace(np.zeros(5), np.array([8, 16, 600, 500, 512]), np.array([4, 10, 10, 300, 10]))
    counts = coverage.outside_counts([trace, trace], RANGE)
    # per trace: 8 below the prompts, 600 above them (its context of 610 within), 500 + 300 past the longest context
    assert counts == {"requests": 10, "outside": 6, "prompt_outside": 4, "context_outside": 2,
                      "longest_prompt_tokens": 600, "longest_context_tokens": 800}


def test_the_pipelines_coverage_counts_the_draws_the_simulations_replay():
    found = coverage.coverage({**EXERCISE2, "num_requests": 200}, [0, 1], profiled())
    assert found["draws"] == 2 and found["requests"] == 400 and found["profiled_range"] == RANGE
    # Exercise 2's prompts reach 2048 tokens, far past a 512-token profile
    assert 0 < found["outside"] <= 400 and found["longest_prompt_tokens"] > 512
    unknown = coverage.coverage({**EXERCISE2, "num_requests": 50}, [0], costmodel.EXERCISE2)
    assert unknown["profiled_range"] is None and unknown["outside"] is None and unknown["requests"] == 50


@pytest.mark.parametrize("ranges", [{"prompt_tokens": [512, 16], "context_tokens": [1, 2]},
                                    {"prompt_tokens": [16, 512]}, {"prompt_tokens": [1.5, 2], "context_tokens": [1, 2]}])
def test_a_malformed_range_is_refused_by_name(ranges):
    with pytest.raises(ValueError, match="meta.profiled_range"):
        coverage.profiled_range({"profiled_range": ranges})


def sentence(found: dict) -> str:
    """The report's coverage sentence for `found` (results/plan/coverage.json), as the text template words it."""
    env = environment()
    # the words' module reads every section at its top; only the coverage is given here
    env.undefined = jinja2.ChainableUndefined
    template = env.from_string('{% import "report.text.j2" as text with context %}{{ text.coverage_text() }}')
    return " ".join(template.render(coverage=found).split())


def test_the_sentence_warns_with_the_count_or_says_all_lie_within():
    outside = {"cost_model": "fit", "profiled_range": RANGE, "draws": 5, "requests": 3000, "outside": 12,
               "prompt_outside": 2, "context_outside": 11, "longest_prompt_tokens": 600, "longest_context_tokens": 900}
    warned = sentence(outside)
    assert warned.startswith("Warning: 12 of the 3,000 simulated requests (over the 5 draws of the workload")
    assert "prompts of 16 to 512 tokens, contexts (prompt + reply) up to 769 tokens" in warned
    assert "2 by their prompt, 11 by their context" in warned and "extrapolated" in warned
    within = sentence({**outside, "outside": 0, "prompt_outside": 0, "context_outside": 0, "draws": 1})
    assert within.startswith("All 3,000 simulated requests lie within") and "Warning" not in within
    unknown = sentence({"cost_model": "imported", "profiled_range": None, "draws": 1, "requests": 40, "outside": None})
    assert "records no profiled range" in unknown and "cannot be checked" in unknown


def test_the_report_states_the_warning_in_its_workload_section(tmp_path):
    inputs, config = build_run(tmp_path / "inputs", "all_pass", with_validation=False)
    found = coverage.coverage({**config["workload"], "prompt": {"dist": "uniform", "min": 16, "max": 4096}},
                              [0], costmodel.load(inputs["costmodel"]))
    assert found["outside"] > 0
    inputs["coverage"] = str(tmp_path / "coverage.json")
    write_json(inputs["coverage"], found)
    out = tmp_path / "report"
    logs = tmp_path / "logs"
    logs.mkdir()
    write_report(inputs, config, "abc123def456", "0123456789", out / "report.html", out / "report.md",
                 out / "provenance.json", logs)
    md = (out / "report.md").read_text()
    workload = md.split("## The workload", 1)[1].split("\n## ", 1)[0]
    warning = f"Warning: {found['outside']:,} of the {found['requests']:,} simulated requests"
    assert f"{warning} lie outside" in workload
    assert "coverage.json](" in workload  # its data file, linked
    assert warning in (out / "report.html").read_text()
