"""Metric definitions on hand-made timelines, the infinite-percentile rule, goodput, seed aggregation."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import GROWING, fixed_cost, make_trace
from servingplan.simulate import workload
from servingplan.simulate import SimResult, simulate
from servingplan.simulate.metrics import (SLO, good_requests, itl_values, per_request, percentile,
                                          request_itl_percentile, summarize)


def hand_result(arrival, first, completion, outputs, spans=None, end=None, truncated=False) -> SimResult:
    """A SimResult with the given timeline; NaN first/completion = never reached."""
    n = len(arrival)
    completion = np.asarray(completion, dtype=float)
    outputs = np.asarray(outputs)
    return SimResult(
        arrival_s=np.asarray(arrival, dtype=float), prompt_tokens=np.full(n, 10), output_tokens=outputs,
        scheduled_s=np.asarray(arrival, dtype=float), first_token_s=np.asarray(first, dtype=float),
        completion_s=completion, generated=np.where(np.isnan(completion), 0, outputs),
        preemptions=np.zeros(n, int), recomputed_tokens=np.zeros(n, int), rejected=np.zeros(n, bool),
        token_spans=spans, end_s=float(np.nanmax(completion)) if end is None else end, truncated=truncated,
        steps=0, events=0, peak_running=1, peak_kv_blocks=0, peak_kv_tokens=0, backlog_growth_s=-1.0,
        policy="continuous", max_num_seqs=1, chunk_size=512)


def test_definitions_on_a_hand_made_timeline():
    # request 0: arrives 1, first token 3, 5 tokens done at 7 -> TTFT 2, TPOT 1, E2E 6
    # request 1: arrives 2, first token 6, 1 token done at 6 -> TTFT 4, no TPOT, E2E 4
    r = hand_result([1.0, 2.0], [3.0, 6.0], [7.0, 6.0], [5, 1])
    frame = per_request(r)
    assert list(frame["ttft_s"]) == [2.0, 4.0]
    assert frame["tpot_s"][0] == 1.0 and math.isnan(frame["tpot_s"][1])
    assert list(frame["e2e_s"]) == [6.0, 4.0]
    s = summarize(r)
    assert s["ttft_ms_mean"] == 3000.0
    assert s["ttft_ms_p50"] == 3000.0
    assert s["ttft_ms_p90"] == pytest.approx(3800.0)
    assert s["tpot_ms_p99"] == 1000.0          # only the request with N >= 2 has a TPOT
    assert s["duration_s"] == 6.0              # first arrival to last completion
    assert s["throughput_tok_s"] == 1.0        # 6 tokens in 6 s
    assert s["request_rate"] == 1.0            # 2 requests over the 2 s to the last arrival
    assert s["goodput_rps"] == pytest.approx(2 / 6)
    assert s["attainment"] == 1.0
    assert "itl_ms_p50" not in s               # tokens not recorded


def test_percentiles_are_numpys_linear_interpolation():
    rng = np.random.default_rng(0)
    r = hand_result(np.zeros(101), rng.uniform(1, 5, 101), np.full(101, 9.0), np.full(101, 3))
    ttft_ms = per_request(r)["ttft_s"].to_numpy() * 1e3
    s = summarize(r)
    for q in (50, 90, 95, 99):
        assert s[f"ttft_ms_p{q}"] == pytest.approx(np.percentile(ttft_ms, q), rel=1e-12)


@given(st.lists(st.floats(0, 1e6), min_size=1, max_size=50), st.floats(0, 100))
def test_percentile_helper_agrees_with_numpy_on_finite_values(values, q):
    assert percentile(values, q) == pytest.approx(np.percentile(values, q), rel=1e-12, abs=1e-9)


def test_a_percentile_among_unfinished_requests_is_none_never_a_big_number():
    # 10 requests, the last 2 never got a token: p50 and p70 are finite, p90 and above are not
    arrival = np.arange(10.0)
    first = np.where(arrival < 8, arrival + 1.0, np.nan)
    completion = np.where(arrival < 8, arrival + 2.0, np.nan)
    r = hand_result(arrival, first, completion, np.full(10, 2), end=1000.0, truncated=True)
    s = summarize(r, SLO(ttft_ms=5000))
    assert s["ttft_ms_p50"] == 1000.0
    assert s["ttft_ms_p90"] is None and s["ttft_ms_p99"] is None
    assert s["ttft_ms_mean"] is None
    assert s["e2e_ms_p95"] is None
    assert s["truncated"] is True and s["stable"] is False
    assert s["finished"] == 8 and s["good"] == 8
    assert s["attainment"] == 0.8
    assert s["goodput_rps"] == pytest.approx(8 / 1000.0)   # over the run, to its end
    assert s["slo_holds"] is False                        # p95 TTFT is infinite
    assert percentile([1.0, math.inf], 0) == 1.0
    assert percentile([1.0, math.inf], 50) == math.inf
    json.dumps(s, allow_nan=False)


def test_started_but_unfinished_requests_have_infinite_tpot():
    r = hand_result([0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [3.0, 5.0, np.nan], [3, 3, 3], end=50.0, truncated=True)
    s = summarize(r)
    assert s["tpot_ms_p50"] == 2000.0
    assert s["tpot_ms_p90"] is None


def test_a_request_is_good_only_when_it_meets_every_bound():
    # TTFT (s): 1, 3, 1, 1; TPOT (s): 1, 1, 3, -; the third has one slow gap
    arrival = [0.0, 0.0, 0.0, 0.0]
    first = [1.0, 3.0, 1.0, 1.0]
    completion = [3.0, 5.0, 7.0, 1.0]
    outputs = [3, 3, 3, 1]
    spans = [[(0.0, 3, 1.0, 0.0)], [(2.0, 3, 1.0, 0.0)], [(0.0, 2, 1.0, 0.0), (2.0, 1, 5.0, 0.0)],
             [(0.0, 1, 1.0, 0.0)]]
    r = hand_result(arrival, first, completion, outputs, spans)
    assert list(good_requests(r, SLO(ttft_ms=2000))) == [True, False, True, True]
    assert list(good_requests(r, SLO(tpot_ms=2000))) == [True, True, False, True]
    assert list(good_requests(r, SLO(itl_ms=2000, itl_percentile=100))) == [True, True, False, True]
    assert list(good_requests(r, SLO(itl_ms=2000, itl_percentile=0))) == [True, True, True, True]
    both = SLO(ttft_ms=2000, tpot_ms=2000)
    assert list(good_requests(r, both)) == [True, False, False, True]
    s = summarize(r, both)
    assert s["good"] == 2 and s["attainment"] == 0.5
    assert s["goodput_rps"] == 2 / 7.0


def test_slo_holds_compares_the_chosen_percentile_with_the_bound():
    arrival = np.zeros(100)
    ttft = np.linspace(0.1, 1.0, 100)   # seconds
    r = hand_result(arrival, ttft, ttft + 1, np.full(100, 2))
    p90_ms = np.percentile(ttft, 90) * 1e3
    assert summarize(r, SLO(ttft_ms=p90_ms, ttft_percentile=90))["slo_holds"] is True
    assert summarize(r, SLO(ttft_ms=p90_ms * 0.999, ttft_percentile=90))["slo_holds"] is False
    assert summarize(r, SLO(ttft_ms=p90_ms, ttft_percentile=99))["slo_holds"] is False


def test_itl_values_are_every_gap_of_every_request():
    trace = workload.generate({**workload.CAPSTONE, "num_requests": 120, "rate": 20.0}, seed=2)
    r = simulate(trace, GROWING, "continuous_chunked", 8, chunk_size=64, record_tokens=True)
    expected = np.concatenate([np.diff(r.token_times(i)) for i in range(len(trace))])
    assert itl_values(r) == pytest.approx(expected, rel=1e-12)
    own = request_itl_percentile(r, 90)
    for i in range(len(trace)):
        assert own[i] == pytest.approx(np.percentile(np.diff(r.token_times(i)), 90), rel=1e-12)
    s = summarize(r)
    assert s["itl_ms_p99"] == pytest.approx(np.percentile(expected, 99) * 1e3, rel=1e-12)


def test_itl_needs_recorded_tokens():
    r = simulate(make_trace([0.0], [10], [3]), fixed_cost(), "continuous", 1)
    with pytest.raises(ValueError, match="record_tokens"):
        itl_values(r)
    with pytest.raises(ValueError, match="record_tokens"):
        summarize(r, SLO(itl_ms=10))


def test_itl_of_a_fixed_cost_run_is_exact():
    r = simulate(make_trace([0.0, 0.0], [10, 10], [3, 2]), fixed_cost(decode_s=1.0, prefill_s=2.0),
                 "continuous", 2, record_tokens=True)
    # both prefill in one 4 s step, then decode together
    assert list(itl_values(r)) == [1.0, 1.0, 1.0]
    assert list(request_itl_percentile(r, 50)) == [1.0, 1.0]


@pytest.mark.parametrize("kwargs", [{"ttft_ms": 0}, {"tpot_ms": -1}, {"itl_percentile": 101},
                                    {"ttft_percentile": -5}])
def test_slo_rejects_impossible_bounds(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        SLO(**kwargs)


def test_summary_of_a_real_run_is_json_friendly_and_consistent():
    trace = workload.generate({**workload.EXERCISE2, "num_requests": 300}, seed=0)
    from servingplan.costmodel import EXERCISE2
    r = simulate(trace, EXERCISE2, "continuous_chunked", 32, record_tokens=True)
    s = summarize(r, SLO(ttft_ms=2000, tpot_ms=12, itl_ms=50))
    json.dumps(s, allow_nan=False)
    assert s["finished"] == s["num_requests"] == 300
    assert s["good"] == int(good_requests(r, SLO(ttft_ms=2000, tpot_ms=12, itl_ms=50)).sum())
    assert 0 <= s["attainment"] <= 1
    assert s["ttft_ms_p50"] <= s["ttft_ms_p90"] <= s["ttft_ms_p95"] <= s["ttft_ms_p99"]
    assert s["throughput_tok_s"] == pytest.approx(trace.output_tokens.sum() / s["duration_s"])
    assert s["peak_running"] <= 32
