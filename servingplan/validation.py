"""The validation stage: replay Poisson traces on the real engine and simulate the same traces.

Rates are fractions of the largest rate this machine keeps up with (the simulator's stability
capacity for the validated policy and cap), from well below it to overload. Each trace lasts about
`trace_seconds` of arrivals, so the stage's wall time is bounded whatever the machine's speed.
"""
from __future__ import annotations

import time

import numpy as np
import pandas as pd
import torch

from servingplan.capacity import Criterion, capacity
from servingplan.metrics import SLO
from servingplan.planner import kv_blocks
from servingplan.profiling.measure import GridPoint, point_runner, time_point
from servingplan.serving.replay import compare, predict_steps, replay, request_pairs
from servingplan.sim import simulate
from servingplan.workload import generate


def validation_traces(workload: dict, validation: dict, stable_rps: float, seed: int):
    """One trace per configured load fraction: ~trace_seconds of Poisson arrivals at that rate."""
    for i, fraction in enumerate(validation["rates_fraction"]):
        rate = fraction * stable_rps
        n = max(validation["min_requests"], int(round(rate * validation["trace_seconds"])))
        spec = dict(workload, num_requests=n, rate=rate)
        yield fraction, rate, generate(spec, seed + 101 * (i + 1)).with_rate(rate)


