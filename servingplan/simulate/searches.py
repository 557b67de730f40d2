"""The cells that search on verdicts alone: each configuration's capacity under every criterion, and the
smallest fleet and single-machine speed-up that meet the latency targets. Their processes never import
pandas (an import costs a third of a second in each of the pipeline's many cell jobs)."""
from __future__ import annotations

import math

import numpy as np

from servingplan.memory import kv_blocks
from servingplan.seeds import figures_over_seeds
from servingplan.simulate import policies
from servingplan.simulate.capacity import (Criterion, busy_floor, capacity_searches, int_bisect, search_rate,
                                           speed_band_models, ttft_floor_s)
from servingplan.simulate.fleet import ROUTERS, simulate_fleet
from servingplan.simulate.metrics import SLO, miss_limit, summarize
from servingplan.simulate.workload import generate

SPEEDUP_MAX = 1e4


def capstone_slo(slo_cfg: dict) -> SLO:
    return SLO(ttft_ms=slo_cfg["ttft_ms"], ttft_percentile=slo_cfg["ttft_percentile"],
               tpot_ms=slo_cfg["tpot_ms"], tpot_percentile=slo_cfg["ttft_percentile"])


def ttft_slo(slo_cfg: dict) -> SLO:
    return SLO(ttft_ms=slo_cfg["ttft_ms"], ttft_percentile=slo_cfg["ttft_percentile"])


def traces(workload_cfg: dict, seeds: list[int]):
    return [generate(workload_cfg, seed) for seed in seeds]


CAPACITY_CRITERIA = ("ttft_slo", "joint_attainment", "stable")


def capacity_cell(step_model, machine, policy, cap, workload, slo, sweep, memory, seeds, capacity,
                  criteria=CAPACITY_CRITERIA, runtime_bytes: float | None = None) -> dict:
    """Capacity under three criteria (or those of them named in `criteria`): the TTFT percentile SLO
    (the capstone's), joint attainment of TTFT and TPOT, and bare stability (the most load the machine
    keeps up with at all). The KV pool is the machine's KV model's (memory.kv_blocks)."""
    blocks = kv_blocks(machine, memory, cap, runtime_bytes)
    draws = traces(workload, seeds)
    every = {
        "ttft_slo": Criterion(ttft_slo(slo)),
        "joint_attainment": Criterion(capstone_slo(slo), attainment_goal=slo["attainment_goal"]),
        "stable": Criterion(SLO(), attainment_goal=0.0),
    }
    return capacity_searches(draws, seeds, step_model, policy, cap, sweep["chunk_size"],
                             {name: every[name] for name in criteria}, capacity["rate_min"], capacity["rate_max"],
                             capacity["tolerance"], blocks, memory["block_size"], sweep["horizon_factor"],
                             policies.chunk_budget(sweep))


def _targets_hold(run, rates, slo, verdict_only: bool = False) -> tuple[bool, dict]:
    """Both latency targets at once: the TTFT percentile SLO at today's rate and at the capacity
    target rate, judged on the slowest seed's percentile (the pessimistic end, as a single machine's
    verdict reads it); any unstable seed fails. The detail keeps the mean and the fastest and slowest
    seeds' percentiles, in the order of `rates`. With `verdict_only` the higher rate goes first and the
    first failure ends it (the detail of a failure is then partial); `run(rate, verdict_only)` returns
    (summaries, settled_failing) and may then stop before its last seed once the targets are settled
    failing (an unstable seed, or a seed's percentile above the target, or a run stopped on its settled
    misses, which has no summary)."""
    detail = {}
    pct = f"ttft_ms_p{slo['ttft_percentile']:g}"
    for label, rate in (sorted(rates.items(), key=lambda item: -item[1]) if verdict_only else rates.items()):
        runs, settled_failing = run(rate, verdict_only)
        if verdict_only and settled_failing:
            return False, detail
        # undefined when a seed is unstable or has no percentile
        figures = figures_over_seeds([summary[pct] for summary in runs],
                                     all(summary["stable"] for summary in runs), spread=True)
        detail[label] = {"rate": rate, "stable": figures is not None,
                         "ttft_ms_mean": figures["mean"] if figures else None,
                         "ttft_ms_range": [figures["min"], figures["max"]] if figures else None}
        if verdict_only and not (figures and figures["max"] <= slo["ttft_ms"]):
            return False, detail
    ok = all(d["stable"] and d["ttft_ms_range"][1] <= slo["ttft_ms"] for d in detail.values())
    return ok, {label: detail[label] for label in rates}


