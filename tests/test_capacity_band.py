"""Capacity over the measured speed band: the interval covers the seeds and the machine's speed range."""
import dataclasses

import pytest

from servingplan.costmodel import CostModel
from servingplan.simulate import simulate
from servingplan.simulate.capacity import (Criterion, capacity, capacity_in_band, capacity_searches, search_rate,
                                           speed_band_models)
from servingplan.simulate.metrics import SLO, summarize
from servingplan.simulate.workload import generate

MODEL = CostModel(decode_fixed_s=0.02, decode_per_seq_s=1e-3, decode_per_ctx_token_s=1e-6, prefill_fixed_s=0.01,
                  prefill_per_token_s=2e-4, ctx_mode="padded_max",
                  meta={"speed_band": {"decode": [0.9, 1.2], "prefill": [0.8, 1.25]}})
WORKLOAD = {"num_requests": 60, "rate": 1.0, "prompt": {"dist": "uniform", "min": 16, "max": 128},
            "output": {"dist": "uniform", "min": 4, "max": 32}}


def test_band_models_scale_each_kind_of_call_by_its_measured_extremes():
    band = speed_band_models(MODEL)
    assert band["slow"].decode_fixed_s == pytest.approx(0.02 * 1.2)
    assert band["slow"].prefill_per_token_s == pytest.approx(2e-4 * 1.25)
    assert band["fast"].decode_per_ctx_token_s == pytest.approx(1e-6 * 0.9)
    assert band["fast"].prefill_fixed_s == pytest.approx(0.01 * 0.8)
    assert speed_band_models(dataclasses.replace(MODEL, meta={})) == {}


def test_capacity_interval_covers_the_seeds_at_every_measured_speed():
    seeds = [0, 1, 2]
    traces = [generate(WORKLOAD, seed) for seed in seeds]
    args = ("continuous", 4, 512, Criterion(SLO(), attainment_goal=0.0), 0.05, 64.0, 0.02)
    found = capacity_in_band(traces, seeds, MODEL, *args)
    nominal = capacity(traces, seeds, MODEL, *args)
    assert found["capacity_rps"] == nominal["capacity_rps"]
    slow, fast = found["speed_band"]["slow"], found["speed_band"]["fast"]
    assert slow["capacity_rps"] < nominal["capacity_rps"] < fast["capacity_rps"]
    low, high = found["interval_rps"]
    assert low == min(slow["capacity_min_rps"], nominal["capacity_min_rps"])
    assert high == max(fast["capacity_max_rps"], nominal["capacity_max_rps"])
    assert low <= nominal["capacity_min_rps"] <= nominal["capacity_max_rps"] <= high


def full_run_holds(trace, rate, model, policy, cap, criterion) -> bool:
    return criterion.holds(summarize(simulate(trace.with_rate(rate), model, policy, cap, 512, 200, 16), criterion.slo))


def test_shared_bounded_searches_agree_with_plain_bisection_within_the_tolerance():
    """The shared, bounded, early-stopped searches give brackets as valid as a plain bisection's on full
    runs (holds at lower, fails at upper, within the tolerance), and where the statistic is monotone
    across both brackets, lower ends within the tolerance of each other. (An SLO statistic need not be
    monotone in the rate on one draw: then each search finds one of its crossings.)"""
    seeds, tolerance, compared, runs = [0, 1], 0.05, 0, {"shared": 0, "plain": 0}
    traces = [generate(WORKLOAD, seed) for seed in seeds]
    criteria = {"ttft": Criterion(SLO(ttft_ms=400.0, ttft_percentile=90)),
                "joint": Criterion(SLO(ttft_ms=400.0, ttft_percentile=90, tpot_ms=60.0), attainment_goal=0.9),
                "stable": Criterion(SLO(), attainment_goal=0.0)}
    models = {"fitted": MODEL, **speed_band_models(MODEL)}
    for policy, cap in (("static", 2), ("continuous", 4), ("continuous_chunked", 8)):
        found = capacity_searches(traces, seeds, MODEL, policy, cap, 512, criteria, 0.05, 64.0, tolerance, 200, 16)
        for name, criterion in criteria.items():
            for model_name, model in models.items():
                shared = found[name] if model_name == "fitted" else found[name]["speed_band"][model_name]
                for trace, bracket in zip(traces, shared["per_seed"]):
                    plain = search_rate(lambda rate: full_run_holds(trace, rate, model, policy, cap, criterion),
                                        0.05, 64.0, tolerance)
                    assert bracket["censored"] == plain["censored"] == ""
                    assert bracket["upper"] / bracket["lower"] - 1 <= tolerance
                    runs["shared"] += bracket["evaluations"]
                    runs["plain"] += plain["evaluations"]
                    ends = sorted({bracket["lower"], bracket["upper"], plain["lower"], plain["upper"]})
                    verdicts = [full_run_holds(trace, rate, model, policy, cap, criterion) for rate in ends]
                    assert verdicts[ends.index(bracket["lower"])] and not verdicts[ends.index(bracket["upper"])]
                    if verdicts == sorted(verdicts, reverse=True):      # one crossing: the same threshold
                        compared += 1
                        assert plain["lower"] / (1 + tolerance) <= bracket["lower"] <= plain["lower"] * (1 + tolerance)
    assert compared >= 40
    assert runs["shared"] * 2 < runs["plain"]
