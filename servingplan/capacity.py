"""Capacity: the highest Poisson arrival rate at which an SLO statistic still holds.

Each seed is one draw of the workload; its arrival gaps are rescaled to every candidate rate (common
random numbers), so the statistic is compared across rates on the same requests. The rate is found
by bisection on a log scale; an unstable queue counts as a failure. The result per seed is a
bracket [lower, upper]: the SLO held at `lower` and failed at `upper`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from servingplan.metrics import SLO, summarize
from servingplan.sim import simulate
from servingplan.sim.policies import DEFAULT_CHUNK_BUDGET
from servingplan.workload import Trace


@dataclass(frozen=True)
class Criterion:
    """What must hold at a rate: the SLO's aggregate percentiles, or joint attainment >= a goal."""
    slo: SLO
    attainment_goal: float | None = None

    def holds(self, summary: dict) -> bool:
        if not summary["stable"]:
            return False
        if self.attainment_goal is not None:
            return summary["attainment"] >= self.attainment_goal
        return bool(summary["slo_holds"])

    @property
    def label(self) -> str:
        if self.attainment_goal is not None:
            return f"attainment>={self.attainment_goal:g}"
        return "slo_percentiles"


# Halving the log-width of any finite positive bracket this many times reaches neighbouring floats.
MAX_BISECTIONS = 200


def log_bisect(true_below, lo: float, hi: float, tolerance: float) -> tuple[float, float]:
    """Narrow [lo, hi] on a log scale around where `true_below` turns from true (at lo) to false (at hi),
    until the relative width is within `tolerance`, the bounds are neighbouring floats (no midpoint
    lies between them), or MAX_BISECTIONS evaluations."""
    if not (0.0 < lo < hi and math.isfinite(hi)):
        raise ValueError(f"log_bisect bracket [{lo}, {hi}]: needs finite bounds 0 < lo < hi")
    for _ in range(MAX_BISECTIONS):
        if hi / lo - 1.0 <= tolerance:
            break
        mid = math.sqrt(lo * hi)
        if not lo < mid < hi:
            break
        if true_below(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


def bisect_rate(holds_at: Callable[[float], bool], rate_min: float, rate_max: float,
                tolerance: float) -> dict:
    """Largest rate in [rate_min, rate_max] where `holds_at` is true, assuming it fails above some rate."""
    evaluations = 0

    def check(rate):
        nonlocal evaluations
        evaluations += 1
        return holds_at(rate)

    if not check(rate_min):
        return {"lower": 0.0, "upper": rate_min, "evaluations": evaluations, "censored": "below_min"}
    if check(rate_max):
        # no upper bound was found (null: JSON has no infinity); `censored` says why
        return {"lower": rate_max, "upper": None, "evaluations": evaluations, "censored": "above_max"}
    lo, hi = log_bisect(check, rate_min, rate_max, tolerance)
    return {"lower": lo, "upper": hi, "evaluations": evaluations, "censored": ""}


def run_at_rate(trace: Trace, rate: float, cost, policy: str, cap: int, chunk_size: int,
                kv_blocks: int | None, block_size: int, horizon_factor: float, slo: SLO,
                chunk_budget: str = DEFAULT_CHUNK_BUDGET) -> dict:
    result = simulate(trace.with_rate(rate), cost, policy, cap, chunk_size, kv_blocks, block_size,
                      horizon_factor, chunk_budget=chunk_budget)
    return summarize(result, slo)


def capacity(traces: list[Trace], seeds: list[int], cost, policy: str, cap: int, chunk_size: int,
             criterion: Criterion, rate_min: float, rate_max: float, tolerance: float,
             kv_blocks: int | None = None, block_size: int = 16, horizon_factor: float = 20.0,
             chunk_budget: str = DEFAULT_CHUNK_BUDGET) -> dict:
    """Per-seed brackets and their spread. `capacity` is the median of the per-seed lower bounds."""
    per_seed = []
    for seed, trace in zip(seeds, traces):
        def holds_at(rate, trace=trace):
            return criterion.holds(run_at_rate(trace, rate, cost, policy, cap, chunk_size, kv_blocks,
                                               block_size, horizon_factor, criterion.slo, chunk_budget))
        bracket = bisect_rate(holds_at, rate_min, rate_max, tolerance)
        per_seed.append({"seed": seed, **bracket})
    lowers = np.array([s["lower"] for s in per_seed])
    return {
        "policy": policy, "max_num_seqs": cap, "chunk_size": chunk_size, "criterion": criterion.label,
        "capacity_rps": float(np.median(lowers)), "capacity_min_rps": float(lowers.min()),
        "capacity_max_rps": float(lowers.max()),
        "never_met": bool((lowers == 0).all()), "per_seed": per_seed,
    }


def speed_band_models(cost) -> dict:
    """The cost model at the slowest and the fastest speed its profile measured (cost.meta's
    speed_band: each reference's relative speed range), or nothing for a model without one."""
    band = cost.meta.get("speed_band") or {}
    if not {"decode", "prefill"} <= set(band):
        return {}
    return {"slow": cost.slowed(band["decode"][1], band["prefill"][1], f"{cost.name} at its slowest"),
            "fast": cost.slowed(band["decode"][0], band["prefill"][0], f"{cost.name} at its fastest")}


def capacity_in_band(traces: list[Trace], seeds: list[int], cost, *args, **kwargs) -> dict:
    """capacity() on the cost model as fitted, plus `speed_band` (the same search on the cost model at
    the slowest and fastest measured speed) and `interval_rps`, which covers the seeds' spread at
    every one of those speeds."""
    found = capacity(traces, seeds, cost, *args, **kwargs)
    band = {name: capacity(traces, seeds, model, *args, **kwargs)
            for name, model in speed_band_models(cost).items()}
    searched = [found, *band.values()]
    return {**found, "speed_band": band,
            "interval_rps": [min(f["capacity_min_rps"] for f in searched),
                             max(f["capacity_max_rps"] for f in searched)]}