def fleet_cell(step_model, machine, policy, cap, workload, slo, sweep, memory, seeds, capacity, cost_cfg,
               speedup_band: bool = True, runtime_bytes: float | None = None) -> dict:
    """Smallest fleet per router that meets both latency targets, and the single-machine speed-up
    that would do the same (with `speedup_band`, also at the slowest and fastest measured speed).
    Runs stop once settled unstable (the verdict and its detail read no latency of an unstable run).
    Only a feasible fleet's detail and the largest fleet's are reported, so every other fleet size and
    every speed-up is judged on its verdict alone: its seeds stop once one fails (an unstable seed, or its
    TTFT percentile over the target: the slowest seed's is judged), the seed that failed last going first,
    and each run stops once enough of its requests missed the TTFT target to settle that (simulate.misses).
    One replica's runs are shared by every router and the speed-up search; each search starts from
    the analytic bounds: a speed-up below the one that brings the prefill floor's percentile to the
    target fails, and with one slot per replica, so do fewer replicas, or a smaller speed-up, than
    the busy-time floor needs to keep up. Each replica's KV pool is the machine's KV model's."""
    blocks = kv_blocks(machine, memory, cap, runtime_bytes)
    draws = traces(workload, seeds)
    rates = {"today": float(workload["rate"]), "capacity_target": float(slo["capacity_target_rate"])}
    target_slo = ttft_slo(slo)
    runs = {}
    misses = [[miss_limit(target_slo, t.output_tokens)] for t in draws]
    # seeds in the order a verdict tries them: the one that failed last first, as the next failure is
    # likely on it too (a holding verdict runs every seed whatever the order)
    seed_order = list(range(len(draws)))

    pct = f"ttft_ms_p{slo['ttft_percentile']:g}"

    def fleet_run(replicas, router, model):
        def run(rate, verdict_only=False):
            key = (replicas, router if replicas > 1 else None, model, rate)
            if key in runs:
                return runs[key], False
            summaries = {}
            for index in list(seed_order) if verdict_only else range(len(draws)):
                result = simulate_fleet(
                    draws[index].with_rate(rate), model, policy, cap, sweep["chunk_size"], blocks,
                    memory["block_size"], sweep["horizon_factor"], replicas, router,
                    chunk_budget=policies.chunk_budget(sweep), stop_when_unstable=True,
                    stop_when_missed=misses[index] if verdict_only else None)
                # settled: too many requests missed the TTFT target for the percentile to meet it, the seed
                # is unstable, or its percentile exceeds the target
                failed = result.misses_settled
                if not failed:
                    summaries[index] = summarize(result, target_slo)
                    failed = verdict_only and (not summaries[index]["stable"] or summaries[index][pct] > slo["ttft_ms"])
                if failed:
                    seed_order.remove(index)
                    seed_order.insert(0, index)
                    return list(summaries.values()), True
            runs[key] = [summaries[index] for index in range(len(draws))]
            return runs[key], False
        return run

    def floor_load(model) -> float:
        """The largest load the busy-time floor alone puts on one replica at a target rate."""
        return max(busy_floor(t, model, policy, cap) * rate / len(t) for t in draws for rate in rates.values())

    def replicas_below_keep_up(model) -> float:
        """With one slot per replica: the fleet size up to which the busy-time floor alone brings the mean
        per-replica load to 1 or more at some target rate, unstable (a fleet is judged on that mean, whatever
        its router). With more slots nothing is known (0)."""
        return floor_load(model) if cap == 1 else 0.0

    def latency_floor_speedup(model) -> float:
        """The speed-up that brings the slowest seed's prefill floor percentile to the TTFT target
        (slightly less: known to fail up to it); above 1, no fleet of this machine meets it."""
        floor_ms = max(np.percentile(ttft_floor_s(t, model, policy) * 1e3, slo["ttft_percentile"]) for t in draws)
        return floor_ms / slo["ttft_ms"] * (1.0 - 1e-9)

    def failing_speedup(model) -> float:
        """The largest speed-up known to fail: the busy-time floor fills one replica's trace at a target
        rate, or the slowest seed's prefill floor percentile exceeds the TTFT target."""
        return max(replicas_below_keep_up(model), latency_floor_speedup(model))

    fewest = math.floor(replicas_below_keep_up(step_model)) + 1
    # the largest fleet first only when the prefill floor already fails the target (its detail is the answer)
    largest_first = latency_floor_speedup(step_model) >= 1.0
    fleets = {}
    for router in cost_cfg["routers"]:
        if router not in ROUTERS:
            raise ValueError(f"router {router!r}: allowed {', '.join(ROUTERS)}")
        # the largest fleet's detail is reported when none is feasible: it alone is run in full
        fleets[router] = smallest_fleet(
            lambda r: _targets_hold(fleet_run(r, router, step_model), rates, slo,
                                    verdict_only=r != cost_cfg["max_replicas"]),
            cost_cfg["max_replicas"], fewest, largest_first)

    def speedup_for(model, guess):
        return smallest_speedup(
            lambda speedup: _targets_hold(fleet_run(1, "round_robin", model.scaled(speedup) if speedup != 1.0
                                                    else model), rates, slo, verdict_only=True)[0],
            capacity["tolerance"], failing_speedup(model), guess)

    # the fitted model's search starts just above its known failure, or where the busy-time floor says
    # full batches would saturate (with more slots not a failure, a guess); each speed of the band's at
    # the fitted answer scaled by the ratio of those starting points
    known = failing_speedup(step_model)
    start = max(known, floor_load(step_model))
    fitted = speedup_for(step_model, start * (1.0 + capacity["tolerance"]) if start >= 1.0 else None)
    band = {}
    if speedup_band:
        for name, model in speed_band_models(step_model).items():
            scale = max(failing_speedup(model), floor_load(model)) / start if start >= 1.0 else 1.0
            band[name] = speedup_for(model, fitted["speedup_needed"] * scale if fitted["speedup_needed"] else None)
    return {"policy": policy, "max_num_seqs": cap, "kv_blocks": blocks, "fleets": fleets, **fitted,
            "speedup_speed_band": band}


