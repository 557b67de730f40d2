"""The cost-model fit: exact recovery from synthetic profiles, honest held-out error, file outputs."""
import dataclasses
import json

import numpy as np
import pandas as pd
import pytest

from servingplan import costmodel
from servingplan.costmodel import CostModel
from servingplan.profiling.fit import (
    DECODE_TERMS, PREFILL_TERMS, fit_profile, holdout_mask, nonnegative_lstsq, run_fit,
)
from servingplan.profiling.measure import run_profile

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
    return points


def synthetic_meta() -> dict:
    return {
        "machine": {"fingerprint": "0123456789", "cpu_model": "test cpu", "threads": 2},
        "model": {"source": "random", "param_count": 124_439_808, "non_embedding_param_count": 85_056_000,
                  "n_layer": 12, "n_embd": 768, "vocab_size": 50257},
        "memory": {"param_bytes": 497_759_232, "kv_bytes_per_token": 73_728},
        "roofline": {"bandwidth_gbs": 20.0, "gemm_gflops": 100.0},
        "settings": {"tiny": False},
        "wall_time_s": 1.0,
    }


def coefficients(model: CostModel) -> dict:
    return {term: getattr(model, term) for term in PREFILL_TERMS + DECODE_TERMS}


def test_fit_recovers_known_coefficients_exactly():
    fit = fit_profile(synthetic_points(KNOWN), synthetic_meta(), holdout_fraction=0.25, mape_goal=0.05, seed=0)
    for term, value in coefficients(KNOWN).items():
        assert getattr(fit.cost_model, term) == pytest.approx(value, rel=1e-6), term
        assert fit.report["validation_coefficients"][term] == pytest.approx(value, rel=1e-6), term
    assert fit.cost_model.ctx_mode == "padded_max"
    assert fit.report["r2"]["prefill"] == pytest.approx(1.0) and fit.report["r2"]["decode"] == pytest.approx(1.0)
    assert fit.report["heldout_mape"] < 1e-6 and fit.report["goal_met"]


def test_fit_keeps_zero_terms_at_zero():
    fit = fit_profile(synthetic_points(costmodel.EXERCISE2), synthetic_meta(), 0.25, 0.05, seed=1)
    for term, value in coefficients(costmodel.EXERCISE2).items():
        assert getattr(fit.cost_model, term) == pytest.approx(value, rel=1e-6, abs=1e-15), term


def test_heldout_mape_is_measured_on_heldout_points_by_the_training_fit():
    points = synthetic_points(KNOWN)
    held = fit_profile(points, synthetic_meta(), 0.25, 0.05, seed=0).predictions.in_holdout.to_numpy()
    # Only held-out points are off the model: a fit that never saw them stays exact and misses each by 10/110.
    points.loc[held, "median_s"] *= 1.1
    fit = fit_profile(points, synthetic_meta(), 0.25, 0.05, seed=0)
    assert fit.report["heldout_mape"] == pytest.approx(0.1 / 1.1, rel=1e-6)
    assert not fit.report["goal_met"]
    trained = fit.predictions[~fit.predictions.in_holdout & fit.predictions.used_in_fit]
    assert np.abs(trained.validation_error_pct).max() < 1e-6


def test_points_slowed_by_other_load_are_left_out_of_the_fit():
    points = synthetic_points(KNOWN)
    points["cpu_share"] = 0.97
    contended = points.point_id.isin([0, 5, 22, 30, 40])
    points.loc[contended, "median_s"] *= 3
    points.loc[contended, "cpu_share"] = 0.4
    fit = fit_profile(points, synthetic_meta(), 0.25, 0.05, seed=0)
    for term, value in coefficients(KNOWN).items():
        assert getattr(fit.cost_model, term) == pytest.approx(value, rel=1e-6), term
    assert sorted(fit.report["contention"]["excluded_point_ids"]) == [0, 5, 22, 30, 40]
    assert not fit.predictions[contended].used_in_fit.any() and not fit.predictions[contended].in_holdout.any()


