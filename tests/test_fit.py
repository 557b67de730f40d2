"""The cost-model fit: exact recovery from synthetic profiles, honest held-out error, file outputs."""
import dataclasses
import json

import numpy as np
import pandas as pd
import pytest

from servingplan import architecture, costmodel, roofline
from servingplan.costmodel import CostModel
from servingplan.fit.step_model import (
    DECODE_TERMS, PREFILL_TERMS, SELECTION_MARGIN, fit_profile, fit_relative, holdout_mask, run_fit,
)

KNOWN = CostModel(decode_fixed_s=0.03, decode_per_seq_s=2.5e-3, decode_per_ctx_token_s=3e-8,
                  prefill_fixed_s=0.02, prefill_per_token_s=1.2e-3, prefill_per_token_sq_s=4e-7,
                  prefill_per_token_ctx_s=2e-7, ctx_mode="padded_max")


def synthetic_points(model: CostModel, decode_batches=(1, 2, 4, 8, 16, 24, 32, 48, 64)) -> pd.DataFrame:
    """A profile grid with every median exactly what `model` predicts."""
    shapes = [("prefill", 1, length, 0) for length in (16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512)]
    shapes += [("prefill_batch", batch, 128, 0) for batch in (1, 2, 4)]
    shapes += [("prefill_cached", 1, chunk, cached) for chunk in (128, 256) for cached in (256, 512)]
    shapes += [("decode", batch, 1, context)
               for batch in decode_batches for context in (64, 256, 512, 768)]
    points = pd.DataFrame(shapes, columns=["kind", "batch", "prompt_len", "cached"])
    points.insert(0, "point_id", range(len(points)))
    points["median_s"] = [
        model.decode_time(b, b * ctx, ctx) if kind == "decode" else b * model.prefill_time(length, ctx)
        for kind, b, length, ctx in zip(points.kind, points.batch, points.prompt_len, points.cached)]
    points["spread_pct"] = 0.0
    return points


def rounds_of(points: pd.DataFrame, factors: np.ndarray | None = None, n_rounds: int = 4) -> tuple:
    """(points, samples) as the profiler writes them: every point measured in `n_rounds` rounds, round
    r of point i taking median_s x factors[i, r] (1 everywhere by default); median_s becomes the median
    over rounds."""
    factors = np.ones((len(points), n_rounds)) if factors is None else factors
    values = points["median_s"].to_numpy()[:, None] * factors
    samples = pd.DataFrame([{"point_id": pid, "kind": kind, "round": r, "repeat": 0, "normalized_s": values[i, r]}
                            for i, (pid, kind) in enumerate(zip(points.point_id, points.kind))
                            for r in range(factors.shape[1])])
    points = points.assign(median_s=np.median(values, axis=1),
                           spread_pct=100 * (values.max(axis=1) - values.min(axis=1)) / np.median(values, axis=1))
    return points, samples


def fit_of(points, factors=None, holdout=0.25, goal=0.05, seed=0, meta=None):
    points, samples = rounds_of(points, factors)
    return fit_profile(points, samples, meta or synthetic_meta(), holdout, goal, seed)


# A roofline under every term of KNOWN (its c, 30 ns per KV token, reads 74 kB at 2.5 TB/s), so the
# floors bound nothing there and the fit recovers KNOWN exactly.
PEAK = {"bandwidth_gbs": 5000.0, "gemm_gflops": 2000.0}


def synthetic_meta(peak: dict = PEAK) -> dict:
    return {
        "machine": {"fingerprint": "0123456789", "cpu_model": "test cpu", "threads": 2},
        "model": {"source": "random", "param_count": 124_439_808, "non_embedding_param_count": 85_056_000,
                  **architecture.GPT2_SMALL},
        "memory": {"param_bytes": 497_759_232, "kv_bytes_per_token": 73_728},
        "roofline": dict(peak),
        "settings": {"tiny": False},
        "wall_time_s": 1.0,
    }


