"""The validation stage's measurements: the speed probe, the path check, agreement and step tables."""
import numpy as np
import pandas as pd
import pytest

from servingplan.profiling.measure import QUICK_PROFILE
from servingplan.profiling.model import QUICK_CONFIG_OVERRIDES, load_model
from servingplan.serving.replay import bootstrap_interval
from servingplan.validation import SpeedProbe, agreement, headline, path_check, steps_by_batch, validation_traces


@pytest.fixture(scope="module")
def model():
    return load_model("random", 0, QUICK_CONFIG_OVERRIDES)[0]


def profile_meta(decode_s=0.002, prefill_s=0.004):
    return {"settings": dict(QUICK_PROFILE),
            "speed": {"by_kind": {"decode": {"median_s": decode_s}, "prefill": {"median_s": prefill_s}}},
            "roofline": {"bandwidth_gbs": 20.0, "gemm_gflops": 100.0, "probe_bytes": 2**20, "gemm_size": 64}}


def test_speed_probe_compares_the_references_with_the_profile_median(model):
    probe = SpeedProbe(model, profile_meta(), seed=0)
    ratios = probe.measure("now")
    assert set(ratios) == {"decode", "prefill"}
    for row in probe.rows:
        assert row["ratio"] == pytest.approx(row["seconds"] / row["profiled_s"]) and row["label"] == "now"
    assert probe.probes[0]["gemm_over_profile"] == pytest.approx(probe.probes[0]["gemm_gflops"] / 100.0)


def test_path_check_times_engine_steps_and_profile_points_of_each_shape(model):
    checked = path_check(model, profile_meta(), seed=0, shapes=((1, 16), (3, 16)), steps=4, rounds=2)
    assert [(row["batch"], row["context"]) for row in checked["shapes"]] == [(1, 16), (3, 16)]
    for row in checked["shapes"]:
        assert len(row["engine_rounds_s"]) == len(row["profile_rounds_s"]) == 2
        assert row["engine_over_profile"] == pytest.approx(row["engine_step_s"] / row["profile_point_s"])
    assert checked["median_ratio"] > 0


def test_bootstrap_interval_brackets_the_statistic_and_narrows_with_more_requests():
    rng = np.random.default_rng(0)
    few, many = rng.exponential(size=40), rng.exponential(size=4000)
    lo, hi = bootstrap_interval(few, "p90")
    assert lo < np.percentile(few, 90) < hi
    lo_many, hi_many = bootstrap_interval(many, "p90")
    assert hi_many - lo_many < hi - lo
    assert bootstrap_interval(few, "mean") == bootstrap_interval(few, "mean")


def comparison_rows(model_name, diff, inside):
    rows = []
    for metric, stat in [("ttft", "p90"), ("tpot", "mean")]:
        for fraction, d in ((0.4, diff), (1.3, 99.0)):
            measured = 100.0
            simulated = measured * (1 + d / 100)
            lo, hi = (min(measured, simulated) - 1, max(measured, simulated) + 1) if inside else (99.0, 101.0)
            rows.append({"metric": metric, "stat": stat, "diff_pct": d, "load_fraction": fraction,
                         "cost_model": model_name, "measured_ms": measured, "simulated_ms": simulated,
                         "measured_lo_ms": lo, "measured_hi_ms": hi})
    return rows


def test_agreement_is_inside_the_interval_or_within_the_goal():
    rows = pd.DataFrame(comparison_rows("as_fitted", -20.0, inside=True) + comparison_rows("x", -20.0, inside=False)
                        + comparison_rows("y", -8.0, inside=False))
    judged = rows[rows.load_fraction < 1]
    assert list(agreement(judged, 10.0)) == [True, True, False, False, True, True]


def test_headline_judges_loads_up_to_085_and_the_step_table():
    comparison = pd.DataFrame(comparison_rows("as_fitted", -20.0, inside=False)
                              + comparison_rows("drift_corrected", -4.0, inside=False))
    steps = pd.DataFrame({"batch": [1] * 25 + [2] * 5, "n_prefill_calls": 0, "duration_s": 0.1,
                          "predicted_s": 0.09, "corrected_s": 0.1, "error_pct": -10.0, "corrected_error_pct": 0.0})
    steps.loc[25:, "corrected_error_pct"] = 50.0
    by_batch = steps_by_batch(steps)
    assert list(by_batch.batch) == [1, 2] and list(by_batch.judged) == [True, False]
    out = headline(comparison, by_batch, {"goal_pct": 10})
    assert not out["as_fitted"]["met"] and out["as_fitted"]["worst_abs_ttft_p90_diff_pct"] == 20.0
    assert out["drift_corrected"]["met"] and out["drift_corrected"]["judged"] == 2
    assert out["met"] and out["steps"]["met"] and out["steps"]["judged_batches"] == [1]


def test_validation_replays_only_the_first_requests_of_a_trace_file(tmp_path):
    # 500 requests: replayed whole in real time, the stage would serve for minutes at these rates
    path = tmp_path / "log.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens\n"
                    + "".join(f"{i * 0.25},{16 + i},{8 + i % 5}\n" for i in range(500)))
    workload = {"num_requests": 120, "rate": 6.0, "trace": {"path": str(path)}}
    validation = {"rates_fraction": [0.5, 2.0], "trace_seconds": 5, "min_requests": 6}
    traces = list(validation_traces(workload, validation, stable_rps=2.0, seed=0))
    # 0.5 x 2 req/s for 5 s is 5 requests, raised to min_requests; 2 x 2 req/s for 5 s is 20
    assert [(fraction, rate, len(trace)) for fraction, rate, trace in traces] == [(0.5, 1.0, 6), (2.0, 4.0, 20)]
    for (_, rate, trace), n in zip(traces, (6, 20)):
        assert trace.prompt_tokens.tolist() == list(range(16, 16 + n))
        assert trace.mean_rate_rps == pytest.approx(rate)
