"""The capstone planner: latency sweeps, capacity, fleets, speed-ups, and the recommendation.

Each function below is one pipeline cell (a policy and batch cap) or the final decision; the
Snakemake scripts only read inputs and write what these return.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from servingplan import cost as costs
from servingplan.capacity import Criterion, capacity_in_band, log_bisect, speed_band_models
from servingplan.memory import GB, kv_blocks_for_budget, memory_plan
from servingplan.metrics import SLO, summarize
from servingplan.sim import simulate
from servingplan.sim.fleet import ROUTERS, simulate_fleet
from servingplan.workload import generate

SPEEDUP_MAX = 1e4


def capstone_slo(slo_cfg: dict) -> SLO:
    return SLO(ttft_ms=slo_cfg["ttft_ms"], ttft_percentile=slo_cfg["ttft_percentile"],
               tpot_ms=slo_cfg["tpot_ms"], tpot_percentile=slo_cfg["ttft_percentile"])


def ttft_slo(slo_cfg: dict) -> SLO:
    return SLO(ttft_ms=slo_cfg["ttft_ms"], ttft_percentile=slo_cfg["ttft_percentile"])


def kv_blocks(machine: dict, memory_cfg: dict) -> int:
    """Paged KV blocks the memory budget leaves beside the measured weights."""
    mem = machine["memory"]
    return kv_blocks_for_budget(memory_cfg["budget_gb"] * GB, mem["param_bytes"], mem["kv_bytes_per_token"],
                                memory_cfg["block_size"])


def sweep_rates(sweep_cfg: dict, workload_cfg: dict, slo_cfg: dict) -> list[float]:
    """The configured rates plus today's rate and the capacity target, which the verdict reads."""
    return sorted(set(map(float, sweep_cfg["rates"])) | {float(workload_cfg["rate"]),
                                                          float(slo_cfg["capacity_target_rate"])})


def traces(workload_cfg: dict, seeds: list[int]):
    return [generate(workload_cfg, seed) for seed in seeds]


def sweep_cell(cost, machine, policy, cap, workload, slo, sweep, memory, seeds) -> pd.DataFrame:
    """Every (rate, seed) of one cell: latency percentiles, goodput, stability, KV use."""
    blocks = kv_blocks(machine, memory)
    rows = []
    for seed, trace in zip(seeds, traces(workload, seeds)):
        for rate in sweep_rates(sweep, workload, slo):
            result = simulate(trace.with_rate(rate), cost, policy, cap, sweep["chunk_size"], blocks,
                              memory["block_size"], sweep["horizon_factor"], record_tokens=True)
            rows.append({"policy": policy, "max_num_seqs": cap, "chunk_size": sweep["chunk_size"],
                         "rate": rate, "seed": seed, "kv_blocks": blocks,
                         **summarize(result, capstone_slo(slo))})
    return pd.DataFrame(rows)


def capacity_cell(cost, machine, policy, cap, workload, slo, sweep, memory, seeds, capacity) -> dict:
    """Capacity under three criteria: the TTFT percentile SLO (the capstone's), joint attainment of
    TTFT and TPOT, and bare stability (the most load the machine keeps up with at all)."""
    blocks = kv_blocks(machine, memory)
    draws = traces(workload, seeds)
    criteria = {
        "ttft_slo": Criterion(ttft_slo(slo)),
        "joint_attainment": Criterion(capstone_slo(slo), attainment_goal=slo["attainment_goal"]),
        "stable": Criterion(SLO(), attainment_goal=0.0),
    }
    return {name: capacity_in_band(draws, seeds, cost, policy, cap, sweep["chunk_size"], criterion,
                                   capacity["rate_min"], capacity["rate_max"], capacity["tolerance"], blocks,
                                   memory["block_size"], sweep["horizon_factor"])
            for name, criterion in criteria.items()}


def _targets_hold(run, rates, slo) -> tuple[bool, dict]:
    """Both latency targets at once: the TTFT percentile SLO at today's rate and at the capacity
    target rate, judged on the mean over seeds of the per-seed percentile; any unstable seed fails."""
    detail = {}
    for label, rate in rates.items():
        summaries = run(rate)
        values = [s[f"ttft_ms_p{slo['ttft_percentile']:g}"] for s in summaries]
        stable = all(s["stable"] for s in summaries) and None not in values
        detail[label] = {"rate": rate, "stable": stable,
                         "ttft_ms_mean": float(np.mean(values)) if stable else None}
    ok = all(d["stable"] and d["ttft_ms_mean"] <= slo["ttft_ms"] for d in detail.values())
    return ok, detail