def _profiled_points(profile: pd.DataFrame) -> list[tuple[GridPoint, float]]:
    """A few points of the profile that the engine's steps resemble, as (point, profiled median s):
    the two longest batch-1 prefills, and decodes of 2 to 8 sequences at one mid-range context."""
    prefill = profile[profile["kind"] == "prefill"].nlargest(2, "prompt_len")
    decode = profile[(profile["kind"] == "decode") & profile["batch"].between(2, 8)]
    if len(decode):
        contexts = sorted(decode["cached"].unique())
        decode = decode[decode["cached"] == contexts[len(contexts) // 2]]
        decode = decode[decode["batch"].isin(sorted(decode["batch"].unique())[::2])]
    chosen = pd.concat([prefill, decode]).sort_values(["kind", "batch", "prompt_len"])
    return [(GridPoint(r.kind, int(r.batch), int(r.prompt_len), int(r.cached)), float(r.median_s))
            for r in chosen.itertuples()]


def machine_drift(model, profile: pd.DataFrame, seed: int) -> dict:
    """How much slower (ratio > 1) this machine runs now than when it was profiled: the same profile
    points re-timed by the profiler's own code. A shared machine's speed wanders by tens of percent
    over minutes; without this the comparison would charge that wander to the cost model."""
    generator = torch.Generator().manual_seed(seed)
    ratios = []
    with torch.inference_mode():
        for point, profiled in _profiled_points(profile):
            call, reset = point_runner(model, point, generator)
            samples, _ = time_point(call, reset, warmup=1, min_repeats=3, max_repeats=5, budget_s=2.0)
            ratios.append({"kind": point.kind, "batch": point.batch, "prompt_len": point.prompt_len,
                           "cached": point.cached, "profiled_s": profiled, "now_s": float(np.median(samples)),
                           "ratio": float(np.median(samples)) / profiled})
    return {"points": ratios, "ratio": float(np.median([r["ratio"] for r in ratios])) if ratios else 1.0}


def run_validation(model, cost, machine: dict, profile: pd.DataFrame, workload: dict, validation: dict,
                   sweep: dict, memory: dict, seed: int, threads: int | None = None) -> dict:
    policy, cap, chunk = validation["policy"], validation["cap"], sweep["chunk_size"]
    blocks = kv_blocks(machine, memory)
    draws = [generate(workload, seed + i) for i in range(3)]
    found = capacity(draws, [seed + i for i in range(3)], cost, policy, cap, chunk,
                     Criterion(SLO(), attainment_goal=0.0), 0.01, 64.0, 0.02, blocks, memory["block_size"],
                     sweep["horizon_factor"])
    stable_rps = found["capacity_rps"]

    drift_before = machine_drift(model, profile, seed)
    tables, corrected_tables, pairs, steps, traces = [], [], [], [], []
    started = time.monotonic()
    drifted = []
    for fraction, rate, trace in validation_traces(workload, validation, stable_rps, seed):
        remaining = validation["max_wall_s"] - (time.monotonic() - started)
        if remaining <= 0:
            traces.append({"load_fraction": fraction, "rate": rate, "requests": len(trace), "skipped": True})
            continue
        measured, step_frame = replay(trace, model, policy, cap, chunk, blocks, memory["block_size"],
                                      max_wall_s=remaining, seed=seed, threads=threads)
        simulated = simulate(trace, cost, policy, cap, chunk, blocks, memory["block_size"], sweep["horizon_factor"])
        label = {"load_fraction": fraction, "rate": rate}
        tables.append(compare(measured, simulated).assign(**label))
        drifted.append((trace, measured, label))
        pairs.append(request_pairs(measured, simulated).assign(**label))
        steps.append(predict_steps(step_frame, cost).assign(**label))
        traces.append({**label, "requests": len(trace), "skipped": False,
                       "measured_finished": int(measured.finished.sum()),
                       "measured_truncated": bool(measured.truncated), "simulated_stable": bool(simulated.stable),
                       "measured_wall_s": float(measured.end_s), "errors": len(measured.meta.get("errors", {}))})

    drift_after = machine_drift(model, profile, seed)
    drift = float(np.mean([drift_before["ratio"], drift_after["ratio"]]))
    # the same simulation on the cost model slowed by the drift measured around the replays
    corrected_cost = cost.scaled(1.0 / drift)
    for trace, measured, label in drifted:
        simulated = simulate(trace, corrected_cost, policy, cap, chunk, blocks, memory["block_size"],
                             sweep["horizon_factor"])
        corrected_tables.append(compare(measured, simulated).assign(**label))

    comparison = pd.concat(tables, ignore_index=True).assign(cost_model="as_fitted") if tables else pd.DataFrame()
    if corrected_tables:
        comparison = pd.concat([comparison, pd.concat(corrected_tables, ignore_index=True)
                                .assign(cost_model="drift_corrected")], ignore_index=True)
    step_frame = pd.concat(steps, ignore_index=True) if steps else pd.DataFrame()
    return {
        "comparison": comparison,
        "requests": pd.concat(pairs, ignore_index=True) if pairs else pd.DataFrame(),
        "steps": step_frame.drop(columns=["prefill_calls"], errors="ignore"),
        "meta": {
            "policy": policy, "max_num_seqs": cap, "chunk_size": chunk, "kv_blocks": blocks,
            "stable_capacity_rps": stable_rps, "stable_capacity_interval": [found["capacity_min_rps"],
                                                                            found["capacity_max_rps"]],
            "traces": traces,
            "machine_drift": {"ratio": drift, "before": drift_before, "after": drift_after},
            "headline": headline(comparison, step_frame, validation, drift),
        },
    }


def headline(comparison: pd.DataFrame, steps: pd.DataFrame, validation: dict, drift: float) -> dict:
    """The agreement figures the report leads with: p90 TTFT and mean TPOT error below 85% load, for
    the cost model as fitted and corrected for the machine's measured drift, and the per-step error."""
    if comparison.empty:
        return {"evaluated": False}
    goal = validation["goal_pct"]
    out = {"evaluated": True, "goal_pct": goal, "machine_drift_ratio": drift}
    for model_name in ("as_fitted", "drift_corrected"):
        below = comparison[(comparison["load_fraction"] <= 0.85 + 1e-9) & (comparison["cost_model"] == model_name)]

        def worst(metric, stat):
            rows = below[(below["metric"] == metric) & (below["stat"] == stat)]["diff_pct"].dropna()
            return float(rows.abs().max()) if len(rows) else None

        ttft, tpot = worst("ttft", "p90"), worst("tpot", "mean")
        out[model_name] = {"worst_abs_ttft_p90_diff_pct": ttft, "worst_abs_tpot_mean_diff_pct": tpot,
                           "met": ttft is not None and tpot is not None and ttft <= goal and tpot <= goal}
    errors = steps["error_pct"] if len(steps) else pd.Series(dtype=float)
    corrected = (100.0 + errors) * drift - 100.0
    out.update({
        "met": out["as_fitted"]["met"],
        "worst_abs_ttft_p90_diff_pct": out["as_fitted"]["worst_abs_ttft_p90_diff_pct"],
        "worst_abs_tpot_mean_diff_pct": out["as_fitted"]["worst_abs_tpot_mean_diff_pct"],
        "step_mape_pct": float(np.mean(np.abs(errors))) if len(errors) else None,
        "step_bias_pct": float(np.median(errors)) if len(errors) else None,
        "step_mape_drift_corrected_pct": float(np.mean(np.abs(corrected))) if len(errors) else None,
        "step_bias_drift_corrected_pct": float(np.median(corrected)) if len(errors) else None,
    })
    return out
