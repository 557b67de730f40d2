"""Fit the step-time cost model (servingplan.costmodel) to a profile and say how well it predicts.

    fit_profile(points, meta, holdout_fraction, mape_goal, seed) -> Fit
    Fit.write(cost_model_json, report_json, predictions_csv)      atomic writes
    run_fit(points_csv, meta_json, fit_cfg, seed, cost_model_json, report_json, predictions_csv) -> Fit

`points` and `meta` are what servingplan.profiling.measure writes; `fit_cfg` is config.yaml's `fit`.

Forms, each fitted by non-negative least squares on relative error (rows weighted by 1/median):
    prefill  t(L, P) = p0 + p1 L + p2 L^2 + p3 L P     on kinds prefill and prefill_cached
    decode   t(B, T) = a + b B + c B T                 on kind decode with B >= DECODE_FIT_MIN_BATCH,
                                                       T the per-sequence context
The engine pads a decode batch to its longest sequence, so the decode call reads B * max context KV
tokens: the cost model is written with ctx_mode "padded_max" (on the profile grid every sequence has
the same context, so the fit is the same for either mode).

The line a + b B does not hold at small batches (see DECODE_FIT_MIN_BATCH), so the cost model also
carries a per-batch table f(B) for every profiled decode batch, batch 1 included, fitted the same way
with one intercept per batch and a shared c:
    decode   t(B, T) = f(B) + c B T                    on kind decode, every batch
The table replaces a + b B in the cost model and its c replaces the line's: a line that misses the
bumps of f(B) biases its own c, since B T grows with B, while the table fit learns c only from how
each batch's time grows with its context. a and b stay in the cost model, b continuing the table
beyond its largest batch.

The shipped coefficients and table come from all fitted points. The held-out MAPE comes from a second
fit (coefficients and table) on the training split only (a seeded share `holdout_fraction` of each
kind held out), evaluated on the held-out points only, which estimates the error of the shipped fit on
shapes it has not seen. The report gives it with and without the table (the line alone).

Points measured while other processes competed for the cores (cpu_share < CONTENDED_CPU_SHARE) are
left out of the fit and its scores, unless that would drop more than half the points of their kind;
the report lists them. Batched prefill points are not fitted either (the engine prefills one sequence
per call); they are predicted as `batch` separate prefill calls to show what batching would save.

predictions CSV, one row per grid point: point_id, kind, batch, prompt_len, cached, measured_s,
predicted_s, error_pct (shipped fit, with the table), in_holdout, validation_predicted_s,
validation_error_pct (training-split fit, with its table), used_in_fit (in the line or the table),
cpu_share.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from servingplan.costmodel import CostModel
from servingplan.io import read_json, write_csv, write_json
from servingplan.profiling.machine import CONTENDED_CPU_SHARE

PREFILL_KINDS = ("prefill", "prefill_cached")
DECODE_KINDS = ("decode",)
CTX_MODE = "padded_max"
# PyTorch on CPU runs a batch-1 decode through matrix-vector kernels and switches to small
# matrix-matrix kernels from batch 2, which are slower per step (on the profiling machine the LM head
# alone takes 10 ms at batch 1 and 20-34 ms at batches 2-4), so no line a + b*B holds both. The
# decode line is fitted from this batch up, where it only has to carry c and the slope beyond the
# per-batch table; the report says how far smaller batches sit below it.
DECODE_FIT_MIN_BATCH = 2

PREFILL_TERMS = ("prefill_fixed_s", "prefill_per_token_s", "prefill_per_token_sq_s", "prefill_per_token_ctx_s")
DECODE_TERMS = ("decode_fixed_s", "decode_per_seq_s", "decode_per_ctx_token_s")
UNITS = {
    "prefill_fixed_s": "s per prefill call",
    "prefill_per_token_s": "s per prompt token",
    "prefill_per_token_sq_s": "s per prompt token squared",
    "prefill_per_token_ctx_s": "s per prompt token per cached token",
    "decode_fixed_s": "s per decode step",
    "decode_per_seq_s": "s per decoding sequence",
    "decode_per_ctx_token_s": "s per KV token read (batch x longest context)",
}


def prefill_features(points: pd.DataFrame) -> np.ndarray:
    tokens = points["prompt_len"].to_numpy(float)
    cached = points["cached"].to_numpy(float)
    return np.column_stack([np.ones_like(tokens), tokens, tokens**2, tokens * cached])


def decode_features(points: pd.DataFrame) -> np.ndarray:
    batch = points["batch"].to_numpy(float)
    context = points["cached"].to_numpy(float)
    return np.column_stack([np.ones_like(batch), batch, batch * context])


PARTS = {"prefill": (PREFILL_KINDS, PREFILL_TERMS, prefill_features),
         "decode": (DECODE_KINDS, DECODE_TERMS, decode_features)}


def nonnegative_lstsq(matrix: np.ndarray, target: np.ndarray) -> np.ndarray:
    """argmin ||matrix x - target|| subject to x >= 0 (Lawson and Hanson's active-set method)."""
    n_terms = matrix.shape[1]
    coefficients = np.zeros(n_terms)
    free = np.zeros(n_terms, dtype=bool)
    tolerance = 1e-12 * np.abs(matrix).max() * max(np.abs(target).max(), 1.0) * matrix.shape[0]
    gradient = matrix.T @ (target - matrix @ coefficients)
    # Each pass frees one more term; the bound only guards against rounding cycling a term in and out.
    for _ in range(3 * n_terms):
        if free.all() or gradient[~free].max() <= tolerance:
            break
        free[np.argmax(np.where(free, -np.inf, gradient))] = True
        while free.any():
            trial = np.zeros(n_terms)
            trial[free] = np.linalg.lstsq(matrix[:, free], target, rcond=None)[0]
            if trial[free].min() > 0:
                coefficients = trial
                break
            # Step toward the unconstrained solution until the first coefficient reaches zero; bind it.
            blocking = free & (trial <= 0)
            ratios = np.full(n_terms, np.inf)
            ratios[blocking] = coefficients[blocking] / (coefficients[blocking] - trial[blocking])
            first = np.argmin(ratios)
            coefficients = coefficients + ratios[first] * (trial - coefficients)
            coefficients[first] = 0.0
            free &= coefficients > 0
            coefficients[~free] = 0.0
        gradient = matrix.T @ (target - matrix @ coefficients)
    return coefficients


def fit_relative(features: np.ndarray, measured: np.ndarray) -> np.ndarray:
    """Non-negative coefficients minimising the squared relative error of the predictions."""
    weighted = features / measured[:, None]
    # Columns span 1 to L^2 ~ 1e5: scale them to one so the solver's tolerance means the same for each.
    scale = np.abs(weighted).max(axis=0)
    scale[scale == 0] = 1.0
    return nonnegative_lstsq(weighted / scale, np.ones_like(measured)) / scale


def holdout_mask(points: pd.DataFrame, fraction: float, seed: int) -> np.ndarray:
    """Hold out round(fraction * n) points of each kind, chosen by a seeded generator."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(len(points), dtype=bool)
    for kind in sorted(points["kind"].unique()):
        rows = np.flatnonzero(points["kind"].to_numpy() == kind)
        n_held = min(int(round(fraction * len(rows))), len(rows) - 1)
        mask[rng.choice(rows, size=n_held, replace=False)] = True
    return mask


def contended_mask(points: pd.DataFrame) -> np.ndarray:
    if "cpu_share" not in points:
        return np.zeros(len(points), dtype=bool)
    return points["cpu_share"].to_numpy() < CONTENDED_CPU_SHARE


def kept_mask(points: pd.DataFrame, contended: np.ndarray) -> np.ndarray:
    """Points left to fit on: the uncontended ones, except that a kind with fewer than half of its
    points clean keeps them all, since dropping them would leave its terms fitted on too few shapes."""
    clean = ~contended
    for kind in points["kind"].unique():
        rows = (points["kind"] == kind).to_numpy()
        if 2 * clean[rows].sum() < rows.sum():
            clean[rows] = True
    return clean


def mean_ratio(measured: np.ndarray, predicted: np.ndarray, rows: np.ndarray) -> float | None:
    return float(np.mean(measured[rows] / predicted[rows])) if rows.any() else None


def r_squared(measured: np.ndarray, predicted: np.ndarray) -> float:
    residual = np.sum((measured - predicted) ** 2)
    total = np.sum((measured - measured.mean()) ** 2)
    return float(1.0 - residual / total) if total > 0 else float("nan")


def mape(measured: np.ndarray, predicted: np.ndarray) -> float:
    return float(np.mean(np.abs(predicted - measured) / measured)) if len(measured) else float("nan")


def fit_terms(points: pd.DataFrame, train: np.ndarray) -> dict:
    """Coefficients of both parts, fitted on the rows of `points` where `train` is True."""
    coefficients = {}
    for kinds, terms, features in PARTS.values():
        rows = points["kind"].isin(kinds).to_numpy() & train
        values = fit_relative(features(points[rows]), points.loc[rows, "median_s"].to_numpy(float))
        coefficients.update(zip(terms, (float(v) for v in values)))
    return coefficients


def fit_decode_table(points: pd.DataFrame, train: np.ndarray) -> tuple[tuple, float]:
    """((batch, f(B)), ...) for every decode batch with training points, and c: t = f(B) + c B T
    fitted on relative error like the other forms."""
    decode = points[points["kind"].isin(DECODE_KINDS).to_numpy() & train]
    if decode.empty:
        return (), 0.0
    batch = decode["batch"].to_numpy()
    batches = np.unique(batch)
    features = np.column_stack([batch == b for b in batches] + [batch * decode["cached"].to_numpy(float)])
    values = fit_relative(features.astype(float), decode["median_s"].to_numpy(float))
    return tuple((int(b), float(v)) for b, v in zip(batches, values[:-1])), float(values[-1])


def with_decode_table(line: dict, points: pd.DataFrame, train: np.ndarray) -> tuple[dict, tuple]:
    """The line's coefficients with c taken from the table fit, and the table."""
    table, per_ctx_token_s = fit_decode_table(points, train)
    if not table:
        return line, table
    return {**line, "decode_per_ctx_token_s": per_ctx_token_s}, table


def predict(points: pd.DataFrame, coefficients: dict, decode_table: tuple = ()) -> np.ndarray:
    """Seconds the cost model gives each point (a batched prefill as `batch` single calls); decode
    points take f(B) from `decode_table` when it is not empty."""
    predicted = np.full(len(points), np.nan)
    for part, (kinds, terms, features) in PARTS.items():
        rows = points["kind"].isin(kinds).to_numpy()
        predicted[rows] = features(points[rows]) @ np.array([coefficients[t] for t in terms])
    if decode_table:
        model = CostModel(**coefficients, decode_batch_fixed_s=decode_table)
        rows = points["kind"].isin(DECODE_KINDS).to_numpy()
        batches = points.loc[rows, "batch"].to_numpy()
        line = coefficients["decode_fixed_s"] + coefficients["decode_per_seq_s"] * batches
        predicted[rows] += np.array([model.decode_batch_time(int(b)) for b in batches]) - line
    batched = (points["kind"] == "prefill_batch").to_numpy()
    single = prefill_features(points[batched]) @ np.array([coefficients[t] for t in PREFILL_TERMS])
    predicted[batched] = single * points.loc[batched, "batch"].to_numpy(float)
    return predicted


def physical_readings(coefficients: dict, meta: dict) -> dict:
    """Each coefficient next to the roofline floor of the work it pays for (ratio = coefficient/floor)."""
    model, memory, roofline = meta["model"], meta["memory"], meta["roofline"]
    bandwidth = roofline["bandwidth_gbs"] * 1e9
    gemm = roofline["gemm_gflops"] * 1e9
    matmul_flops_per_token = 2.0 * model["non_embedding_param_count"]
    attention_flops = 4.0 * model["n_layer"] * model["n_embd"]
    lm_head_flops = 2.0 * model["n_embd"] * model["vocab_size"]
    floors = {
        "decode_fixed_s": (memory["param_bytes"] / bandwidth, "param_bytes / bandwidth: stream every weight once"),
        "decode_per_seq_s": ((matmul_flops_per_token + lm_head_flops) / gemm,
                             "2 x (non-embedding params + LM head) / GEMM rate: one more token of matmuls"),
        "decode_per_ctx_token_s": (memory["kv_bytes_per_token"] / bandwidth,
                                   "kv_bytes_per_token / bandwidth: read one cached token's K and V once"),
        "prefill_fixed_s": (memory["param_bytes"] / bandwidth,
                            "param_bytes / bandwidth: stream every weight once"),
        "prefill_per_token_s": (matmul_flops_per_token / gemm, "2 x non-embedding params / GEMM rate"),
        "prefill_per_token_sq_s": (attention_flops / gemm,
                                   "4 x n_layer x n_embd / GEMM rate: QK^T and AV over the full L x L "
                                   "(a causal kernel that skips the masked half can reach a ratio of 0.5)"),
        "prefill_per_token_ctx_s": (attention_flops / gemm, "4 x n_layer x n_embd / GEMM rate: QK^T and AV"),
    }
    return {term: {"value": coefficients[term], "unit": UNITS[term], "floor": floor, "floor_basis": basis,
                   "ratio_to_floor": coefficients[term] / floor}
            for term, (floor, basis) in floors.items()}


def residual_structure(points: pd.DataFrame, error: np.ndarray, mape_goal: float) -> dict:
    """Mean signed error along each axis of each part: a form that misses the machine's curve shows a
    trend or a band of same-sign errors there (a kink, say), where noise scatters around zero."""
    axes = {"prefill": (PREFILL_KINDS, ("prompt_len", "cached")), "decode": (DECODE_KINDS, ("batch", "cached"))}
    structure = {}
    for part, (kinds, part_axes) in axes.items():
        rows = points["kind"].isin(kinds).to_numpy()
        for axis in part_axes:
            by_axis = pd.Series(error[rows], index=points.loc[rows, axis].to_numpy()).groupby(level=0).mean()
            structure[f"{part}_by_{axis}"] = {
                "mean_signed_error_pct": {int(k): float(v) * 100 for k, v in by_axis.items()},
                "systematic": bool(np.abs(by_axis).max() > mape_goal),
            }
    return structure


@dataclass
class Fit:
    cost_model: CostModel
    report: dict
    predictions: pd.DataFrame

    def write(self, cost_model_json, report_json, predictions_csv) -> None:
        self.cost_model.save(cost_model_json)
        write_json(report_json, self.report)
        write_csv(predictions_csv, self.predictions)


def fit_profile(points: pd.DataFrame, meta: dict, holdout_fraction: float, mape_goal: float, seed: int) -> Fit:
    points = points.sort_values("point_id", ignore_index=True)
    fitted_kinds = PREFILL_KINDS + DECODE_KINDS
    below_min_batch = (points["kind"].isin(DECODE_KINDS) & (points["batch"] < DECODE_FIT_MIN_BATCH)).to_numpy()
    fitted = points["kind"].isin(fitted_kinds).to_numpy()
    contended = contended_mask(points)
    small_clean = below_min_batch & ~contended
    used = fitted & kept_mask(points, contended)
    held = holdout_mask(points[used], holdout_fraction, seed)
    in_holdout = np.zeros(len(points), dtype=bool)
    in_holdout[np.flatnonzero(used)[held]] = True
    trained = used & ~in_holdout

    shipped_line = fit_terms(points, used & ~below_min_batch)
    validation_line = fit_terms(points, trained & ~below_min_batch)
    shipped, shipped_table = with_decode_table(shipped_line, points, used)
    validation, validation_table = with_decode_table(validation_line, points, trained)
    measured = points["median_s"].to_numpy(float)
    predicted = predict(points, shipped, shipped_table)
    validation_predicted = predict(points, validation, validation_table)
    line_predicted = predict(points, shipped_line)
    validation_line_predicted = predict(points, validation_line)
    error = (predicted - measured) / measured
    validation_error = (validation_predicted - measured) / measured

    predictions = pd.DataFrame({
        "point_id": points["point_id"], "kind": points["kind"], "batch": points["batch"],
        "prompt_len": points["prompt_len"], "cached": points["cached"], "measured_s": measured,
        "predicted_s": predicted, "error_pct": error * 100, "in_holdout": in_holdout,
        "validation_predicted_s": validation_predicted, "validation_error_pct": validation_error * 100,
        "used_in_fit": used, "cpu_share": points["cpu_share"] if "cpu_share" in points else np.nan,
    })
    parts = {}
    for part, (kinds, terms, _) in PARTS.items():
        rows = points["kind"].isin(kinds).to_numpy() & used
        parts[part] = {
            "n_points": int(rows.sum()), "n_holdout": int((rows & in_holdout).sum()),
            "r2": r_squared(measured[rows], predicted[rows]),
            "mape": mape(measured[rows], predicted[rows]),
            "heldout_mape": mape(measured[rows & in_holdout], validation_predicted[rows & in_holdout]),
            "max_abs_error_pct": float(np.abs(error[rows]).max() * 100),
        }
    heldout_mape = mape(measured[in_holdout], validation_predicted[in_holdout])
    decode_used = points["kind"].isin(DECODE_KINDS).to_numpy() & used
    decode_held = decode_used & in_holdout
    line_error = (line_predicted - measured) / measured
    decode_batches = points.loc[decode_used, "batch"].to_numpy()

    def by_batch(errors: np.ndarray) -> dict:
        means = pd.Series(errors[decode_used], index=decode_batches).groupby(level=0).mean()
        return {int(batch): float(value) * 100 for batch, value in means.items()}

    decode_table_report = {
        "line_per_ctx_token_s": shipped_line["decode_per_ctx_token_s"],
        "batches": [batch for batch, _ in shipped_table],
        "fixed_s": [seconds for _, seconds in shipped_table],
        "line_fixed_s": [shipped["decode_fixed_s"] + shipped["decode_per_seq_s"] * batch
                         for batch, _ in shipped_table],
        "heldout_mape": {"with_table": mape(measured[decode_held], validation_predicted[decode_held]),
                         "line_only": mape(measured[decode_held], validation_line_predicted[decode_held])},
        "mean_signed_error_pct_by_batch": {"with_table": by_batch(error), "line_only": by_batch(line_error)},
    }
    batched = (points["kind"] == "prefill_batch").to_numpy()
    fingerprint = meta["machine"]["fingerprint"]
    summary = {"r2": {p: parts[p]["r2"] for p in parts}, "heldout_mape": heldout_mape,
               "heldout_mape_line_only": mape(measured[in_holdout], validation_line_predicted[in_holdout]),
               "mape_goal": mape_goal, "goal_met": bool(heldout_mape < mape_goal)}
    cost_model = CostModel(
        **shipped, decode_batch_fixed_s=shipped_table, ctx_mode=CTX_MODE, name=f"measured-{fingerprint}",
        source=(f"profile of GPT-2 ({meta['model']['source']}, {meta['model']['param_count']} params) on "
                f"{meta['machine']['cpu_model']} with {meta['machine']['threads']} threads"),
        meta={"machine_fingerprint": fingerprint, "profile_wall_time_s": meta["wall_time_s"],
              "tiny_model": meta["settings"]["tiny"], **summary},
    )
    report = {
        **summary,
        "coefficients": {term: {"value": value, "unit": UNITS[term]} for term, value in shipped.items()},
        "validation_coefficients": validation,
        "validation_decode_table": {"batches": [batch for batch, _ in validation_table],
                                    "fixed_s": [seconds for _, seconds in validation_table]},
        "decode_batch_table": decode_table_report,
        "ctx_mode": CTX_MODE,
        "parts": parts,
        "physical": physical_readings(shipped, meta),
        "decode_below_min_batch": {"fit_min_batch": DECODE_FIT_MIN_BATCH,
                                   "measured_over_line": mean_ratio(measured, line_predicted, small_clean)},
        "residual_structure": residual_structure(points[used], error[used], mape_goal),
        "contention": {
            "min_cpu_share": CONTENDED_CPU_SHARE,
            "excluded_point_ids": points.loc[fitted & ~used, "point_id"].tolist(),
            "kept_contended_point_ids": points.loc[used & contended, "point_id"].tolist(),
        },
        "batched_prefill": [
            {"batch": int(row.batch), "prompt_len": int(row.prompt_len), "measured_s": row.median_s,
             "separate_calls_s": separate, "batched_over_separate": row.median_s / separate}
            for row, separate in zip(points[batched].itertuples(), predicted[batched])],
        "holdout": {"fraction": holdout_fraction, "seed": seed,
                    "point_ids": points.loc[in_holdout, "point_id"].tolist()},
        "machine": meta["machine"], "roofline": meta["roofline"], "memory": meta["memory"],
    }
    return Fit(cost_model, report, predictions)


def run_fit(points_csv, meta_json, fit_cfg: dict, seed: int, cost_model_json, report_json, predictions_csv) -> Fit:
    fit = fit_profile(pd.read_csv(points_csv), read_json(meta_json), fit_cfg["holdout_fraction"],
                      fit_cfg["mape_goal"], seed)
    fit.write(cost_model_json, report_json, predictions_csv)
    return fit