def fleet_cell(cost, machine, policy, cap, workload, slo, sweep, memory, seeds, capacity, cost_cfg) -> dict:
    """Smallest fleet per router that meets both latency targets, and the single-machine speed-up
    that would do the same."""
    blocks = kv_blocks(machine, memory)
    draws = traces(workload, seeds)
    rates = {"today": float(workload["rate"]), "capacity_target": float(slo["capacity_target_rate"])}
    target_slo = ttft_slo(slo)

    def fleet_run(replicas, router, model):
        def run(rate):
            return [summarize(simulate_fleet(t.with_rate(rate), model, policy, cap, sweep["chunk_size"],
                                             blocks, memory["block_size"], sweep["horizon_factor"],
                                             replicas, router), target_slo) for t in draws]
        return run

    fleets = {}
    for router in cost_cfg["routers"]:
        if router not in ROUTERS:
            raise ValueError(f"router {router!r}: allowed {', '.join(ROUTERS)}")
        fleets[router] = smallest_fleet(lambda r: _targets_hold(fleet_run(r, router, cost), rates, slo),
                                        cost_cfg["max_replicas"])

    def speedup_for(model):
        return smallest_speedup(
            lambda speedup: _targets_hold(fleet_run(1, "round_robin", model.scaled(speedup)), rates, slo)[0],
            capacity["tolerance"])

    return {"policy": policy, "max_num_seqs": cap, "kv_blocks": blocks, "fleets": fleets,
            **speedup_for(cost),
            "speedup_speed_band": {name: speedup_for(model) for name, model in speed_band_models(cost).items()}}


def smallest_speedup(holds, tolerance: float) -> dict:
    """Least factor by which every term of the cost model must shrink for `holds` (log bisection);
    None when even SPEEDUP_MAX is not enough."""
    if holds(1.0):
        return {"speedup_needed": 1.0, "speedup_bracket": [1.0, 1.0]}
    if not holds(SPEEDUP_MAX):
        return {"speedup_needed": None, "speedup_bracket": [SPEEDUP_MAX, None]}
    lo, hi = log_bisect(lambda speedup: not holds(speedup), 1.0, SPEEDUP_MAX, tolerance)
    return {"speedup_needed": hi, "speedup_bracket": [lo, hi]}


def smallest_fleet(holds, max_replicas: int) -> dict:
    """Fewest replicas for which `holds(r)` is (True, detail). The largest fleet is tried first, so
    a target no fleet can meet (a latency floor that replicas do not lower) costs one evaluation;
    then doubling and bisection."""
    tried = {}

    def check(r):
        if r not in tried:
            tried[r] = holds(r)
        return tried[r][0]

    if not check(max_replicas):
        return {"replicas": None, "feasible": False, "max_replicas": max_replicas,
                "at_max": tried[max_replicas][1], "tried": sorted(tried)}
    failed, r = 0, 1
    while not check(r):
        failed, r = r, min(2 * r, max_replicas)
    lo, hi = failed, r
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if check(mid):
            hi = mid
        else:
            lo = mid
    return {"replicas": hi, "feasible": True, "detail": tried[hi][1], "tried": sorted(tried)}


