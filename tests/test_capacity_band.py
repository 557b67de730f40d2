"""Capacity over the measured speed band: the interval covers the seeds and the machine's speed range."""
import dataclasses

import pytest

from servingplan.capacity import Criterion, capacity, capacity_in_band, speed_band_models
from servingplan.costmodel import CostModel
from servingplan.metrics import SLO
from servingplan.workload import generate

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