def test_a_kind_mostly_slowed_by_other_load_keeps_its_points():
    points = synthetic_points(KNOWN)
    points["cpu_share"] = np.where(points.kind == "prefill_cached", 0.4, 0.97)
    fit = fit_profile(points, synthetic_meta(), 0.25, 0.05, seed=0)
    assert fit.predictions[points.kind == "prefill_cached"].used_in_fit.all()
    assert fit.report["contention"]["excluded_point_ids"] == []
    assert len(fit.report["contention"]["kept_contended_point_ids"]) == 4


def test_decode_below_the_fitted_batch_range_stays_out_of_the_line_but_enters_the_table():
    points = synthetic_points(KNOWN)
    batch_one = ((points.kind == "decode") & (points.batch == 1)).to_numpy()
    points.loc[batch_one, "median_s"] *= 0.5
    fit = fit_profile(points, synthetic_meta(), 0.25, 0.05, seed=0)
    for term, value in coefficients(KNOWN).items():
        if term != "decode_per_ctx_token_s":  # the table's c, which batch 1's halved context term pulls
            assert getattr(fit.cost_model, term) == pytest.approx(value, rel=1e-6), term
    assert fit.report["decode_batch_table"]["line_per_ctx_token_s"] == pytest.approx(3e-8, rel=1e-6)
    assert fit.report["decode_below_min_batch"]["measured_over_line"] == pytest.approx(0.5)
    assert fit.predictions[batch_one].used_in_fit.all()
    assert dict(fit.cost_model.decode_batch_fixed_s)[1] == pytest.approx(0.5 * (0.03 + 2.5e-3), rel=0.02)
    assert np.abs(fit.predictions[batch_one].error_pct).max() < 2.0


# f(B) with the kernel switch seen on the profiling CPU: fast at batch 1, a bump at 2-3, a dip at 4-8
BUMPY_FIXED_S = {1: 0.030, 2: 0.060, 3: 0.085, 4: 0.066, 5: 0.064, 6: 0.074, 7: 0.095, 8: 0.080,
                 12: 0.095, 16: 0.105, 24: 0.125, 32: 0.145, 48: 0.185, 64: 0.225}


def test_fit_recovers_a_nonlinear_per_batch_decode_time_and_it_predicts_better_held_out():
    bumpy = dataclasses.replace(KNOWN, decode_batch_fixed_s=tuple(BUMPY_FIXED_S.items()))
    points = synthetic_points(bumpy, decode_batches=tuple(BUMPY_FIXED_S))
    fit = fit_profile(points, synthetic_meta(), 0.25, 0.05, seed=0)
    # c is shared by every batch, so the line's c is exact even though a + b B misses the bumps
    assert fit.cost_model.decode_per_ctx_token_s == pytest.approx(KNOWN.decode_per_ctx_token_s, rel=1e-6)
    assert dict(fit.cost_model.decode_batch_fixed_s) == pytest.approx(BUMPY_FIXED_S, rel=1e-6)
    table = fit.report["decode_batch_table"]
    assert table["batches"] == list(BUMPY_FIXED_S)
    assert table["heldout_mape"]["with_table"] < 1e-6 < table["heldout_mape"]["line_only"]
    assert fit.report["heldout_mape"] < fit.report["heldout_mape_line_only"]
    assert max(map(abs, table["mean_signed_error_pct_by_batch"]["with_table"].values())) < 1e-6
    assert max(map(abs, table["mean_signed_error_pct_by_batch"]["line_only"].values())) > 5
    assert np.abs(fit.predictions.error_pct[fit.predictions.used_in_fit]).max() < 1e-6