def memory_table(machine: dict, latency: pd.DataFrame, memory_cfg: dict, rate: float) -> tuple[pd.DataFrame, dict]:
    """Weights + KV per (policy, cap): reserved for the maximum context, and the simulation's peak
    of paged blocks at today's rate (the largest over seeds)."""
    mem = machine["memory"]
    budget = memory_cfg["budget_gb"] * GB
    today = latency[np.isclose(latency["rate"], rate)]
    rows = []
    for (policy, cap), group in today.groupby(["policy", "max_num_seqs"], sort=True):
        rows.append({"policy": policy, **memory_plan(int(cap), mem["param_bytes"], mem["kv_bytes_per_token"],
                                                     memory_cfg["max_context"], memory_cfg["block_size"],
                                                     budget, int(group["peak_kv_blocks"].max()))})
    table = pd.DataFrame(rows)
    model = machine["model"]
    summary = {
        "budget_bytes": budget,
        "weights_bytes": mem["param_bytes"],
        "params": model.get("params"),
        "kv_bytes_per_token_measured": mem["kv_bytes_per_token"],
        "kv_bytes_per_token_analytic": mem["kv_bytes_per_token_expected"],
        "rss_after_load_bytes": mem["rss_after_load_bytes"],
        "peak_rss_profile_bytes": mem["peak_rss_bytes"],
        "kv_blocks_in_budget": kv_blocks(machine, memory_cfg),
        "largest_cap_in_budget": int(table["largest_cap_in_budget"].iloc[0]) if len(table) else None,
        "max_context": memory_cfg["max_context"],
        "block_size": memory_cfg["block_size"],
    }
    return table, summary


def offered_tokens_per_s(workload: dict, seeds: list[int]) -> float:
    """Output tokens per second the traffic asks for at today's rate (mean over the seeds' draws)."""
    return float(np.mean([t.output_tokens.mean() for t in traces(workload, seeds)]) * workload["rate"])


def recommend(latency: pd.DataFrame, capacity_frame: pd.DataFrame, memory: pd.DataFrame, fleet_cells: list[dict],
              cost_cfg: dict, slo: dict, workload: dict, seeds: list[int]) -> dict:
    """Score every configuration against the four targets; pick the cheapest that meets all, or the
    closest and what it would take."""
    pct = f"ttft_ms_p{slo['ttft_percentile']:g}"
    price = cost_cfg["price_per_hour"]
    demand = offered_tokens_per_s(workload, seeds)
    today = latency[np.isclose(latency["rate"], workload["rate"])]
    cap_rows = capacity_frame[capacity_frame["criterion_name"] == "ttft_slo"].set_index(["policy", "max_num_seqs"])
    mem_rows = memory.set_index(["policy", "max_num_seqs"])
    fleets = {(c["policy"], c["max_num_seqs"]): c for c in fleet_cells}

    candidates = []
    for (policy, cap), group in today.groupby(["policy", "max_num_seqs"], sort=True):
        stable = bool(group["stable"].all())
        values = group[pct].astype(float)
        latency_ms = float(values.mean()) if stable and values.notna().all() else None
        cap_row, mem_row, fleet = cap_rows.loc[(policy, cap)], mem_rows.loc[(policy, cap)], fleets[(policy, cap)]
        served = float(group["throughput_tok_s"].mean()) if stable else None
        single_cost = costs.cost_per_1k_tokens(price, 1, served) if served else None
        row = {
            "policy": policy, "max_num_seqs": int(cap), "replicas": 1, "router": None,
            "latency_ms": latency_ms, "latency_ms_std": float(values.std(ddof=1)) if latency_ms is not None and len(values) > 1 else None,
            "latency_ms_min": float(values.min()) if latency_ms is not None else None,
            "latency_ms_max": float(values.max()) if latency_ms is not None else None,
            "stable_today": stable,
            "capacity_rps": float(cap_row["capacity_rps"]), "capacity_min_rps": float(cap_row["capacity_min_rps"]),
            "capacity_max_rps": float(cap_row["capacity_max_rps"]),
            "memory_bytes": float(mem_row["total_reserved_bytes"]),
            "memory_used_peak_bytes": float(mem_row["total_used_peak_bytes"]),
            "budget_bytes": float(mem_row["budget_bytes"]),
            "cost_per_1k": single_cost, "throughput_tok_s": served,
            "speedup_needed": fleet["speedup_needed"],
        }
        candidates.append(_judge(row, slo, cost_cfg))
        for router, found in fleet["fleets"].items():
            if found["feasible"] and found["replicas"] > 1:
                detail = found["detail"]
                fleet_row = dict(row, replicas=found["replicas"], router=router,
                                 latency_ms=detail["today"]["ttft_ms_mean"], latency_ms_std=None,
                                 latency_ms_min=None, latency_ms_max=None, stable_today=True,
                                 capacity_rps=None, capacity_min_rps=None, capacity_max_rps=None,
                                 capacity_target_met=True,
                                 cost_per_1k=costs.cost_per_1k_tokens(price, found["replicas"], demand),
                                 throughput_tok_s=demand)
                candidates.append(_judge(fleet_row, slo, cost_cfg))

    passing = [c for c in candidates if c["passes_all"]]
    if passing:
        chosen = min(passing, key=lambda c: (c["cost_per_1k"], c["replicas"], -(c["capacity_rps"] or 0)))
        status = "met"
    else:
        chosen = min((c for c in candidates if c["replicas"] == 1),
                     key=lambda c: (-c["n_pass"], c["speedup_needed"] if c["speedup_needed"] is not None else math.inf,
                                    c["latency_ms"] if c["latency_ms"] is not None else math.inf))
        status = "not_met"

    return {
        "status": status,
        "chosen": chosen,
        "verdict": _verdict(chosen, slo, cost_cfg),
        "candidates": candidates,
        "offered_tokens_per_s": demand,
        "price_per_hour": price,
        "what_it_would_take": _what_it_would_take(fleets, memory, price, demand, cost_cfg),
    }