def coefficients(model: CostModel) -> dict:
    return {term: getattr(model, term) for term in PREFILL_TERMS + DECODE_TERMS}


def test_fit_recovers_known_coefficients_exactly():
    fit = fit_of(synthetic_points(KNOWN))
    for term, value in coefficients(KNOWN).items():
        assert getattr(fit.cost_model, term) == pytest.approx(value, rel=1e-6), term
        assert fit.report["validation_coefficients"][term] == pytest.approx(value, rel=1e-6), term
    assert fit.cost_model.ctx_mode == "padded_max"
    assert fit.cost_model.decode_batch_fixed_s == ()  # a line that fits every round needs no table
    assert fit.report["r2"]["prefill"] == pytest.approx(1.0) and fit.report["r2"]["decode"] == pytest.approx(1.0)
    assert fit.report["heldout_mape"] < 1e-6 and fit.report["goal_met"]


def test_fit_keeps_zero_terms_at_zero_and_drops_the_optional_ones_that_do_not_help():
    # on a machine whose floors are all below 1e-15 s: the form's selection alone, not the bound
    unbounded = synthetic_meta({"bandwidth_gbs": 1e16, "gemm_gflops": 1e16})
    fit = fit_of(synthetic_points(costmodel.EXERCISE2), seed=1, meta=unbounded)
    for term, value in coefficients(costmodel.EXERCISE2).items():
        assert getattr(fit.cost_model, term) == pytest.approx(value, rel=1e-6, abs=1e-15), term
    assert fit.report["form"]["prefill_terms"] == ["prefill_fixed_s", "prefill_per_token_s"]


def test_heldout_mape_is_measured_on_heldout_points_by_the_training_fit():
    points = synthetic_points(KNOWN)
    held = fit_of(points).predictions.in_holdout.to_numpy()
    # Only held-out points are off the model: a fit that never saw them stays exact and misses each by 10/110.
    points.loc[held, "median_s"] *= 1.1
    fit = fit_of(points)
    assert fit.report["heldout_mape"] == pytest.approx(0.1 / 1.1, rel=1e-6)
    assert not fit.report["goal_met"]
    trained = fit.predictions[~fit.predictions.in_holdout & fit.predictions.used_in_fit]
    assert np.abs(trained.validation_error_pct).max() < 1e-6


# f(B) with the kernel switch seen on the profiling CPU: fast at batch 1, a bump at 2-3, a dip at 4-8
BUMPY_FIXED_S = {1: 0.030, 2: 0.060, 3: 0.085, 4: 0.066, 5: 0.064, 6: 0.074, 7: 0.095, 8: 0.080,
                 12: 0.095, 16: 0.105, 24: 0.125, 32: 0.145, 48: 0.185, 64: 0.225}


def sawtooth(points: pd.DataFrame, amplitude: float, n_rounds: int = 4) -> np.ndarray:
    """Round factors that push each decode batch up in some rounds and down in others, by a pattern
    that changes from round to round: noise, not a property of the batch."""
    position = {batch: i for i, batch in enumerate(sorted(points["batch"].unique()))}
    signs = np.array([[(-1) ** (r + position[b]) for r in range(n_rounds)] for b in points["batch"]])
    decode = (points["kind"] == "decode").to_numpy()[:, None]
    return np.where(decode, 1 + amplitude * signs, 1.0)


def test_a_sawtooth_that_is_not_there_in_every_round_gets_no_table():
    points = synthetic_points(KNOWN, decode_batches=tuple(BUMPY_FIXED_S))
    fit = fit_of(points, sawtooth(points, 0.10))
    scores = fit.report["selection"]["decode_table"]
    assert all(not score["kept"] for score in scores.values())
    assert all(score["line_round_mape"] < score["table_round_mape"] for score in scores.values())
    assert fit.cost_model.decode_batch_fixed_s == ()