def smallest_speedup(holds, tolerance: float, fails_up_to: float = 0.0, guess: float | None = None) -> dict:
    """Least factor by which every term of the cost model must shrink for `holds` (log bisection);
    None when even SPEEDUP_MAX is not enough. Known without a run: `holds` fails at every factor up to
    `fails_up_to`; the search starts at `guess` when given (capacity.search_rate on the factor's inverse)."""
    found = search_rate(lambda inverse: holds(1.0 / inverse), 1.0 / SPEEDUP_MAX, 1.0, tolerance,
                        1.0 / fails_up_to if fails_up_to > 0 else math.inf, None,
                        1.0 / guess if guess else None)
    if found["censored"] == "above_max":
        return {"speedup_needed": 1.0, "speedup_bracket": [1.0, 1.0]}
    if found["censored"] == "below_min":
        return {"speedup_needed": None, "speedup_bracket": [SPEEDUP_MAX, None]}
    return {"speedup_needed": 1.0 / found["lower"], "speedup_bracket": [1.0 / found["upper"], 1.0 / found["lower"]]}


def smallest_fleet(holds, max_replicas: int, fewest: int = 1, largest_first: bool = True) -> dict:
    """Fewest replicas for which `holds(r)` is (True, detail), where fewer than `fewest` are known to
    fail. With `largest_first` the largest fleet is tried first, so a target no fleet can meet (a
    latency floor that replicas do not lower) costs one evaluation; then doubling from `fewest` and
    bisection."""
    tried = {}

    def check(r):
        if r not in tried:
            tried[r] = holds(r)
        return tried[r][0]

    def infeasible():
        return {"replicas": None, "feasible": False, "max_replicas": max_replicas,
                "at_max": tried[max_replicas][1], "tried": sorted(tried)}

    if largest_first and not check(max_replicas):
        return infeasible()
    r = min(max(fewest, 1), max_replicas)
    failed = r - 1
    while not check(r):
        if r == max_replicas:
            return infeasible()
        failed, r = r, min(2 * r, max_replicas)
    _, hi = int_bisect(lambda replicas: not check(replicas), failed, r)
    return {"replicas": hi, "feasible": True, "detail": tried[hi][1], "tried": sorted(tried)}
