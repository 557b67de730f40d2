"""Figures that show something: nothing stable means no figure and a reason for the report's sentence;
legends list only what is drawn; Exercise 2's figures mark the picked cap; no code name in any label."""
from __future__ import annotations

import itertools

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest

from servingplan.plan import names
from servingplan.report import figures, precision
from servingplan.simulate.policies import POLICIES

CAPS = (4, 16, 64)
RATES = (1.0, 6.0, 9.0)
# the code names that cannot pass for words (a single word such as "static" reads as itself)
CODE_NAMES = {code for code in set(POLICIES) | set(names.TERMS) | set(names.PROFILE_KINDS) | set(names.AXES)
              | {"goodput_rps", "itl_ms_p99", "ttft_ms_p90", "per_kv_token", "per_sequence"} if "_" in code}


def latency_frame(stable_at=lambda policy, cap, rate: rate < 6, preemptions=0.0) -> pd.DataFrame:
    rows = []
    for policy, cap, rate, seed in itertools.product(POLICIES, CAPS, RATES, (1, 2)):
        stable = stable_at(policy, cap, rate)
        rows.append({"policy": policy, "max_num_seqs": cap, "rate": rate, "seed": seed, "stable": stable,
                     "goodput_rps": rate * 0.9 + 0.01 * seed, "itl_ms_p99": 40.0 + cap + seed,
                     "ttft_ms_p90": 100.0 * rate + seed, "attainment": 0.9, "preemptions": preemptions})
    return pd.DataFrame(rows)


def texts(fig) -> list[str]:
    """Every string a reader sees on the figure: titles, axis labels, ticks, legends, free text."""
    found = [t.get_text() for t in fig.findobj(plt.Text)]
    return [t for t in found if t]


def legend_labels(fig) -> list[str]:
    return [t.get_text() for legend in fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
            for t in legend.get_texts()]


def assert_no_code_name(fig) -> None:
    for text in texts(fig):
        for code in CODE_NAMES:
            assert code not in text, (code, text)


RATES_SHOWN = {"today": 6.0, "target": 9.0}


def test_a_by_cap_figure_with_nothing_stable_is_not_drawn_and_says_why():
    latency = latency_frame()          # nothing keeps up at 6 or 9 req/s
    assert figures.by_cap(latency, "goodput_rps", RATES_SHOWN, "goodput", "Goodput") is None
    assert figures.by_cap_omission(latency, "goodput_rps", RATES_SHOWN) == figures.NO_STABLE_POINT
    # every stable value zero: nothing to show either, for another reason
    calm = latency_frame(stable_at=lambda *_: True, preemptions=0.0)
    assert figures.by_cap(calm, "preemptions", RATES_SHOWN, "preemptions", "Preemptions") is None
    assert figures.by_cap_omission(calm, "preemptions", RATES_SHOWN) == figures.ALL_ZERO


def test_a_by_cap_figure_draws_only_panels_with_values_and_lists_only_what_it_drew():
    # at 6 req/s only the continuous policy keeps up, and only at cap 64; at 9 req/s nothing does
    latency = latency_frame(stable_at=lambda policy, cap, rate: rate < 6 or (rate == 6 and policy == "continuous"
                                                                               and cap == 64))
    assert figures.by_cap_omission(latency, "goodput_rps", RATES_SHOWN) is None
    fig = figures.by_cap(latency, "goodput_rps", RATES_SHOWN, "goodput (good requests/s)", "Goodput per cap",
                         {"today": (6.0, "offered load"), "target": (9.0, "offered load")})
    assert len(fig.axes) == 1
    labels = legend_labels(fig)
    assert labels == [names.display("continuous"), "unstable: the queue grows (no value)"]
    # the reference line and its label sit inside the axes, not as a stray label above it
    ax = fig.axes[0]
    assert ax.get_ylim()[0] == 0 and ax.get_ylim()[1] > 6.0
    assert_no_code_name(fig)
    plt.close(fig)


def test_ttft_and_attainment_figures_with_nothing_stable_are_not_drawn():
    latency = latency_frame(stable_at=lambda *_: False)
    assert figures.ttft_vs_rate(latency, 90, 300.0, 6.0, 9.0) is None
    assert figures.attainment_heatmap(latency, "good requests (%)") is None
    fig = figures.ttft_vs_rate(latency_frame(), 90, 300.0, 6.0, 9.0)
    # caps with a stable point are listed, each once, with the crosses' meaning
    assert legend_labels(fig)[:len(CAPS)] == [f"cap {c}" for c in CAPS]
    assert "unstable (no percentile)" in legend_labels(fig)
    assert_no_code_name(fig)
    plt.close(fig)


def ex2_caps_means(stable_caps) -> pd.DataFrame:
    rows = [{"stat": "mean", "reading": reading, "max_num_seqs": cap, "stable": cap in stable_caps,
             "attainment": 0.3 if cap in stable_caps else np.nan,
             "tpot_ms_p95": 10.0 + cap / 8 if cap in stable_caps else np.nan}
            for reading in ("per_kv_token", "per_sequence") for cap in (8, 32, 64, 128)]
    return pd.DataFrame(rows)


def test_exercise2_caps_marks_the_picked_cap_and_nothing_it_did_not_draw():
    fig = figures.exercise2_caps(ex2_caps_means({32, 64, 128}), 81, 64, 12.0)
    labels = legend_labels(fig)
    assert "picked cap 64 (the answers use it)" in labels
    assert not any("best" in label for label in labels)
    assert "unstable: the queue grows (no value)" in labels        # cap 8 is unstable under both readings
    assert_no_code_name(fig)
    plt.close(fig)
    fig = figures.exercise2_caps(ex2_caps_means({8, 32, 64, 128}), 81, 64, 12.0)
    assert "unstable: the queue grows (no value)" not in legend_labels(fig)
    plt.close(fig)