def test_the_table_is_kept_exactly_where_it_beats_the_line_on_held_out_rounds():
    bumpy = dataclasses.replace(KNOWN, decode_batch_fixed_s=tuple(BUMPY_FIXED_S.items()))
    points = synthetic_points(bumpy, decode_batches=tuple(BUMPY_FIXED_S))
    fit = fit_of(points, sawtooth(points, 0.03))
    scores = fit.report["selection"]["decode_table"]
    kept = [int(batch) for batch, score in scores.items() if score["kept"]]
    for batch, score in scores.items():
        assert score["kept"] == (score["table_round_mape"] < score["line_round_mape"] - SELECTION_MARGIN), batch
    assert fit.report["form"]["table_batches"] == kept
    # the kernel-switch bumps are there in every round, so they stay
    assert {1, 3, 7} <= set(kept)
    # batches without a table value of their own sit on the one line the joint fit drew through them
    table = dict(fit.cost_model.decode_batch_fixed_s)
    assert sorted(table) == sorted(BUMPY_FIXED_S)
    rest = [b for b in table if b not in kept]
    if len(rest) >= 2:
        slope = (table[rest[-1]] - table[rest[0]]) / (rest[-1] - rest[0])
        for batch in rest:
            assert table[batch] == pytest.approx(table[rest[0]] + slope * (batch - rest[0]), rel=1e-9)


def test_a_real_per_batch_curve_is_recovered_and_predicts_better_held_out():
    bumpy = dataclasses.replace(KNOWN, decode_batch_fixed_s=tuple(BUMPY_FIXED_S.items()))
    fit = fit_of(synthetic_points(bumpy, decode_batches=tuple(BUMPY_FIXED_S)))
    assert fit.cost_model.decode_per_ctx_token_s == pytest.approx(KNOWN.decode_per_ctx_token_s, rel=1e-6)
    kept = fit.report["form"]["table_batches"]
    table = dict(fit.cost_model.decode_batch_fixed_s)
    for batch in kept:
        assert table[batch] == pytest.approx(BUMPY_FIXED_S[batch], rel=1e-6)
    report = fit.report["decode_batch_table"]
    assert report["heldout_mape"]["shipped"] < report["heldout_mape"]["line_only"]
    assert fit.report["heldout_mape"] < fit.report["heldout_mape_line_only"]


def test_holdout_is_seeded_per_kind_and_leaves_training_points():
    points = synthetic_points(KNOWN)
    first, again, other = (holdout_mask(points, 0.25, seed) for seed in (5, 5, 6))
    assert np.array_equal(first, again) and not np.array_equal(first, other)
    for kind, rows in points.groupby("kind").groups.items():
        assert first[rows].sum() == min(round(0.25 * len(rows)), len(rows) - 1), kind


def test_fit_relative_satisfies_the_optimality_conditions_of_the_relative_error():
    # columns spanning 1 to 1e5, as the prefill and decode features do, and terms that want to be negative
    rng = np.random.default_rng(0)
    for _ in range(20):
        features = rng.uniform(0.0, 1.0, size=(30, 5)) * np.array([1.0, 10.0, 1e3, 1e4, 1e5])
        measured = rng.uniform(0.5, 2.0, size=30)
        solution = fit_relative(features, measured)
        weighted = features / measured[:, None]
        # the gradient of the squared relative error, per unit of each column's own scale
        gradient = weighted.T @ (1.0 - weighted @ solution) / np.abs(weighted).max(axis=0)
        assert (solution >= 0).all()
        assert np.abs(gradient[solution > 0]).max(initial=0) < 1e-9
        assert gradient[solution == 0].max(initial=-1) < 1e-9


