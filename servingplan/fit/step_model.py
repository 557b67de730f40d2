"""Fit the step-time cost model (servingplan.costmodel) to a profile and say how well it predicts.

    fit_profile(points, samples, meta, holdout_fraction, mape_goal, seed) -> Fit
    Fit.write(cost_model_json, report_json, predictions_csv)      atomic writes
    run_fit(points_csv, samples_csv, meta_json, fit_cfg, seed, cost_model_json, report_json, predictions_csv)

`points`, `samples` and `meta` are what servingplan.profile.measure writes (every grid point measured
in several rounds, each call normalised to the run's typical speed); `fit_cfg` is config.yaml's `fit`.

Forms, each fitted by least squares on relative error (rows weighted by 1/median), every coefficient at
least its roofline floor:
    prefill  t(L, P) = p0 + p1 L + p2 L^2 + p3 L P     on kinds prefill and prefill_cached
    decode   t(B, T) = f(B) + c B T                    on kind decode, T the longest context
f(B) is the line a + b B, or for the batches where it earns its place a per-batch value. The engine
pads a decode batch to its longest sequence, so the decode call reads B * max context KV tokens: the
cost model is written with ctx_mode "padded_max". A profile whose meta names its engine's mode
(settings.ctx_mode, as llama.cpp's does: servingplan.llamacpp.profile) gets that mode written instead;
its decode points hold B sequences of one context T, where B * T is both modes' KV read, so the fit
itself is the same.

Physics bounds the fit. Each coefficient is the time of one unit of work (servingplan.roofline counts
its bytes and FLOPs), which this machine cannot do faster than its roofline floor, max(bytes / peak
bandwidth, FLOPs / peak GEMM rate), from the peaks the profiler measured (machine.json `roofline`).
So every coefficient is written as floor + x with x >= 0 and the x fitted by non-negative least
squares (scipy.optimize.nnls): no term can sit above 100% of the roofline, by construction. A decode
table value f(B) has the floor of the whole batch's work (its weights once, B sequences), and an
optional prefill term that does not earn its place is held at its floor rather than at zero (the work
is there; its floor is the least it costs). The report gives each term's efficiency (floor / value)
and whether the bound holds it at its floor.

A fit that does not learn noise. Every grid point was measured in R rounds spread over the profile, so
the fit can be scored on rounds it has not seen (the profiler's re-measured calls replace the ones
they supersede; a point given extra rounds is scored on each of its rounds): fitted on the median of R - 1 rounds, it predicts the
held-out round, for each round in turn (cross-validation across rounds). A form's extra freedom stays
only where it predicts held-out rounds better than the simpler form does:
- per batch B, a table value f(B) is kept only if the table form (a value per batch, shared c)
  predicts the held-out rounds at B with a smaller mean absolute error than the line (a + b B + c B T
  fitted from DECODE_FIT_MIN_BATCH up); a bump that is not there in every round is noise and goes;
- the prefill terms p2 and p3 are fitted only if holding them at their floors makes the held-out rounds'
  error larger.
The shipped decode part is then fitted jointly: a value per kept batch, one line for the other batches,
one c. The cost model carries the table for every profiled batch (the line's value where no table
value was kept), and the line-only fit's a and b, b continuing the table beyond its largest batch.

Held-out error (the figure judged against the goal) comes from a second fit, with the same selected
form, on a seeded share `holdout_fraction` of each kind's grid points left out, evaluated on those
points only: the error of the shipped fit on shapes it has not seen. The report also gives the error
across rounds (how well the fit predicts one round's measurements: the machine's noise floor).

Batched prefill points are not fitted (the engine prefills one sequence per call); they are predicted
as `batch` separate prefill calls to show what batching would save.

predictions CSV, one row per grid point: point_id, kind, batch, prompt_len, cached, measured_s,
predicted_s, error_pct (shipped fit), in_holdout, validation_predicted_s, validation_error_pct
(training-split fit), used_in_fit, spread_pct (the point's spread across rounds).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import pandas as pd
from scipy.optimize import nnls

from servingplan import roofline
from servingplan.costmodel import CostModel
from servingplan.io import read_json, write_csv, write_json

PREFILL_KINDS = ("prefill", "prefill_cached")
DECODE_KINDS = ("decode",)
CTX_MODE = "padded_max"
# PyTorch on CPU runs a batch-1 decode through matrix-vector kernels and switches to small
# matrix-matrix kernels from batch 2, so no line a + b*B holds both; the line is fitted from this
# batch up, and batch 1 earns a table value when the held-out rounds say so.
DECODE_FIT_MIN_BATCH = 2
# An extra degree of freedom must lower the held-out rounds' mean relative error by more than this to
# stay: below it the two forms predict alike (on exact data they differ by rounding alone).
SELECTION_MARGIN = 1e-6
# a coefficient within this relative distance of its floor is held there by the bound (rounding aside)
AT_FLOOR_TOLERANCE = 1e-9

PREFILL_TERMS = ("prefill_fixed_s", "prefill_per_token_s", "prefill_per_token_sq_s", "prefill_per_token_ctx_s")
OPTIONAL_PREFILL_TERMS = ("prefill_per_token_sq_s", "prefill_per_token_ctx_s")
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


def fit_relative(features: np.ndarray, measured: np.ndarray, floors=None, free=None) -> np.ndarray:
    """Coefficients minimising the squared relative error of the predictions, each at least its floor
    (zero by default): floor + x with x >= 0 by non-negative least squares, so the bound holds by
    construction. Columns not `free` are held at their floor."""
    floors = np.zeros(features.shape[1]) if floors is None else np.asarray(floors, float)
    free = np.ones(features.shape[1], dtype=bool) if free is None else np.asarray(free, bool)
    weighted = features / measured[:, None]
    above = np.zeros(features.shape[1])
    if free.any():
        columns = weighted[:, free]
        # Columns span 1 to L^2 ~ 1e5: scale them to one so the solver's tolerance means the same for each.
        scale = np.abs(columns).max(axis=0)
        scale[scale == 0] = 1.0
        above[free] = nnls(columns / scale, 1.0 - weighted @ floors)[0] / scale
    return floors + above


def holdout_mask(points: pd.DataFrame, fraction: float, seed: int) -> np.ndarray:
    """Hold out round(fraction * n) points of each kind, chosen by a seeded generator."""
    rng = np.random.default_rng(seed)
    mask = np.zeros(len(points), dtype=bool)
    for kind in sorted(points["kind"].unique()):
        rows = np.flatnonzero(points["kind"].to_numpy() == kind)
        n_held = min(int(round(fraction * len(rows))), len(rows) - 1)
        mask[rng.choice(rows, size=n_held, replace=False)] = True
    return mask


def r_squared(measured: np.ndarray, predicted: np.ndarray) -> float:
    residual = np.sum((measured - predicted) ** 2)
    total = np.sum((measured - measured.mean()) ** 2)
    return float(1.0 - residual / total) if total > 0 else float("nan")


def mape(measured: np.ndarray, predicted: np.ndarray) -> float:
    return float(np.mean(np.abs(predicted - measured) / measured)) if len(measured) else float("nan")


@dataclass(frozen=True)
class Floors:
    """The profiled machine's roofline floor of each coefficient (seconds) and of a decode table value
    f(B) (the whole batch's work), from its peak bandwidth and GEMM rate."""
    arch: dict
    bandwidth_gbs: float
    gflops: float

    @classmethod
    def of(cls, meta: dict) -> "Floors":
        peak = meta["roofline"]
        return cls(roofline.architecture_of(meta["model"]), float(peak["bandwidth_gbs"]), float(peak["gemm_gflops"]))

    @cached_property
    def _terms(self) -> dict:
        return {term: seconds for term, (seconds, _) in
                roofline.term_floors(self.arch, self.bandwidth_gbs, self.gflops).items()}

    def term(self, name: str) -> float:
        return self._terms[name]

    def terms(self, names) -> np.ndarray:
        return np.array([self.term(name) for name in names])

    def batch(self, batch: int) -> float:
        return roofline.floor(roofline.batch_work(self.arch, batch), self.bandwidth_gbs, self.gflops)[0]


@dataclass(frozen=True)
class Form:
    """What a fit may use: the prefill terms, and the decode batches that get a value of their own."""
    prefill_terms: tuple = PREFILL_TERMS
    table_batches: tuple = ()


def fit_prefill(points: pd.DataFrame, target: np.ndarray, terms: tuple, floors: Floors) -> dict:
    """The prefill coefficients, `terms` fitted above their floors and the others held at them."""
    free = [term in terms for term in PREFILL_TERMS]
    values = fit_relative(prefill_features(points), target, floors.terms(PREFILL_TERMS), free)
    return {term: float(value) for term, value in zip(PREFILL_TERMS, values)}


def fit_decode_line(points: pd.DataFrame, target: np.ndarray, floors: Floors) -> dict:
    rows = (points["batch"] >= DECODE_FIT_MIN_BATCH).to_numpy()
    if not rows.any():
        rows[:] = True
    values = fit_relative(decode_features(points[rows]), target[rows], floors.terms(DECODE_TERMS))
    return dict(zip(DECODE_TERMS, (float(v) for v in values)))


def fit_decode_joint(points: pd.DataFrame, target: np.ndarray, table_batches: tuple,
                     floors: Floors) -> tuple[tuple, float]:
    """((batch, f(B)) for every batch in `points`, c): a value per table batch, one line a + b B for
    the other batches, one c, fitted together."""
    batch = points["batch"].to_numpy()
    own = [b for b in table_batches if (batch == b).any()]
    on_line = ~np.isin(batch, own)
    columns = [batch == b for b in own]
    lower = [floors.batch(b) for b in own]
    if on_line.any():
        columns += [on_line, on_line * batch]
        lower += [floors.term("decode_fixed_s"), floors.term("decode_per_seq_s")]
    columns.append(batch * points["cached"].to_numpy(float))
    lower.append(floors.term("decode_per_ctx_token_s"))
    values = fit_relative(np.column_stack(columns).astype(float), target, lower)
    own_values = dict(zip(own, values))
    line_fixed, line_slope = (values[len(own)], values[len(own) + 1]) if on_line.any() else (0.0, 0.0)
    table = tuple((int(b), float(own_values.get(b, line_fixed + line_slope * b))) for b in np.unique(batch))
    return table, float(values[-1])


def fit_model(points: pd.DataFrame, target: np.ndarray, form: Form, floors: Floors) -> tuple[dict, tuple]:
    """Coefficients and decode table of `form` fitted to `target` (seconds per row of `points`, which
    holds prefill and decode kinds only), none below its floor."""
    prefill = points["kind"].isin(PREFILL_KINDS).to_numpy()
    decode = points["kind"].isin(DECODE_KINDS).to_numpy()
    coefficients = fit_prefill(points[prefill], target[prefill], form.prefill_terms, floors)
    line = fit_decode_line(points[decode], target[decode], floors)
    coefficients.update(line)
    if not form.table_batches:
        return coefficients, ()
    table, per_ctx_token_s = fit_decode_joint(points[decode], target[decode], form.table_batches, floors)
    return {**coefficients, "decode_per_ctx_token_s": per_ctx_token_s}, table


def predict(points: pd.DataFrame, coefficients: dict, decode_table: tuple = ()) -> np.ndarray:
    """Seconds the cost model gives each point (a batched prefill as `batch` single calls)."""
    model = CostModel(**coefficients, decode_batch_fixed_s=decode_table, ctx_mode=CTX_MODE)
    predicted = np.full(len(points), np.nan)
    for row, point in enumerate(points.itertuples()):
        if point.kind in DECODE_KINDS:
            predicted[row] = model.decode_time(point.batch, 0.0, point.cached)
        elif point.kind in PREFILL_KINDS:
            predicted[row] = model.prefill_time(point.prompt_len, point.cached)
        elif point.kind == "prefill_batch":
            predicted[row] = point.batch * model.prefill_time(point.prompt_len)
    return predicted


def per_round_medians(points: pd.DataFrame, samples: pd.DataFrame) -> pd.DataFrame:
    """[point, round] median of each round's normalised calls, rows in the order of `points`; calls a
    re-measurement replaced (`superseded`) left out, and NaN where a point has fewer rounds than others
    (the profiler gives extra rounds only to points whose rounds disagree)."""
    if "superseded" in samples:
        samples = samples[~samples["superseded"].astype(bool)]
    table = samples.groupby(["point_id", "round"])["normalized_s"].median().unstack("round")
    return table.loc[points["point_id"].to_numpy()].reset_index(drop=True)


def round_errors(points: pd.DataFrame, rounds: pd.DataFrame, form: Form, floors: Floors) -> np.ndarray:
    """Per point, the mean absolute relative error of predicting each of its rounds from a fit on the
    median of the other rounds (a round only some points have is predicted for those points)."""
    errors = []
    for held in rounds.columns:
        target = rounds.drop(columns=held).median(axis=1).to_numpy(float)
        predicted = predict(points, *fit_model(points, target, form, floors))
        measured = rounds[held].to_numpy(float)
        errors.append(np.abs(predicted - measured) / measured)
    return np.nanmean(errors, axis=0)


def select_form(points: pd.DataFrame, rounds: pd.DataFrame, floors: Floors) -> tuple[Form, dict]:
    """The form whose every extra degree of freedom predicts held-out rounds better than going
    without it (see the module docstring), and the scores behind each decision."""
    decode = points["kind"].isin(DECODE_KINDS).to_numpy()
    batches = tuple(int(b) for b in sorted(points.loc[decode, "batch"].unique()))
    line_error = round_errors(points, rounds, Form(), floors)
    table_error = round_errors(points, rounds, Form(table_batches=batches), floors)
    batch_scores, kept = {}, []
    for batch in batches:
        rows = decode & (points["batch"] == batch).to_numpy()
        line, table = float(line_error[rows].mean()), float(table_error[rows].mean())
        keep = table < line - SELECTION_MARGIN
        batch_scores[batch] = {"line_round_mape": line, "table_round_mape": table, "kept": keep}
        if keep:
            kept.append(batch)
    form = Form(table_batches=tuple(kept))
    prefill = points["kind"].isin(PREFILL_KINDS).to_numpy()
    term_scores = {}
    with_term = float(round_errors(points, rounds, form, floors)[prefill].mean())
    for term in OPTIONAL_PREFILL_TERMS:
        without = Form(tuple(t for t in form.prefill_terms if t != term), form.table_batches)
        without_term = float(round_errors(points, rounds, without, floors)[prefill].mean())
        keep = with_term < without_term - SELECTION_MARGIN
        term_scores[term] = {"with_round_mape": with_term, "without_round_mape": without_term, "kept": keep}
        if not keep:
            form, with_term = without, without_term
    return form, {"decode_table": batch_scores, "prefill_terms": term_scores}


def physical_readings(coefficients: dict, floors: Floors) -> dict:
    """Each coefficient next to the roofline floor of the work it pays for (servingplan.roofline):
    efficiency = floor / coefficient (at most 1: the fit holds every term at or above its floor),
    ratio_to_floor its inverse, at_floor whether the bound holds it there."""
    work = roofline.term_work(floors.arch)
    readings = {}
    for term in PREFILL_TERMS + DECODE_TERMS:
        floor, bound = roofline.floor(work[term], floors.bandwidth_gbs, floors.gflops)
        value = coefficients[term]
        readings[term] = {"value": value, "unit": UNITS[term], "floor": floor, "bound": bound,
                          "bytes": work[term].bytes, "flops": work[term].flops,
                          "floor_basis": f"{roofline.BASIS[term]}; {bound}-bound at the measured peak",
                          "efficiency": floor / value if value > 0 else None,
                          "ratio_to_floor": value / floor if floor > 0 else None,
                          "at_floor": bool(value <= floor * (1 + AT_FLOOR_TOLERANCE))}
    return readings


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


def profiled_range(points: pd.DataFrame) -> dict:
    """[min, max] of the prompt lengths of the prefill points and of the contexts (new + cached tokens) of
    every fitted point."""
    fitted = points[points["kind"].isin(PREFILL_KINDS + DECODE_KINDS)]
    prompts = fitted.loc[fitted["kind"].isin(PREFILL_KINDS), "prompt_len"]
    contexts = fitted["prompt_len"] + fitted["cached"]
    return {"prompt_tokens": [int(prompts.min()), int(prompts.max())],
            "context_tokens": [int(contexts.min()), int(contexts.max())]}


@dataclass
class Fit:
    cost_model: CostModel
    report: dict
    predictions: pd.DataFrame

    def write(self, cost_model_json, report_json, predictions_csv) -> None:
        self.cost_model.save(cost_model_json)
        write_json(report_json, self.report)
        write_csv(predictions_csv, self.predictions)


def fit_profile(points: pd.DataFrame, samples: pd.DataFrame, meta: dict, holdout_fraction: float,
                mape_goal: float, seed: int) -> Fit:
    points = points.sort_values("point_id", ignore_index=True)
    fitted = points["kind"].isin(PREFILL_KINDS + DECODE_KINDS).to_numpy()
    train_points = points[fitted].reset_index(drop=True)
    rounds = per_round_medians(train_points, samples)
    floors = Floors.of(meta)
    form, selection = select_form(train_points, rounds, floors)

    held = holdout_mask(train_points, holdout_fraction, seed)
    in_holdout = np.zeros(len(points), dtype=bool)
    in_holdout[np.flatnonzero(fitted)[held]] = True
    target = train_points["median_s"].to_numpy(float)
    shipped, shipped_table = fit_model(train_points, target, form, floors)
    line_only, _ = fit_model(train_points, target, Form(form.prefill_terms), floors)
    validation, validation_table = fit_model(train_points[~held], target[~held], form, floors)
    validation_line, _ = fit_model(train_points[~held], target[~held], Form(form.prefill_terms), floors)

    measured = points["median_s"].to_numpy(float)
    predicted = predict(points, shipped, shipped_table)
    validation_predicted = predict(points, validation, validation_table)
    validation_line_predicted = predict(points, validation_line)
    line_predicted = predict(points, line_only)
    error = (predicted - measured) / measured
    validation_error = (validation_predicted - measured) / measured
    round_error = np.full(len(points), np.nan)
    round_error[fitted] = round_errors(train_points, rounds, form, floors)

    predictions = pd.DataFrame({
        "point_id": points["point_id"], "kind": points["kind"], "batch": points["batch"],
        "prompt_len": points["prompt_len"], "cached": points["cached"], "measured_s": measured,
        "predicted_s": predicted, "error_pct": error * 100, "in_holdout": in_holdout,
        "validation_predicted_s": validation_predicted, "validation_error_pct": validation_error * 100,
        "used_in_fit": fitted, "spread_pct": points["spread_pct"],
    })
    parts = {}
    for part, kinds in (("prefill", PREFILL_KINDS), ("decode", DECODE_KINDS)):
        rows = points["kind"].isin(kinds).to_numpy()
        parts[part] = {
            "n_points": int(rows.sum()), "n_holdout": int((rows & in_holdout).sum()),
            "r2": r_squared(measured[rows], predicted[rows]),
            "mape": mape(measured[rows], predicted[rows]),
            "heldout_mape": mape(measured[rows & in_holdout], validation_predicted[rows & in_holdout]),
            "round_mape": float(np.mean(round_error[rows])),
            "max_abs_error_pct": float(np.abs(error[rows]).max() * 100),
            "median_spread_pct": float(points.loc[rows, "spread_pct"].median()),
        }
    heldout_mape = mape(measured[in_holdout], validation_predicted[in_holdout])
    decode = points["kind"].isin(DECODE_KINDS).to_numpy()
    decode_held = decode & in_holdout
    decode_batches = points.loc[decode, "batch"].to_numpy()

    def by_batch(errors: np.ndarray) -> dict:
        means = pd.Series(errors[decode], index=decode_batches).groupby(level=0).mean()
        return {int(batch): float(value) * 100 for batch, value in means.items()}

    decode_table_report = {
        "kept_batches": list(form.table_batches),
        "batches": [batch for batch, _ in shipped_table],
        "fixed_s": [seconds for _, seconds in shipped_table],
        "floor_s": [floors.batch(batch) for batch, _ in shipped_table],
        "efficiency": [floors.batch(batch) / seconds for batch, seconds in shipped_table],
        "line_fixed_s": [line_only["decode_fixed_s"] + line_only["decode_per_seq_s"] * batch
                         for batch, _ in shipped_table],
        "line_per_ctx_token_s": line_only["decode_per_ctx_token_s"],
        "heldout_mape": {"shipped": mape(measured[decode_held], validation_predicted[decode_held]),
                         "line_only": mape(measured[decode_held], validation_line_predicted[decode_held])},
        "mean_signed_error_pct_by_batch": {"shipped": by_batch(error),
                                           "line_only": by_batch((line_predicted - measured) / measured)},
    }
    batched = (points["kind"] == "prefill_batch").to_numpy()
    ctx_mode = meta["settings"].get("ctx_mode", CTX_MODE)
    # a profile of llama.cpp (meta engine) names its engine; the torch profile's names stay as they were
    engine_tag, engine_words = ("llamacpp-", "llama.cpp ") if meta.get("engine") == "llamacpp" else ("", "")
    fingerprint = meta["machine"]["fingerprint"]
    speed = meta.get("speed", {})
    summary = {"r2": {p: parts[p]["r2"] for p in parts}, "heldout_mape": heldout_mape,
               "heldout_mape_line_only": mape(measured[in_holdout], validation_line_predicted[in_holdout]),
               "round_mape": float(np.nanmean(round_error)), "mape_goal": mape_goal,
               "goal_met": bool(heldout_mape <= mape_goal)}
    cost_model = CostModel(
        **shipped, decode_batch_fixed_s=shipped_table, ctx_mode=ctx_mode, name=f"measured-{engine_tag}{fingerprint}",
        source=(f"{engine_words}profile of GPT-2 ({meta['model']['source']}, {meta['model']['param_count']} params) on "
                f"{meta['machine']['cpu_model']} with {meta['machine']['threads']} threads"),
        meta={"machine_fingerprint": fingerprint, "profile_wall_time_s": meta["wall_time_s"],
              "tiny_model": meta["settings"]["tiny"], "speed_band": speed_band(speed), **summary,
              # the shapes measured: the CLI warns of requests outside them (their times are extrapolated)
              "profiled_range": profiled_range(points)},
    )
    report = {
        **summary,
        "coefficients": {term: {"value": value, "unit": UNITS[term]} for term, value in shipped.items()},
        "form": {"prefill_terms": list(form.prefill_terms), "table_batches": list(form.table_batches)},
        "selection": selection,
        "validation_coefficients": validation,
        "validation_decode_table": {"batches": [batch for batch, _ in validation_table],
                                    "fixed_s": [seconds for _, seconds in validation_table]},
        "decode_batch_table": decode_table_report,
        "ctx_mode": ctx_mode,
        "parts": parts,
        "physical": physical_readings(shipped, floors),
        "roofline_peak": {"bandwidth_gbs": floors.bandwidth_gbs, "gemm_gflops": floors.gflops},
        "residual_structure": residual_structure(points[fitted], error[fitted], mape_goal),
        "batched_prefill": [
            {"batch": int(row.batch), "prompt_len": int(row.prompt_len), "measured_s": row.median_s,
             "separate_calls_s": separate, "batched_over_separate": row.median_s / separate}
            for row, separate in zip(points[batched].itertuples(), predicted[batched])],
        "holdout": {"fraction": holdout_fraction, "seed": seed,
                    "point_ids": points.loc[in_holdout, "point_id"].tolist()},
        "speed_band": speed_band(speed),
        "remeasure": remeasured(meta),
        "machine": meta["machine"], "roofline": meta["roofline"], "memory": meta["memory"],
    }
    return Fit(cost_model, report, predictions)


def speed_band(speed: dict) -> dict:
    """The slowest and fastest relative speed each reference showed during the profile: the cost
    model's terms scaled by these bound what the machine did while it was measured."""
    return {kind: [values["relative_min"], values["relative_max"]]
            for kind, values in speed.get("by_kind", {}).items()}


def remeasured(meta: dict) -> dict | None:
    """What the profiler measured again (machine.json `remeasure`), in counts; None for a profile
    written before it re-measured."""
    remeasure = meta.get("remeasure")
    if remeasure is None:
        return None
    return {key: remeasure[key] for key in ("n_remeasured", "n_extra_rounds", "budget", "budget_exhausted",
                                            "disturbed_kept", "noise_floor_pct")} | {
        "n_disturbed_readings": len(remeasure["disturbed_readings"])}


def run_fit(points_csv, samples_csv, meta_json, fit_cfg: dict, seed: int, cost_model_json, report_json,
            predictions_csv) -> Fit:
    fit = fit_profile(pd.read_csv(points_csv), pd.read_csv(samples_csv), read_json(meta_json),
                      fit_cfg["holdout_fraction"], fit_cfg["mape_goal"], seed)
    fit.write(cost_model_json, report_json, predictions_csv)
    return fit
