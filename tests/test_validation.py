import numpy as np
import pandas as pd
import pytest

from servingplan.profiling.model import QUICK_CONFIG_OVERRIDES, load_model
from servingplan.validation import _profiled_points, headline, machine_drift

PROFILE = pd.DataFrame([
    {"kind": "prefill", "batch": 1, "prompt_len": 64, "cached": 0, "median_s": 0.01},
    {"kind": "prefill", "batch": 1, "prompt_len": 128, "cached": 0, "median_s": 0.02},
    {"kind": "prefill", "batch": 1, "prompt_len": 32, "cached": 0, "median_s": 0.005},
    {"kind": "decode", "batch": 1, "prompt_len": 1, "cached": 16, "median_s": 0.002},
    {"kind": "decode", "batch": 2, "prompt_len": 1, "cached": 16, "median_s": 0.003},
    {"kind": "decode", "batch": 4, "prompt_len": 1, "cached": 16, "median_s": 0.004},
    {"kind": "decode", "batch": 2, "prompt_len": 1, "cached": 64, "median_s": 0.0035},
])


def test_probe_points_are_the_longest_prefills_and_small_decode_batches():
    points = [(p.kind, p.batch, p.prompt_len, p.cached) for p, _ in _profiled_points(PROFILE)]
    assert points == [("decode", 2, 1, 64), ("prefill", 1, 64, 0), ("prefill", 1, 128, 0)]


def test_machine_drift_retimes_the_profiled_points():
    model, _ = load_model("random", 0, QUICK_CONFIG_OVERRIDES)
    drift = machine_drift(model, PROFILE, seed=0)
    assert len(drift["points"]) == 3
    for point in drift["points"]:
        assert point["now_s"] > 0 and point["ratio"] == pytest.approx(point["now_s"] / point["profiled_s"])
    assert drift["ratio"] == pytest.approx(np.median([p["ratio"] for p in drift["points"]]))


def comparison_rows(model_name, diff):
    rows = []
    for metric, stat in [("ttft", "p90"), ("tpot", "mean")]:
        rows.append({"metric": metric, "stat": stat, "diff_pct": diff, "load_fraction": 0.5, "cost_model": model_name})
        rows.append({"metric": metric, "stat": stat, "diff_pct": 99.0, "load_fraction": 1.3, "cost_model": model_name})
    return rows


def test_headline_judges_both_models_below_85_percent_load_and_corrects_step_errors():
    comparison = pd.DataFrame(comparison_rows("as_fitted", -20.0) + comparison_rows("drift_corrected", -4.0))
    steps = pd.DataFrame({"error_pct": [-20.0, -10.0]})
    out = headline(comparison, steps, {"goal_pct": 10}, drift=1.25)
    assert out["as_fitted"] == {"worst_abs_ttft_p90_diff_pct": 20.0, "worst_abs_tpot_mean_diff_pct": 20.0, "met": False}
    assert out["drift_corrected"]["met"] and out["drift_corrected"]["worst_abs_ttft_p90_diff_pct"] == 4.0
    assert out["met"] is False
    # a step predicted 20% fast on a machine running 1.25x slow is exact once corrected
    assert out["step_bias_drift_corrected_pct"] == pytest.approx(np.median([0.0, 12.5]))