def test_decode_table_is_built_from_training_points_only():
    bumpy = dataclasses.replace(KNOWN, decode_batch_fixed_s=tuple(BUMPY_FIXED_S.items()))
    points = synthetic_points(bumpy, decode_batches=tuple(BUMPY_FIXED_S))
    held = fit_profile(points, synthetic_meta(), 0.25, 0.05, seed=0).predictions.in_holdout.to_numpy()
    decode_held = held & (points.kind == "decode").to_numpy()
    points.loc[decode_held, "median_s"] *= 1.1
    fit = fit_profile(points, synthetic_meta(), 0.25, 0.05, seed=0)
    # the training-split table never saw the slowed points, so it misses each by exactly 10/110
    assert fit.report["decode_batch_table"]["heldout_mape"]["with_table"] == pytest.approx(0.1 / 1.1, rel=1e-6)


def test_holdout_is_seeded_per_kind_and_leaves_training_points():
    points = synthetic_points(KNOWN)
    first, again, other = (holdout_mask(points, 0.25, seed) for seed in (5, 5, 6))
    assert np.array_equal(first, again) and not np.array_equal(first, other)
    for kind, rows in points.groupby("kind").groups.items():
        assert first[rows].sum() == min(round(0.25 * len(rows)), len(rows) - 1), kind


def test_nonnegative_lstsq_satisfies_the_optimality_conditions():
    rng = np.random.default_rng(0)
    for _ in range(20):
        matrix = rng.normal(size=(30, 5))
        target = rng.normal(size=30)
        solution = nonnegative_lstsq(matrix, target)
        gradient = matrix.T @ (target - matrix @ solution)
        assert (solution >= 0).all()
        assert np.abs(gradient[solution > 0]).max(initial=0) < 1e-9
        assert gradient[solution == 0].max(initial=-1) < 1e-9


def test_physical_readings_compare_coefficients_with_their_roofline_floor():
    physical = fit_profile(synthetic_points(KNOWN), synthetic_meta(), 0.25, 0.05, 0).report["physical"]
    assert physical["decode_fixed_s"]["floor"] == pytest.approx(497_759_232 / 20e9)
    assert physical["decode_fixed_s"]["ratio_to_floor"] == pytest.approx(0.03 / (497_759_232 / 20e9), rel=1e-6)
    assert physical["decode_per_ctx_token_s"]["floor"] == pytest.approx(73_728 / 20e9)
    assert physical["prefill_per_token_s"]["floor"] == pytest.approx(2 * 85_056_000 / 100e9)


def test_quick_profile_fit_writes_the_cost_model_report_and_predictions(tmp_path):
    profile = run_profile({"threads": 0}, {"source": "random", "dtype": "float32"}, seed=0, quick=True,
                          progress=False)
    paths = tmp_path / "points.csv", tmp_path / "samples.csv", tmp_path / "meta.json"
    profile.write(*paths)
    outputs = tmp_path / "cost_model.json", tmp_path / "fit_report.json", tmp_path / "predictions.csv"
    run_fit(paths[0], paths[2], {"holdout_fraction": 0.25, "mape_goal": 0.05}, 0, *outputs)

    model = costmodel.load(outputs[0])
    assert model.ctx_mode == "padded_max"
    assert model.meta["machine_fingerprint"] == profile.meta["machine"]["fingerprint"]
    assert all(getattr(model, term) >= 0 for term in PREFILL_TERMS + DECODE_TERMS)
    report = json.loads(outputs[1].read_text())
    assert set(report["coefficients"]) == set(PREFILL_TERMS + DECODE_TERMS)
    assert {"r2", "heldout_mape", "heldout_mape_line_only", "goal_met", "physical", "residual_structure",
            "decode_batch_table"} <= set(report)
    assert [batch for batch, _ in model.decode_batch_fixed_s] == report["decode_batch_table"]["batches"]
    predictions = pd.read_csv(outputs[2])
    assert len(predictions) == len(profile.points)
    assert list(predictions.columns) == [
        "point_id", "kind", "batch", "prompt_len", "cached", "measured_s", "predicted_s", "error_pct",
        "in_holdout", "validation_predicted_s", "validation_error_pct", "used_in_fit", "cpu_share"]
    assert predictions.in_holdout.any() and not predictions[predictions.kind == "prefill_batch"].used_in_fit.any()
