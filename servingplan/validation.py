"""The validation stage: replay Poisson traces on the real engine and simulate the same traces.

Rates are fractions of the largest rate this machine keeps up with (the simulator's stability
capacity for the validated policy and cap), from well below it to overload. Each trace holds at least
`min_requests` requests, enough for its p90 to mean something, and the stage's serving time is
bounded by `max_wall_s` whatever the machine's speed.

The machine's speed moves by tens of percent within minutes, so the stage re-times the profile's two
reference shapes (servingplan.profiling.measure.reference_points) before every trace and after the
last, with the profiler's own estimator: the ratio to the profile's median reference time is how much
slower (above one) the machine runs now than it typically did while it was profiled. Each trace is
also simulated on the cost model slowed by the ratios measured just before and after it. The cost
model itself is fitted on the profile alone: the replays judge it and never feed it.

Besides the replays the stage measures two things the report needs:
- path check: engine decode steps and the profiler's point of the same shape (batch, ragged contexts,
  padding, KV pool layout), timed back to back in alternating rounds; their ratio shows the profile
  times what the engine runs;
- serving memory: the engine's peak resident memory while it served the traces.
"""
from __future__ import annotations

import time

import numpy as np
import pandas as pd
import psutil
import torch

from servingplan.capacity import Criterion, capacity
from servingplan.device import model_device
from servingplan.metrics import SLO
from servingplan.pipeline import terminal
from servingplan.planner import kv_blocks
from servingplan.profiling.machine import roofline_probes
from servingplan.profiling.measure import (GridPoint, build_grid, decode_lengths, point_call, pool_for,
                                           reference_points, time_call, time_references)
from servingplan.serving.engine import Engine
from servingplan.serving.replay import compare, predict_steps, replay, request_pairs
from servingplan.sim import simulate
from servingplan.sim.policies import chunk_budget
from servingplan.workload import Trace, generate

# batch sizes x longest context of the path check; its decode steps per engine run; rounds
PATH_CHECK_SHAPES = ((1, 256), (4, 256), (8, 256))
PATH_CHECK_STEPS = 12
PATH_CHECK_ROUNDS = 3
# a batch size's steps are judged only when there are this many of them
MIN_STEPS_PER_BATCH = 20
STEP_GOAL_PCT = 10.0


def validation_traces(workload: dict, validation: dict, stable_rps: float, seed: int):
    """One trace per configured load fraction: ~trace_seconds of arrivals at that rate, and never fewer
    than min_requests requests. Poisson arrivals are drawn; a trace file gives its first requests."""
    for i, fraction in enumerate(validation["rates_fraction"]):
        rate = fraction * stable_rps
        n = max(validation["min_requests"], int(round(rate * validation["trace_seconds"])))
        spec = dict(workload, num_requests=n, rate=rate)
        # A file's trace is the whole log whatever num_requests says. The engine serves in real time, so
        # the whole of a real log (thousands of requests) would take hours and overrun max_wall_s; its
        # first n requests are bounded like a Poisson trace and keep the log's own arrival pattern.
        trace = generate(spec, seed + 101 * (i + 1))
        if workload.get("trace"):
            trace = Trace(trace.arrival_s[:n], trace.prompt_tokens[:n], trace.output_tokens[:n])
        yield fraction, rate, trace.with_rate(rate)


class SpeedProbe:
    """Re-times the profile's reference shapes with the profiler's estimator, on a KV pool of the
    profile's geometry, and compares them with the profile's median reference times. The roofline
    probes are re-run beside them: an independent reading of whether the machine itself is slower."""

    def __init__(self, model, profile_meta: dict, seed: int):
        settings = profile_meta["settings"]
        self.settings = settings
        self.baseline = {kind: values["median_s"] for kind, values in profile_meta["speed"]["by_kind"].items()}
        self.roofline = profile_meta["roofline"]
        points = reference_points(settings)
        generator = torch.Generator().manual_seed(seed)
        # slots for the reference batch only, but the profile's slot length, so every slot's view has the
        # profile's strides without holding the profile's whole pool (gigabytes) beside the engine
        longest = max(p.cached + p.prompt_len for p in build_grid(settings) + list(points.values()))
        self.device = model_device(model)
        pool = pool_for(model.config, list(points.values()) + [GridPoint("prefill", 1, longest, 0)], generator,
                        self.device)
        self.pool_bytes = int(pool.keys.nbytes + pool.values.nbytes)
        self.calls = {kind: point_call(model, pool, point, generator) for kind, point in points.items()}
        self.started = time.perf_counter()
        self.rows: list[dict] = []
        self.probes: list[dict] = []

    def measure(self, label: str) -> dict:
        """{kind: now / profiled} at this moment, recorded under `label`."""
        ratios = {}
        with torch.inference_mode():
            for row in time_references(self.calls, self.settings, self.started):
                ratios[row["kind"]] = row["seconds"] / self.baseline[row["kind"]]
                self.rows.append({"label": label, **row, "profiled_s": self.baseline[row["kind"]],
                                  "ratio": ratios[row["kind"]]})
        now = roofline_probes(self.roofline["probe_bytes"], self.roofline["gemm_size"], self.device)
        self.probes.append({"label": label, "bandwidth_gbs": now["bandwidth_gbs"], "gemm_gflops": now["gemm_gflops"],
                            "bandwidth_over_profile": now["bandwidth_gbs"] / self.roofline["bandwidth_gbs"],
                            "gemm_over_profile": now["gemm_gflops"] / self.roofline["gemm_gflops"]})
        return ratios