def test_physical_readings_compare_coefficients_with_their_roofline_floor():
    physical = fit_of(synthetic_points(KNOWN)).report["physical"]
    work = roofline.term_work(architecture.GPT2_SMALL)
    assert physical["decode_fixed_s"]["floor"] == pytest.approx(494_613_504 / 5000e9)
    assert physical["decode_fixed_s"]["bound"] == "memory"
    assert physical["decode_fixed_s"]["efficiency"] == pytest.approx((494_613_504 / 5000e9) / 0.03, rel=1e-6)
    assert physical["decode_fixed_s"]["ratio_to_floor"] == pytest.approx(0.03 / (494_613_504 / 5000e9), rel=1e-6)
    assert physical["decode_per_ctx_token_s"]["floor"] == pytest.approx(36_864 / 2000e9)
    assert physical["prefill_per_token_s"]["floor"] == pytest.approx(work["prefill_per_token_s"].flops / 2000e9)
    assert physical["prefill_per_token_s"]["flops"] == work["prefill_per_token_s"].flops
    assert not any(reading["at_floor"] for reading in physical.values())


# The machine's peaks put these terms' floors at 1.5x KNOWN's values: KNOWN's exact data, fitted
# without the bound, beat the roofline; with it, they may not.
BEATEN = ("decode_per_seq_s", "prefill_per_token_s", "decode_per_ctx_token_s")
SLOW_PEAK = {"gemm_gflops": roofline.term_work(architecture.GPT2_SMALL)["decode_per_seq_s"].flops / 1.5
             / KNOWN.decode_per_seq_s / 1e9,
             "bandwidth_gbs": 73_728 / 1.5 / KNOWN.decode_per_ctx_token_s / 1e9}


def test_no_fitted_term_sits_above_the_machines_roofline():
    meta = synthetic_meta(SLOW_PEAK)
    floors = {term: roofline.floor(work, SLOW_PEAK["bandwidth_gbs"], SLOW_PEAK["gemm_gflops"])[0]
              for term, work in roofline.term_work(architecture.GPT2_SMALL).items()}
    for term in BEATEN:
        assert getattr(KNOWN, term) < floors[term]
    points, samples = rounds_of(synthetic_points(KNOWN))
    # the same data fitted with no bound (floors at zero): exact, and faster than the roofline
    unbounded = fit_profile(points, samples, synthetic_meta({"bandwidth_gbs": 1e16, "gemm_gflops": 1e16}),
                            0.25, 0.05, 0)
    assert all(getattr(unbounded.cost_model, term) < floors[term] for term in BEATEN)
    fit = fit_profile(points, samples, meta, 0.25, 0.05, 0)
    for model in (fit.cost_model, CostModel(**fit.report["validation_coefficients"])):
        for term in PREFILL_TERMS + DECODE_TERMS:
            assert getattr(model, term) >= floors[term] * (1 - 1e-12), term
    physical = fit.report["physical"]
    assert all(physical[term]["at_floor"] and physical[term]["efficiency"] == pytest.approx(1.0) for term in BEATEN)
    assert all(reading["efficiency"] <= 1 + 1e-9 for reading in physical.values())
    assert fit.report["roofline_peak"] == pytest.approx({"bandwidth_gbs": SLOW_PEAK["bandwidth_gbs"],
                                                         "gemm_gflops": SLOW_PEAK["gemm_gflops"]})
    # the bound costs accuracy here, and the fit reports it rather than hiding it
    assert fit.report["heldout_mape"] > unbounded.report["heldout_mape"]


def test_a_decode_table_value_never_beats_its_batchs_floor():
    bumpy = {batch: seconds for batch, seconds in BUMPY_FIXED_S.items()}
    model = dataclasses.replace(KNOWN, decode_batch_fixed_s=tuple(bumpy.items()))
    points = synthetic_points(model, decode_batches=tuple(bumpy))
    # peaks at which batch 1's 30 ms is 2/3 of its weight read
    peak = {"bandwidth_gbs": 494_613_504 / 0.045 / 1e9, "gemm_gflops": 2000.0}
    fit = fit_of(points, meta=synthetic_meta(peak))
    table = fit.report["decode_batch_table"]
    assert 1 in table["kept_batches"]
    for seconds, floor, efficiency in zip(table["fixed_s"], table["floor_s"], table["efficiency"]):
        assert seconds >= floor * (1 - 1e-12) and efficiency <= 1 + 1e-9
    assert dict(fit.cost_model.decode_batch_fixed_s)[1] == pytest.approx(table["floor_s"][0])


