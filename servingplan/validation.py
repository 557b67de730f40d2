"""The validation stage: replay Poisson traces on the real engine and simulate the same traces.

Rates are fractions of the largest rate this machine keeps up with (the simulator's stability
capacity for the validated policy and cap), from well below it to overload. Each trace lasts about
`trace_seconds` of arrivals, so the stage's wall time is bounded whatever the machine's speed.
"""
from __future__ import annotations

import time

import numpy as np
import pandas as pd

from servingplan.capacity import Criterion, capacity
from servingplan.metrics import SLO
from servingplan.planner import kv_blocks
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


def run_validation(model, cost, machine: dict, workload: dict, validation: dict, sweep: dict, memory: dict,
                   seed: int, threads: int | None = None) -> dict:
    policy, cap, chunk = validation["policy"], validation["cap"], sweep["chunk_size"]
    blocks = kv_blocks(machine, memory)
    draws = [generate(workload, seed + i) for i in range(3)]
    found = capacity(draws, [seed + i for i in range(3)], cost, policy, cap, chunk,
                     Criterion(SLO(), attainment_goal=0.0), 0.01, 64.0, 0.02, blocks, memory["block_size"],
                     sweep["horizon_factor"])
    stable_rps = found["capacity_rps"]

    tables, pairs, steps, traces = [], [], [], []
    started = time.monotonic()
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
        pairs.append(request_pairs(measured, simulated).assign(**label))
        steps.append(predict_steps(step_frame, cost).assign(**label))
        traces.append({**label, "requests": len(trace), "skipped": False,
                       "measured_finished": int(measured.finished.sum()),
                       "measured_truncated": bool(measured.truncated), "simulated_stable": bool(simulated.stable),
                       "measured_wall_s": float(measured.end_s), "errors": len(measured.meta.get("errors", {}))})

    comparison = pd.concat(tables, ignore_index=True) if tables else pd.DataFrame()
    step_frame = pd.concat(steps, ignore_index=True) if steps else pd.DataFrame()
    return {
        "comparison": comparison,
        "requests": pd.concat(pairs, ignore_index=True) if pairs else pd.DataFrame(),
        "steps": step_frame.drop(columns=["prefill_calls"], errors="ignore"),
        "meta": {
            "policy": policy, "max_num_seqs": cap, "chunk_size": chunk, "kv_blocks": blocks,
            "stable_capacity_rps": stable_rps, "stable_capacity_interval": [found["capacity_min_rps"],
                                                                            found["capacity_max_rps"]],
            "traces": traces, "headline": headline(comparison, step_frame, validation),
        },
    }


def headline(comparison: pd.DataFrame, steps: pd.DataFrame, validation: dict) -> dict:
    """The agreement figures the report leads with: p90 TTFT and mean TPOT error below 85% load,
    and the cost model's per-step error."""
    if comparison.empty:
        return {"evaluated": False}
    below = comparison[comparison["load_fraction"] <= 0.85 + 1e-9]

    def worst(metric, stat):
        rows = below[(below["metric"] == metric) & (below["stat"] == stat)]["diff_pct"].dropna()
        return float(rows.abs().max()) if len(rows) else None

    ttft, tpot = worst("ttft", "p90"), worst("tpot", "mean")
    goal = validation["goal_pct"]
    return {
        "evaluated": True, "goal_pct": goal,
        "worst_abs_ttft_p90_diff_pct": ttft, "worst_abs_tpot_mean_diff_pct": tpot,
        "met": ttft is not None and tpot is not None and ttft <= goal and tpot <= goal,
        "step_mape_pct": float(np.mean(np.abs(steps["error_pct"]))) if len(steps) else None,
        "step_bias_pct": float(np.median(steps["error_pct"])) if len(steps) else None,
    }