def _judge(row: dict, slo: dict, cost_cfg: dict) -> dict:
    row["latency_met"] = row["latency_ms"] is not None and row["latency_ms"] <= slo["ttft_ms"]
    if "capacity_target_met" not in row:
        row["capacity_target_met"] = row["capacity_rps"] >= slo["capacity_target_rate"]
    row["memory_met"] = row["memory_bytes"] <= row["budget_bytes"]
    row["cost_met"] = row["cost_per_1k"] is not None and row["cost_per_1k"] <= cost_cfg["target_per_1k_tokens"]
    flags = [row["latency_met"], row["capacity_target_met"], row["memory_met"], row["cost_met"]]
    row["n_pass"] = sum(map(bool, flags))
    row["passes_all"] = all(flags)
    return row


def _what_it_would_take(fleets: dict, memory: pd.DataFrame, price: float, demand: float, cost_cfg: dict) -> dict:
    fits = set(map(tuple, memory[memory["fits_reserved"]][["policy", "max_num_seqs"]].itertuples(index=False)))
    best_fleet = {}
    for router in cost_cfg["routers"]:
        options = [(f["fleets"][router]["replicas"], key) for key, f in fleets.items()
                   if key in fits and f["fleets"][router]["feasible"]]
        if options:
            replicas, (policy, cap) = min(options)
            best_fleet[router] = {"replicas": replicas, "policy": policy, "max_num_seqs": cap,
                                  "cost_per_1k": costs.cost_per_1k_tokens(price, replicas, demand)}
        else:
            best_fleet[router] = None
    speedups = [(f["speedup_needed"], key) for key, f in fleets.items()
                if key in fits and f["speedup_needed"] is not None]
    best_speedup = min(speedups) if speedups else None
    return {
        "fleet": best_fleet,
        "max_replicas_within_cost": costs.max_replicas_within(price, demand, cost_cfg["target_per_1k_tokens"]),
        "speedup": None if best_speedup is None else
        {"factor": best_speedup[0], "policy": best_speedup[1][0], "max_num_seqs": best_speedup[1][1]},
    }


def _verdict(chosen: dict, slo: dict, cost_cfg: dict) -> list[dict]:
    return [
        {"target": "latency", "goal": f"p{slo['ttft_percentile']:g} TTFT <= {slo['ttft_ms']:g} ms at today's rate",
         "achieved_ms": chosen["latency_ms"], "spread_ms": [chosen["latency_ms_min"], chosen["latency_ms_max"]],
         "passed": chosen["latency_met"]},
        {"target": "capacity", "goal": f">= {slo['capacity_target_rate']:g} req/s with the TTFT SLO",
         "achieved_rps": chosen["capacity_rps"], "spread_rps": [chosen["capacity_min_rps"], chosen["capacity_max_rps"]],
         "passed": chosen["capacity_target_met"]},
        {"target": "memory", "goal": "weights + KV cache within the budget",
         "achieved_bytes": chosen["memory_bytes"], "passed": chosen["memory_met"]},
        {"target": "cost", "goal": f"<= ${cost_cfg['target_per_1k_tokens']:g} per 1,000 output tokens",
         "achieved_per_1k": chosen["cost_per_1k"], "passed": chosen["cost_met"]},
    ]
