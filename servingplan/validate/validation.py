"""The validation comparison (rule validate): simulate the traces the real-time replay served
(servingplan.validate.validation_replay, its file read through servingplan.validate.replay_file) and set them
against it.
Editing the simulator or this module reruns only this job; the replay is not served again.

The simulator's stability capacity is computed beside the comparison, so the report can say what share
of it each trace offered.

A speed correction uses only the shape-matched evidence the replay recorded (the profile's own grid
points at the batch sizes and contexts the engine served, re-timed between engine steps and after each
trace, against their profiled values), and is applied to a kind of step (the decode steps of one batch
size, or the prefill-only steps) of one trace only where it brings the engine's own steps of that kind
closer to the model: a correction the engine's steps contradict is recorded with its reason and not
applied. The cost model itself is fitted on the profile alone: the replays judge it and never feed it.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from servingplan.engine.replay import compare, predict_steps, request_pairs
from servingplan.pipeline import terminal
from servingplan.simulate import simulate
from servingplan.simulate.capacity import Criterion, capacity
from servingplan.simulate.metrics import SLO
from servingplan.simulate.policies import chunk_budget
from servingplan.simulate.workload import generate
from servingplan.validate.replay_file import result_from_json, step_frame, trace_of

# a batch size's steps are judged only when there are this many of them
MIN_STEPS_PER_BATCH = 20
STEP_GOAL_PCT = 10.0
# the highest load (x the service rate) the validation goal is judged at: the headline reads the loads up to it
JUDGED_LOAD = 0.85


def say(message: str) -> None:
    print(f"validate: {message}", file=terminal(), flush=True)


def median_ratio(values) -> float | None:
    values = [v for v in values if np.isfinite(v)]
    return float(np.median(values)) if values else None


def corrections(steps: pd.DataFrame, retimed: pd.DataFrame, label: str) -> list[dict]:
    """The speed corrections of one trace, one per kind of step: the decode-only steps of each batch size,
    and the prefill-only steps. A kind's evidence is the median ratio (now / profiled) of the profile's
    points matching it, re-timed during and right after this trace; the engine's reading is the median
    measured / predicted time of its own steps of that kind. The correction is applied only when both
    say the same thing (both above one, or both below) and it brings those steps closer to the model;
    otherwise the factor is one and `status` says why."""
    out = []
    readings = retimed[retimed["label"] == label] if len(retimed) else retimed
    if steps.empty:
        return out
    decoding = steps[(steps["n_prefill_calls"] == 0) & (steps["batch"] > 0)]
    prefilling = steps[(steps["batch"] == 0) & (steps["n_prefill_calls"] > 0)]
    kinds = [("decode", int(b), decoding[decoding["batch"] == b]) for b in sorted(decoding["batch"].unique())]
    kinds.append(("prefill", 0, prefilling))
    for kind, batch, own in kinds:
        if kind == "decode":
            evidence = readings[(readings["kind"] == "decode") & (readings["batch"] == batch)] if len(readings) else readings
        else:
            evidence = readings[readings["kind"] == "prefill"] if len(readings) else readings
        factor = median_ratio(evidence["ratio"]) if len(evidence) else None
        engine = median_ratio(own["duration_s"] / own["predicted_s"]) if len(own) else None
        row = {"label": label, "kind": kind, "batch": batch, "steps": int(len(own)), "readings": int(len(evidence)),
               "evidence_ratio": factor, "engine_ratio": engine, "applied_factor": 1.0}
        if factor is None or engine is None:
            row["status"] = "no evidence" if factor is None else "no steps"
        elif (factor - 1) * (engine - 1) <= 0:
            row["status"] = "contradicted"   # the re-timed points and the engine's steps disagree in direction
        elif abs(median_ratio(own["duration_s"] / (own["predicted_s"] * factor)) - 1) >= abs(engine - 1):
            row["status"] = "no closer"      # same direction, but it overshoots the engine's own steps
        else:
            row.update(status="applied", applied_factor=factor)
        out.append(row)
    return out


def corrected_times(steps: pd.DataFrame, cost, applied: list[dict]) -> pd.Series:
    """Each step's predicted time with its kind's applied factor: decode part x the factor of its batch,
    prefill part x the prefill factor."""
    decode = {row["batch"]: row["applied_factor"] for row in applied if row["kind"] == "decode"}
    prefill = next((row["applied_factor"] for row in applied if row["kind"] == "prefill"), 1.0)
    return pd.Series([cost.decode_time(row.batch, row.ctx_sum, row.ctx_max) * decode.get(row.batch, 1.0)
                      + sum(cost.prefill_time(n, c) for n, c in row.prefill_calls) * prefill
                      for row in steps.itertuples()], index=steps.index, dtype=float)


def corrected_cost(cost, applied: list[dict]):
    """The cost model the corrected simulation runs on: decode terms x the step-weighted mean of the
    decode factors applied, prefill terms x the prefill factor (one when not applied)."""
    decode = [(row["applied_factor"], row["steps"]) for row in applied if row["kind"] == "decode" and row["steps"]]
    weight = sum(n for _, n in decode)
    decode_factor = sum(f * n for f, n in decode) / weight if weight else 1.0
    prefill = next((row["applied_factor"] for row in applied if row["kind"] == "prefill"), 1.0)
    return cost.slowed(decode_factor, prefill), decode_factor, prefill


def run_comparison(replayed: dict, cost, machine: dict, workload: dict, validation: dict, sweep: dict,
                   memory: dict, seed: int) -> dict:
    """Simulate every served trace, on the cost model as fitted and as corrected by the shape-matched
    evidence, and set them against the replay (see the module docstring)."""
    settings = replayed["settings"]
    policy, cap, chunk, blocks = settings["policy"], settings["max_num_seqs"], settings["chunk_size"], settings["kv_blocks"]
    draws = [generate(workload, seed + i) for i in range(3)]
    found = capacity(draws, [seed + i for i in range(3)], cost, policy, cap, chunk,
                     Criterion(SLO(), attainment_goal=0.0), 0.01, 64.0, 0.02, blocks, memory["block_size"],
                     sweep["horizon_factor"], chunk_budget(sweep))
    stable_rps = found["capacity_rps"]
    retimed = pd.DataFrame(replayed["retimed"])
    tables, pairs, steps, traces, applied_all = [], [], [], [], []
    for entry in replayed["traces"]:
        fraction, rate, number = entry["load_fraction"], entry["rate"], entry["number"]
        trace = trace_of(entry)
        label = {"load_fraction": fraction, "rate": rate}
        if entry["skipped"]:
            traces.append({**label, "requests": len(trace), "skipped": True, "simulated_load": rate / stable_rps})
            continue
        say(f"comparing trace {number} ({len(trace)} requests) with the simulator")
        measured = result_from_json(entry["result"])
        frame = predict_steps(step_frame(entry["steps"]), cost)
        applied = corrections(frame, retimed, f"trace {number}") if len(frame) else []
        applied_all += [{**row, **label} for row in applied]
        model_cost, decode_factor, prefill_factor = corrected_cost(cost, applied)
        for name, used in (("as_fitted", cost), ("drift_corrected", model_cost)):
            simulated = simulate(trace, used, policy, cap, chunk, blocks, memory["block_size"],
                                 sweep["horizon_factor"], chunk_budget=chunk_budget(sweep))
            tables.append(compare(measured, simulated).assign(**label, cost_model=name))
            if name == "as_fitted":
                pairs.append(request_pairs(measured, simulated).assign(**label))
                traces.append({**label, "requests": len(trace), "skipped": False, "simulated_load": rate / stable_rps,
                               "measured_finished": int(measured.finished.sum()),
                               "measured_truncated": bool(measured.truncated),
                               "simulated_stable": bool(simulated.stable),
                               "measured_wall_s": float(measured.end_s), "errors": len(measured.meta.get("errors", {})),
                               "speed_ratio": {"decode": decode_factor, "prefill": prefill_factor}})
        if len(frame):
            corrected = corrected_times(frame, cost, applied)
            steps.append(frame.assign(corrected_s=corrected,
                                      corrected_error_pct=100.0 * (corrected - frame["duration_s"]) / frame["duration_s"],
                                      **label))

    comparison = pd.concat(tables, ignore_index=True) if tables else pd.DataFrame()
    if len(comparison):
        comparison["agrees"] = agreement(comparison, validation["goal_pct"])
    all_steps = pd.concat(steps, ignore_index=True) if steps else pd.DataFrame()
    by_batch = steps_by_batch(all_steps)
    speed_trace = pd.DataFrame(replayed["machine_drift"]["trace"])
    drift = {kind: float(group["ratio"].median()) for kind, group in speed_trace.groupby("kind")} if len(speed_trace) else {}
    drift_ratio = float(np.mean(list(drift.values()))) if drift else 1.0
    top = headline(comparison, by_batch, validation, all_steps, drift_ratio)
    return {
        "comparison": comparison,
        "requests": pd.concat(pairs, ignore_index=True) if pairs else pd.DataFrame(),
        "steps": all_steps.drop(columns=["prefill_calls"], errors="ignore"),
        "steps_by_batch": by_batch,
        "meta": {
            "policy": policy, "max_num_seqs": cap, "chunk_size": chunk, "kv_blocks": blocks,
            "service_rate_rps": replayed["service_rate_rps"],
            "stable_capacity_rps": stable_rps, "stable_capacity_interval": [found["capacity_min_rps"],
                                                                            found["capacity_max_rps"]],
            "traces": traces,
            "machine_drift": {"by_kind": drift, "ratio": drift_ratio, **replayed["machine_drift"]},
            "retimed": replayed["retimed"],
            "corrections": applied_all,
            "path_check": replayed["path_check"],
            "replay_stage_s": replayed["stage_s"], "replay_arrival_s": replayed["expected_arrival_s"],
            "serving_memory": replayed["serving_memory"],
            "steps_by_batch": by_batch.to_dict("records"),
            "headline": top,
            "findings": findings(comparison, by_batch, traces, applied_all, validation),
        },
    }


def steps_by_batch(steps: pd.DataFrame) -> pd.DataFrame:
    """Engine steps grouped by decode batch size (0: steps that only prefill): how many, and the
    median step time measured and predicted as fitted and as corrected (see corrections)."""
    if steps.empty:
        return pd.DataFrame()
    grouped = steps.groupby("batch")
    table = pd.DataFrame({
        "steps": grouped.size(),
        "with_prefill": grouped["n_prefill_calls"].apply(lambda calls: int((calls > 0).sum())),
        "measured_ms": grouped["duration_s"].median() * 1e3,
        "predicted_ms": grouped["predicted_s"].median() * 1e3,
        "corrected_ms": grouped["corrected_s"].median() * 1e3,
        "median_error_pct": grouped["error_pct"].median(),
        "median_corrected_error_pct": grouped["corrected_error_pct"].median(),
    }).reset_index()
    table["judged"] = table["steps"] >= MIN_STEPS_PER_BATCH
    table["within_goal"] = table["median_corrected_error_pct"].abs() <= STEP_GOAL_PCT
    return table


def agreement(rows: pd.DataFrame, goal_pct: float) -> pd.Series:
    """A simulated statistic agrees when it lies inside the measured bootstrap 90% interval or within
    goal_pct of the measured value."""
    inside = (rows["simulated_ms"] >= rows["measured_lo_ms"]) & (rows["simulated_ms"] <= rows["measured_hi_ms"])
    return inside | (rows["diff_pct"].abs() <= goal_pct)


def headline(comparison: pd.DataFrame, by_batch: pd.DataFrame, validation: dict,
             steps: pd.DataFrame | None = None, drift: float = 1.0) -> dict:
    """The agreement figures the report leads with: p90 TTFT and mean TPOT at every load up to 0.85
    of the service rate, for the cost model as fitted and as corrected by the shape-matched evidence (where the
    engine's own steps agree with it; the key keeps its older name drift_corrected),
    and the step error (per batch size, and over all steps)."""
    if comparison.empty:
        return {"evaluated": False}
    goal = validation["goal_pct"]
    out = {"evaluated": True, "goal_pct": goal, "machine_drift_ratio": drift}
    # a run whose engine finished no timed step has no per-step error: the figures are None, not absent
    timed = steps is not None and len(steps) > 0
    out.update({"step_mape_pct": float(steps["error_pct"].abs().mean()) if timed else None,
                "step_bias_pct": float(steps["error_pct"].median()) if timed else None,
                "step_mape_drift_corrected_pct": float(steps["corrected_error_pct"].abs().mean()) if timed else None,
                "step_bias_drift_corrected_pct": float(steps["corrected_error_pct"].median()) if timed else None})
    for name in ("as_fitted", "drift_corrected"):
        below = comparison[(comparison["load_fraction"] <= JUDGED_LOAD + 1e-9) & (comparison["cost_model"] == name)]
        judged = below[((below["metric"] == "ttft") & (below["stat"] == "p90"))
                       | ((below["metric"] == "tpot") & (below["stat"] == "mean"))].dropna(subset=["diff_pct"])

        def worst(metric):
            rows = judged[judged["metric"] == metric]["diff_pct"]
            return float(rows.abs().max()) if len(rows) else None

        out[name] = {"worst_abs_ttft_p90_diff_pct": worst("ttft"), "worst_abs_tpot_mean_diff_pct": worst("tpot"),
                     "agree": int(agreement(judged, goal).sum()), "judged": int(len(judged)),
                     "met": bool(len(judged)) and bool(agreement(judged, goal).all())}
    judged_batches = by_batch[by_batch["judged"]] if len(by_batch) else by_batch
    out["steps"] = {"min_steps": MIN_STEPS_PER_BATCH, "goal_pct": STEP_GOAL_PCT,
                    "judged_batches": [int(b) for b in judged_batches.get("batch", [])],
                    "met": bool(len(judged_batches)) and bool(judged_batches["within_goal"].all())}
    out["met"] = out["drift_corrected"]["met"]
    return out


def direction(values) -> str:
    """How the model's signed errors (model - measured) read: optimistic (the model is faster than the
    engine: every error below zero), pessimistic (every error above zero), or mixed."""
    values = [v for v in values if v is not None and np.isfinite(v)]
    if not values:
        return "not measured"
    if all(v < 0 for v in values):
        return "optimistic"
    if all(v > 0 for v in values):
        return "pessimistic"
    return "mixed"


def findings(comparison: pd.DataFrame, by_batch: pd.DataFrame, traces: list[dict], applied: list[dict],
             validation: dict) -> dict:
    """The measured gaps as data, for the report's first screen: for p90 TTFT and mean TPOT, per cost
    model, the signed gaps (simulated - measured, % of measured) at every judged load with the range and
    its direction word; the per-batch step errors likewise; which corrections were applied and which
    refused, each with its evidence (re-timed points / profiled) and the engine's own steps (measured /
    model); and the traces skipped or truncated (a skipped trace has no figure, never a made-up one)."""
    gaps = []
    judged_loads = comparison[comparison["load_fraction"] <= JUDGED_LOAD + 1e-9] if len(comparison) else comparison
    for metric, stat in (("ttft", "p90"), ("tpot", "mean")):
        for name in ("as_fitted", "drift_corrected"):
            rows = (judged_loads[(judged_loads["metric"] == metric) & (judged_loads["stat"] == stat)
                                 & (judged_loads["cost_model"] == name)].dropna(subset=["diff_pct"])
                    if len(judged_loads) else judged_loads)
            signed = [float(v) for v in rows["diff_pct"]] if len(rows) else []
            gaps.append({"metric": metric, "stat": stat, "cost_model": name,
                         "loads": [float(v) for v in rows["load_fraction"]] if len(rows) else [],
                         "diff_pct": signed,
                         "min_abs_pct": float(min(map(abs, signed))) if signed else None,
                         "max_abs_pct": float(max(map(abs, signed))) if signed else None,
                         "direction": direction(signed),
                         "agree": int(rows["agrees"].sum()) if len(rows) and "agrees" in rows else 0,
                         "judged": int(len(rows))})
    steps = []
    for row in (by_batch.to_dict("records") if len(by_batch) else []):
        steps.append({"batch": int(row["batch"]), "steps": int(row["steps"]), "judged": bool(row["judged"]),
                      "error_pct": float(row["median_error_pct"]), "direction": direction([row["median_error_pct"]]),
                      "corrected_error_pct": float(row["median_corrected_error_pct"]),
                      "corrected_direction": direction([row["median_corrected_error_pct"]]),
                      "within_goal": bool(row["within_goal"])})
    return {"goal_pct": validation["goal_pct"], "step_goal_pct": STEP_GOAL_PCT, "requests": gaps, "steps": steps,
            "corrections_applied": [{key: row[key] for key in ("load_fraction", "kind", "batch", "steps", "applied_factor",
                                                                  "evidence_ratio", "engine_ratio")}
                                    for row in applied if row["status"] == "applied"],
            "corrections_refused": [{key: row[key] for key in ("load_fraction", "kind", "batch", "steps", "status",
                                                                  "evidence_ratio", "engine_ratio")}
                                    for row in applied if row["status"] in ("contradicted", "no closer")],
            "skipped_traces": [t["load_fraction"] for t in traces if t["skipped"]],
            "truncated_traces": [t["load_fraction"] for t in traces if not t["skipped"] and t["measured_truncated"]]}
