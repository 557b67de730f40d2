"""Capacity in users: the most concurrent users for which an SLO criterion still holds.

A user sends a request, waits for the whole reply, and sends the next at once: N users are the closed
loop of vLLM's client with --request-rate inf --max-concurrency N (servingplan.simulate.closed_loop). Each
seed is one draw of the workload's requests, served in the same order at every N (common random
numbers); N is found by bisection on the integers, assuming the criterion, once failed, fails for
every larger N. The result per seed is a bracket: the criterion held at `lower` users and failed at
`upper` (0 when it fails even for one user; upper None when it holds up to the searched maximum).
"""
from __future__ import annotations

import numpy as np

from servingplan.simulate.capacity import Criterion, int_bisect
from servingplan.simulate.closed_loop import simulate_closed_loop
from servingplan.simulate.metrics import summarize
from servingplan.simulate.policies import DEFAULT_CHUNK_BUDGET
from servingplan.simulate.workload import Trace


def holds_for_users(trace: Trace, users: int, cost, policy: str, cap: int, chunk_size: int, criterion: Criterion,
                    kv_blocks: int | None = None, block_size: int = 16,
                    chunk_budget: str = DEFAULT_CHUNK_BUDGET) -> bool:
    """Does the criterion hold when `users` users send the trace's requests back to back?"""
    at_once = Trace(np.zeros(len(trace)), trace.prompt_tokens, trace.output_tokens)
    result = simulate_closed_loop(at_once, cost, policy, cap, users, chunk_size, kv_blocks, block_size,
                                  record_tokens=criterion.slo.itl_ms is not None, chunk_budget=chunk_budget)
    return criterion.holds(summarize(result, criterion.slo))


def bisect_users(holds_at, users_max: int) -> dict:
    """Largest N in [1, users_max] where `holds_at(N)` is true, as a bracket."""
    evaluations = 0

    def check(users: int) -> bool:
        nonlocal evaluations
        evaluations += 1
        return holds_at(users)

    if not check(1):
        return {"lower": 0, "upper": 1, "evaluations": evaluations, "censored": "below_min"}
    if check(users_max):
        return {"lower": users_max, "upper": None, "evaluations": evaluations, "censored": "above_max"}
    lo, hi = int_bisect(check, 1, users_max)
    return {"lower": lo, "upper": hi, "evaluations": evaluations, "censored": ""}


def capacity_users(traces: list[Trace], seeds: list[int], cost, policy: str, cap: int, chunk_size: int,
                   criterion: Criterion, users_max: int, kv_blocks: int | None = None, block_size: int = 16,
                   chunk_budget: str = DEFAULT_CHUNK_BUDGET) -> dict:
    """Per-seed brackets; `capacity_users` is the smallest per-seed lower bound (every seed held there)."""
    if users_max < 1:
        raise ValueError(f"users_max {users_max}: must be >= 1")
    per_seed = []
    for seed, trace in zip(seeds, traces):
        bracket = bisect_users(lambda users, trace=trace: holds_for_users(
            trace, users, cost, policy, cap, chunk_size, criterion, kv_blocks, block_size, chunk_budget), users_max)
        per_seed.append({"seed": seed, **bracket})
    lowers = [s["lower"] for s in per_seed]
    return {"policy": policy, "max_num_seqs": cap, "criterion": criterion.label, "capacity_users": min(lowers),
            "capacity_users_max": max(lowers), "never_met": all(v == 0 for v in lowers), "per_seed": per_seed}