def around(before: dict, after: dict) -> dict:
    return {kind: (before[kind] + after[kind]) / 2 for kind in before}


def path_check(model, profile_meta: dict, seed: int, shapes=PATH_CHECK_SHAPES, steps: int = PATH_CHECK_STEPS,
               rounds: int = PATH_CHECK_ROUNDS, threads: int | None = None) -> dict:
    """Engine decode steps against the profiler's point of the same shape, timed back to back.

    An engine run serves B requests whose prompts are decode_lengths(B, T) tokens, all arriving at
    once, under continuous batching with cap B: after one prefill step every later step decodes all B,
    as the profiler's point does. The point is timed at the contexts the engine's steps have halfway
    through its run. Engine and profiler alternate, `rounds` times, so both see the same machine."""
    settings = profile_meta["settings"]
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for batch, context in shapes:
        prompts = decode_lengths(batch, context).numpy()
        trace = Trace(np.zeros(batch), prompts.astype(np.int64), np.full(batch, steps + 1, dtype=np.int64))
        engine = Engine(model, "continuous", batch, threads=threads)
        middle = GridPoint("decode", batch, 1, context + steps // 2)
        pool = pool_for(model.config, [middle], generator, model_device(model))
        call = point_call(model, pool, middle, generator)
        engine_times, profile_times = [], []
        for _ in range(rounds):
            run = engine.run(trace, seed=seed)
            decoding = run.steps[(run.steps["batch"] == batch) & (run.steps["n_prefill_calls"] == 0)]
            engine_times.append(float(decoding["duration_s"].median()))
            with torch.inference_mode():
                timed = time_call(call, settings["warmup"], settings["repeats"], 0.0)
            profile_times.append(float(np.median([s for _, s, _ in timed])))
        engine_s, profile_s = float(np.median(engine_times)), float(np.median(profile_times))
        rows.append({"batch": batch, "context": context, "engine_step_s": engine_s, "profile_point_s": profile_s,
                     "engine_over_profile": engine_s / profile_s,
                     "engine_rounds_s": engine_times, "profile_rounds_s": profile_times})
    ratios = [row["engine_over_profile"] for row in rows]
    return {"shapes": rows, "median_ratio": float(np.median(ratios)),
            "max_abs_diff_pct": float(100 * max(abs(r - 1) for r in ratios))}


def steps_by_batch(steps: pd.DataFrame) -> pd.DataFrame:
    """Engine steps grouped by decode batch size (0: steps that only prefill): how many, and the
    median step time measured and predicted as fitted and as corrected for the speed around them."""
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


def run_validation(model, cost, machine: dict, profile_meta: dict, workload: dict, validation: dict,
                   sweep: dict, memory: dict, seed: int, threads: int | None = None) -> dict:
    policy, cap, chunk = validation["policy"], validation["cap"], sweep["chunk_size"]
    blocks = kv_blocks(machine, memory)
    draws = [generate(workload, seed + i) for i in range(3)]
    found = capacity(draws, [seed + i for i in range(3)], cost, policy, cap, chunk,
                     Criterion(SLO(), attainment_goal=0.0), 0.01, 64.0, 0.02, blocks, memory["block_size"],
                     sweep["horizon_factor"], chunk_budget(sweep))
    stable_rps = found["capacity_rps"]

    probe = SpeedProbe(model, profile_meta, seed)
    tables, pairs, steps, traces = [], [], [], []
    rss_before = psutil.Process().memory_info().rss
    peak_rss = rss_before
    pool_bytes = 0
    started = time.monotonic()
    before = probe.measure("before trace 1")
    for number, (fraction, rate, trace) in enumerate(validation_traces(workload, validation, stable_rps, seed), 1):
        remaining = validation["max_wall_s"] - (time.monotonic() - started)
        label = {"load_fraction": fraction, "rate": rate}
        if remaining <= 0:
            traces.append({**label, "requests": len(trace), "skipped": True})
            continue
        print(f"validate: trace {number} of {len(validation['rates_fraction'])}: {len(trace)} requests at "
              f"{rate:.3g} req/s ({fraction:g} x capacity), served in real time", file=terminal(), flush=True)
        measured, step_frame = replay(trace, model, policy, cap, chunk, blocks, memory["block_size"],
                                      max_wall_s=remaining, seed=seed, threads=threads,
                                      chunk_budget=chunk_budget(sweep))
        after = probe.measure(f"after trace {number}")
        speed = around(before, after)
        before = after
        peak_rss = max(peak_rss, measured.meta["peak_rss_bytes"])
        pool_bytes = max(pool_bytes, measured.meta["kv_pool_bytes"])
        corrected_cost = cost.slowed(speed["decode"], speed["prefill"])
        for name, model_cost in (("as_fitted", cost), ("drift_corrected", corrected_cost)):
            simulated = simulate(trace, model_cost, policy, cap, chunk, blocks, memory["block_size"],
                                 sweep["horizon_factor"], chunk_budget=chunk_budget(sweep))
            tables.append(compare(measured, simulated).assign(**label, cost_model=name))
            if name == "as_fitted":
                pairs.append(request_pairs(measured, simulated).assign(**label))
                traces.append({**label, "requests": len(trace), "skipped": False,
                               "measured_finished": int(measured.finished.sum()),
                               "measured_truncated": bool(measured.truncated),
                               "simulated_stable": bool(simulated.stable),
                               "measured_wall_s": float(measured.end_s), "errors": len(measured.meta.get("errors", {})),
                               "speed_ratio": speed})
        predicted = predict_steps(step_frame, cost)
        corrected = predict_steps(step_frame, corrected_cost)
        steps.append(predicted.assign(corrected_s=corrected["predicted_s"],
                                      corrected_error_pct=corrected["error_pct"], **label))

    # after the replays, so that its engines and pools are not part of the serving memory measured above
    print("validate: timing engine steps against profile points of the same shape", file=terminal(), flush=True)
    checked = path_check(model, profile_meta, seed, threads=threads)
    comparison = pd.concat(tables, ignore_index=True) if tables else pd.DataFrame()
    if len(comparison):
        comparison["agrees"] = agreement(comparison, validation["goal_pct"])
    step_frame = pd.concat(steps, ignore_index=True) if steps else pd.DataFrame()
    by_batch = steps_by_batch(step_frame)
    speed_trace = pd.DataFrame(probe.rows)
    drift = {kind: float(speed_trace.loc[speed_trace["kind"] == kind, "ratio"].median())
             for kind in probe.calls} if len(speed_trace) else {}
    drift_ratio = float(np.mean(list(drift.values()))) if drift else 1.0
    return {
        "comparison": comparison,
        "requests": pd.concat(pairs, ignore_index=True) if pairs else pd.DataFrame(),
        "steps": step_frame.drop(columns=["prefill_calls"], errors="ignore"),
        "steps_by_batch": by_batch,
        "meta": {
            "policy": policy, "max_num_seqs": cap, "chunk_size": chunk, "kv_blocks": blocks,
            "stable_capacity_rps": stable_rps, "stable_capacity_interval": [found["capacity_min_rps"],
                                                                            found["capacity_max_rps"]],
            "traces": traces,
            "machine_drift": {"by_kind": drift, "ratio": drift_ratio,
                              "trace": probe.rows, "roofline": probe.probes},
            "path_check": checked,
            "serving_memory": {"peak_rss_bytes": int(peak_rss), "rss_before_replays_bytes": int(rss_before),
                               "kv_pool_bytes": int(pool_bytes), "speed_probe_pool_bytes": probe.pool_bytes,
                               "max_num_seqs": cap, "policy": policy},
            "steps_by_batch": by_batch.to_dict("records"),
            "headline": headline(comparison, by_batch, validation, step_frame, drift_ratio),
        },
    }


def agreement(rows: pd.DataFrame, goal_pct: float) -> pd.Series:
    """A simulated statistic agrees when it lies inside the measured bootstrap 90% interval or within
    goal_pct of the measured value."""
    inside = (rows["simulated_ms"] >= rows["measured_lo_ms"]) & (rows["simulated_ms"] <= rows["measured_hi_ms"])
    return inside | (rows["diff_pct"].abs() <= goal_pct)


def headline(comparison: pd.DataFrame, by_batch: pd.DataFrame, validation: dict,
             steps: pd.DataFrame | None = None, drift: float = 1.0) -> dict:
    """The agreement figures the report leads with: p90 TTFT and mean TPOT at every load up to 0.85
    of capacity, for the cost model as fitted and corrected for the speed measured around each trace,
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
        below = comparison[(comparison["load_fraction"] <= 0.85 + 1e-9) & (comparison["cost_model"] == name)]
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