def test_exercise2_figures_with_no_cap_or_chunk_that_keeps_up_are_not_drawn():
    means = ex2_caps_means(set())
    assert figures.sweep_omission(means, ["attainment", "tpot_ms_p95"]) == figures.NO_STABLE_POINT
    assert figures.exercise2_caps(means, 81, None, 12.0) is None
    chunks = pd.DataFrame({"chunk_size": [64, 512], "stable": [False, False], "itl_ms_p99": [np.nan, np.nan],
                           "itl_ms_max": [np.nan, np.nan], "max_num_seqs": [64.0, 64.0]})
    assert figures.exercise2_chunks(chunks, 12.0) is None


def test_an_unstable_chunk_is_never_drawn_under_the_bound():
    chunks = pd.DataFrame({"chunk_size": [64, 128, 512], "stable": [False, False, True],
                           "itl_ms_p99": [np.nan, np.nan, 30.0], "itl_ms_max": [np.nan, np.nan, 31.0],
                           "max_num_seqs": [64.0] * 3})
    fig = figures.exercise2_chunks(chunks, 12.0)
    ax = fig.axes[0]
    crosses = [line for line in ax.get_lines() if line.get_marker() == "x" and len(line.get_xdata())]
    assert crosses and all(y > 31.0 for line in crosses for y in line.get_ydata())
    assert "picked cap 64" in ax.get_title()
    plt.close(fig)


def test_the_cost_chart_marks_the_chosen_fleet_at_its_own_machines_price():
    here = {"label": "pick: 10 × HERE", "replicas": 10, "price_per_hour": None}
    fig = figures.cost_vs_replicas(1.0, 473.0, 0.001, 16, {}, chosen=here)
    assert legend_labels(fig)[0] == "pick: 10 × HERE"
    star = next(line for line in fig.axes[0].get_lines() if line.get_marker() == "*")
    assert list(star.get_xdata()) == [10]
    assert star.get_ydata()[0] == pytest.approx(1.0 * 10 / 3600 / 473.0 * 1000)
    plt.close(fig)
    gpu = {"label": "closest: 3 × GPU at $0.35/h", "replicas": 3, "price_per_hour": 0.35}
    fig = figures.cost_vs_replicas(1.0, 473.0, 0.001, 16, {}, chosen=gpu)
    star = next(line for line in fig.axes[0].get_lines() if line.get_marker() == "*")
    assert star.get_ydata()[0] == pytest.approx(0.35 * 3 / 3600 / 473.0 * 1000)
    plt.close(fig)


def test_the_chosen_mark_names_the_decisions_first_option_with_display_names():
    from servingplan.report.render import chosen_mark
    option = {"machine": "nvidia-t4", "display_name": "NVIDIA T4 GPU", "replicas": 3, "policy": "continuous",
              "cap": 16, "meets_all": False, "price_per_hour": 0.35}
    assert chosen_mark(option) == {"label": "closest: 3 × NVIDIA T4 GPU, continuous batching cap 16 at $0.35/h",
                                   "replicas": 3, "price_per_hour": 0.35}
    here = dict(option, machine="here", display_name="this machine", meets_all=True, price_per_hour=1.0)
    assert chosen_mark(here)["price_per_hour"] is None and chosen_mark(here)["label"].startswith("pick: 3 × this machine")
    assert chosen_mark(None) is None


@pytest.mark.parametrize("moved, digits", [(None, 3), (0.0, 3), (10.0, 3), (10.01, 2), (49.5, 2)])
def test_a_run_whose_speed_moved_more_than_10pct_gets_two_significant_digits(moved, digits):
    assert precision.measured_digits(moved) == digits


@pytest.mark.parametrize("value, digits, shown", [(0.00579, 2, "0.0058"), (16.5, 2, "17"), (14.6, 2, "15"),
                                                  (22.1, 2, "22"), (9.96, 2, "10"), (12345.0, 2, "12,000"),
                                                  (0.00579, 3, "0.00579"), (-16.5, 2, "-17"), (0.0, 2, "0")])
def test_significant_rounds_half_away_from_zero_in_plain_notation(value, digits, shown):
    assert precision.significant(value, digits) == shown


def test_significant_refuses_what_has_no_digits():
    with pytest.raises(ValueError):
        precision.significant(float("nan"), 2)
    with pytest.raises(ValueError):
        precision.significant(1.0, 0)
    with pytest.raises(ValueError):
        precision.measured_digits(float("inf"))


def test_the_memory_figure_draws_the_measured_serving_memory_and_no_empty_bar():
    memory = pd.DataFrame([{"max_num_seqs": cap, "policy": policy, "weights_bytes": 5e8, "kv_reserved_bytes": cap * 3e7,
                            "kv_used_peak_bytes": (cap * 1e7 if policy != "static" else np.nan)}
                           for cap in (8, 16) for policy in POLICIES])
    fig = figures.memory_bars(memory, 2e9, [{"policy": "continuous_chunked", "cap": 16, "peak_rss_bytes": 1.98e9,
                                              "sequences": 16, "context_tokens": 4000}])
    labels = legend_labels(fig)
    assert "measured peak RSS while serving (whole process)" in labels
    assert f"KV used at peak: {names.display('static')}" not in labels
    tick = next(line for line in fig.axes[0].get_lines() if line.get_marker() == "_")
    assert tick.get_ydata()[0] == pytest.approx(1.98)
    assert_no_code_name(fig)
    plt.close(fig)
