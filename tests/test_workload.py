"""Traces: calibration against the sources' figures, determinism, CSV round trip, bad specs."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from hypothesis import given
from hypothesis import strategies as st

from servingplan.simulate import workload


def test_capstone_total_output_matches_the_source_within_3_percent():
    totals = [workload.generate(workload.CAPSTONE, seed).output_tokens.sum() for seed in range(20)]
    assert np.mean(totals) == pytest.approx(48_136, rel=0.03)


def test_capstone_shape():
    trace = workload.generate(workload.CAPSTONE, 0)
    assert len(trace) == 600
    assert trace.prompt_tokens.min() >= 16 and trace.prompt_tokens.max() <= 512
    assert trace.output_tokens.min() >= 8 and trace.output_tokens.max() <= 256


def test_exercise2_lengths_match_the_exercise():
    trace = workload.generate(workload.EXERCISE2, 0)
    assert len(trace) == 2000
    assert trace.prompt_tokens.mean() == pytest.approx(550, rel=0.05)
    assert trace.output_tokens.mean() == pytest.approx(165, rel=0.05)
    assert (trace.output_tokens > 1000).any()


def test_poisson_arrivals_have_the_requested_rate():
    trace = workload.generate({**workload.CAPSTONE, "num_requests": 20_000, "rate": 4.0}, seed=1)
    gaps = np.diff(trace.arrival_s)
    assert np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() == pytest.approx(0.25, rel=0.05)      # exponential: sd = mean


def test_same_seed_same_trace_different_seed_different_trace():
    a, b, c = (workload.generate(workload.EXERCISE2, s) for s in (7, 7, 8))
    for name in ("arrival_s", "prompt_tokens", "output_tokens"):
        assert np.array_equal(getattr(a, name), getattr(b, name))
        assert not np.array_equal(getattr(a, name), getattr(c, name))


def test_a_rate_change_rescales_arrivals_and_keeps_lengths():
    slow = workload.generate({**workload.CAPSTONE, "rate": 2.0}, seed=3)
    fast = workload.generate({**workload.CAPSTONE, "rate": 8.0}, seed=3)
    assert np.allclose(fast.arrival_s * 4, slow.arrival_s)
    assert np.array_equal(fast.output_tokens, slow.output_tokens)
    rescaled = slow.with_rate(8.0)
    assert len(rescaled) / rescaled.duration_s == pytest.approx(8.0)
    assert np.array_equal(rescaled.prompt_tokens, slow.prompt_tokens)


def test_trace_csv_round_trip(tmp_path):
    trace = workload.generate({**workload.EXERCISE2, "num_requests": 50}, seed=2)
    path = tmp_path / "trace.csv"
    trace.to_frame().to_csv(path, index=False)
    back = workload.generate({"trace_csv": str(path)}, seed=99)
    assert np.array_equal(back.arrival_s, trace.arrival_s)
    assert np.array_equal(back.prompt_tokens, trace.prompt_tokens)
    assert np.array_equal(back.output_tokens, trace.output_tokens)


def test_trace_csv_is_sorted_by_arrival(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens\n2.0,5,6\n1.0,7,8\n")
    trace = workload.load_trace_csv(path)
    assert list(trace.arrival_s) == [1.0, 2.0] and list(trace.prompt_tokens) == [7, 5]


@pytest.mark.parametrize("spec, match", [
    ({**workload.CAPSTONE, "rate": 0.0}, "rate"),
    ({**workload.CAPSTONE, "rate": -1.0}, "rate"),
    ({**workload.CAPSTONE, "output": {"dist": "pareto", "min": 1, "max": 9}}, "pareto"),
    ({**workload.CAPSTONE, "output": {"dist": "lognormal", "mean": 500, "sigma": 1.0, "min": 8, "max": 256}},
     "mean"),
])
def test_bad_specs_raise_value_error(spec, match):
    with pytest.raises(ValueError, match=match):
        workload.generate(spec, 0)


def test_a_csv_without_the_columns_is_refused(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("time,prompt\n1,2\n")
    with pytest.raises(ValueError, match="missing columns"):
        workload.load_trace_csv(path)


def test_misaligned_arrays_are_refused():
    with pytest.raises(ValueError, match="length"):
        workload.Trace(np.zeros(3), np.zeros(2, int), np.zeros(3, int))


@given(dist=st.sampled_from(["uniform", "loguniform", "lognormal"]), lo=st.integers(1, 50),
       width=st.integers(2, 500), seed=st.integers(0, 2**32 - 1))
def test_lengths_stay_in_range(dist, lo, width, seed):
    hi = lo + width
    spec = {"dist": dist, "min": lo, "max": hi, "mean": lo + width / 3, "sigma": 0.8}
    lengths = workload.draw_lengths(spec, 500, np.random.default_rng(seed))
    assert lengths.dtype == np.int64
    assert lengths.min() >= lo and lengths.max() <= hi


def test_clipped_lognormal_hits_its_mean():
    spec = {"dist": "lognormal", "mean": 80.2, "sigma": 0.8, "min": 8, "max": 256}
    assert workload.expected_length(spec) == pytest.approx(80.2, rel=0.01)
    assert workload.expected_length({"dist": "constant", "value": 42}) == 42


@pytest.mark.parametrize("column", ["prompt_tokens", "output_tokens"])
def test_trace_csv_refuses_zero_token_requests(tmp_path, column):
    frame = pd.DataFrame({"arrival_s": [0.0, 1.0], "prompt_tokens": [10, 20], "output_tokens": [5, 6]})
    frame.loc[1, column] = 0
    path = tmp_path / "trace.csv"
    frame.to_csv(path, index=False)
    with pytest.raises(ValueError, match=f"{column} = 0"):
        workload.load_trace_csv(path)