def test_fit_relative_holds_each_coefficient_at_or_above_its_floor():
    rng = np.random.default_rng(3)
    for _ in range(20):
        features = rng.uniform(0.0, 1.0, size=(30, 4)) * np.array([1.0, 10.0, 1e3, 1e4])
        measured = rng.uniform(0.5, 2.0, size=30)
        floors = rng.uniform(0.0, 2e-4, size=4)
        free = np.array([True, True, True, rng.random() < 0.5])
        solution = fit_relative(features, measured, floors, free)
        assert (solution >= floors).all() and (solution[~free] == floors[~free]).all()
        weighted = features / measured[:, None]
        gradient = weighted.T @ (1.0 - weighted @ solution) / np.abs(weighted).max(axis=0)
        above = (solution > floors) & free
        # optimal: no free coefficient above its floor can move to lower the error, none at it wants down
        assert np.abs(gradient[above]).max(initial=0) < 1e-9
        assert gradient[free & ~above].max(initial=-1) < 1e-9


def test_quick_profile_fit_writes_the_cost_model_report_and_predictions(quick_profile_files, tmp_path):
    paths = quick_profile_files
    profile_meta, profile_points = json.loads(paths[2].read_text()), pd.read_csv(paths[0])
    outputs = tmp_path / "cost_model.json", tmp_path / "fit_report.json", tmp_path / "predictions.csv"
    run_fit(paths[0], paths[1], paths[2], {"holdout_fraction": 0.25, "mape_goal": 0.05}, 0, *outputs)

    model = costmodel.load(outputs[0])
    assert model.ctx_mode == "padded_max"
    assert model.meta["machine_fingerprint"] == profile_meta["machine"]["fingerprint"]
    assert set(model.meta["speed_band"]) == {"decode", "prefill"}
    assert all(getattr(model, term) >= 0 for term in PREFILL_TERMS + DECODE_TERMS)
    report = json.loads(outputs[1].read_text())
    assert set(report["coefficients"]) == set(PREFILL_TERMS + DECODE_TERMS)
    assert {"r2", "heldout_mape", "heldout_mape_line_only", "round_mape", "goal_met", "physical",
            "residual_structure", "decode_batch_table", "selection", "form"} <= set(report)
    assert [batch for batch, _ in model.decode_batch_fixed_s] == (
        report["decode_batch_table"]["batches"] if report["form"]["table_batches"] else [])
    predictions = pd.read_csv(outputs[2])
    assert len(predictions) == len(profile_points)
    assert list(predictions.columns) == [
        "point_id", "kind", "batch", "prompt_len", "cached", "measured_s", "predicted_s", "error_pct",
        "in_holdout", "validation_predicted_s", "validation_error_pct", "used_in_fit", "spread_pct"]
    assert predictions.in_holdout.any() and not predictions[predictions.kind == "prefill_batch"].used_in_fit.any()


def test_superseded_calls_are_left_out_and_extra_rounds_of_some_points_are_scored():
    points, samples = rounds_of(synthetic_points(KNOWN))
    samples = samples.assign(superseded=False)
    # a disturbed round measured again: its old calls (3x slower) superseded, the new ones exact
    disturbed = samples[samples["point_id"] < 5].assign(normalized_s=lambda s: 3 * s["normalized_s"], superseded=True)
    # two points given an extra round
    extra = samples[(samples["point_id"] == 7) & (samples["round"] == 0)].assign(round=4)
    samples = pd.concat([samples, disturbed, extra], ignore_index=True)
    fit = fit_profile(points, samples, synthetic_meta(), 0.25, 0.05, 0)
    for term, value in coefficients(KNOWN).items():
        assert getattr(fit.cost_model, term) == pytest.approx(value, rel=1e-6)
    assert np.isfinite(fit.report["round_mape"]) and fit.report["round_mape"] == pytest.approx(0.0, abs=1e-9)
