"""The capstone planner: latency sweeps, capacity, fleets, speed-ups, and the recommendation.

Each function below is one pipeline cell (a policy and batch cap) or the final decision; the
Snakemake scripts only read inputs and write what these return.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from servingplan import money
from servingplan.costmodel import CostModel
from servingplan.capacity import Criterion, capacity_in_band, log_bisect, speed_band_models
from servingplan.memory import GB, kv_blocks_for_budget, memory_plan
from servingplan.metrics import SLO, summarize
from servingplan.seeds import over_seeds
from servingplan.sim import policies, simulate
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


def sweep_cell(step_model, machine, policy, cap, workload, slo, sweep, memory, seeds) -> pd.DataFrame:
    """Every (rate, seed) of one cell: latency percentiles, goodput, stability, KV use."""
    blocks = kv_blocks(machine, memory)
    rows = []
    for seed, trace in zip(seeds, traces(workload, seeds)):
        for rate in sweep_rates(sweep, workload, slo):
            result = simulate(trace.with_rate(rate), step_model, policy, cap, sweep["chunk_size"], blocks,
                              memory["block_size"], sweep["horizon_factor"], record_tokens=True,
                              chunk_budget=policies.chunk_budget(sweep))
            rows.append({"policy": policy, "max_num_seqs": cap, "chunk_size": sweep["chunk_size"],
                         "rate": rate, "seed": seed, "kv_blocks": blocks,
                         **summarize(result, capstone_slo(slo))})
    return pd.DataFrame(rows)


def chunk_cell(step_model, machine, cap, workload, slo, sweep, memory, seeds) -> pd.DataFrame:
    """Every chunking policy of the registry at one cap, for each configured chunk size, at today's rate
    and the capacity target rate, per seed: chunk sizes below the longest prompt split it, and trade
    shorter stalls for decoding sequences against more steps per prompt."""
    blocks = kv_blocks(machine, memory)
    rates = sorted({float(workload["rate"]), float(slo["capacity_target_rate"])})
    rows = []
    for policy in (p.name for p in policies.REGISTRY if p.unchunked):
        for seed, trace in zip(seeds, traces(workload, seeds)):
            for chunk in sorted(sweep["chunk_sizes"]):
                for rate in rates:
                    result = simulate(trace.with_rate(rate), step_model, policy, cap, chunk, blocks,
                                      memory["block_size"], sweep["horizon_factor"], record_tokens=True,
                                      chunk_budget=policies.chunk_budget(sweep))
                    rows.append({"policy": policy, "max_num_seqs": cap, "chunk_size": chunk, "rate": rate,
                                 "seed": seed, "kv_blocks": blocks, **summarize(result, capstone_slo(slo))})
    return pd.DataFrame(rows)


CAPACITY_CRITERIA = ("ttft_slo", "joint_attainment", "stable")


def capacity_cell(step_model, machine, policy, cap, workload, slo, sweep, memory, seeds, capacity,
                  criteria=CAPACITY_CRITERIA) -> dict:
    """Capacity under three criteria (or those of them named in `criteria`): the TTFT percentile SLO
    (the capstone's), joint attainment of TTFT and TPOT, and bare stability (the most load the machine
    keeps up with at all)."""
    blocks = kv_blocks(machine, memory)
    draws = traces(workload, seeds)
    every = {
        "ttft_slo": Criterion(ttft_slo(slo)),
        "joint_attainment": Criterion(capstone_slo(slo), attainment_goal=slo["attainment_goal"]),
        "stable": Criterion(SLO(), attainment_goal=0.0),
    }
    criteria = {name: every[name] for name in criteria}
    return {name: capacity_in_band(draws, seeds, step_model, policy, cap, sweep["chunk_size"], criterion,
                                   capacity["rate_min"], capacity["rate_max"], capacity["tolerance"], blocks,
                                   memory["block_size"], sweep["horizon_factor"], policies.chunk_budget(sweep))
            for name, criterion in criteria.items()}


def capacity_rows(cell: dict):
    """One capacity cell as rows of the capacity table, one per criterion: the interval over seeds and
    the measured speed band as two columns (the band's own capacities stay in the cell)."""
    for name, result in cell.items():
        interval = result.get("interval_rps") or [None, None]
        yield {"criterion_name": name,
               **{k: v for k, v in result.items() if k not in ("per_seed", "interval_rps", "speed_band")},
               "interval_lo_rps": interval[0], "interval_hi_rps": interval[1],
               "per_seed_lower": ";".join(f"{s['lower']:.6g}" for s in result["per_seed"]),
               # no upper bound (the search held at rate_max) is null in JSON and inf in this text column
               "per_seed_upper": ";".join("inf" if s["upper"] is None else f"{s['upper']:.6g}"
                                          for s in result["per_seed"])}


def _targets_hold(run, rates, slo) -> tuple[bool, dict]:
    """Both latency targets at once: the TTFT percentile SLO at today's rate and at the capacity
    target rate, judged on the mean over seeds of the per-seed percentile; any unstable seed fails."""
    detail = {}
    pct = f"ttft_ms_p{slo['ttft_percentile']:g}"
    for label, rate in rates.items():
        cell = over_seeds(pd.DataFrame(run(rate)).assign(rate=rate), ["rate"]).iloc[0]
        mean = None if pd.isna(cell[pct]) else float(cell[pct])
        detail[label] = {"rate": rate, "stable": bool(cell["stable"]) and mean is not None, "ttft_ms_mean": mean}
    ok = all(d["stable"] and d["ttft_ms_mean"] <= slo["ttft_ms"] for d in detail.values())
    return ok, detail


def fleet_cell(step_model, machine, policy, cap, workload, slo, sweep, memory, seeds, capacity, cost_cfg,
               speedup_band: bool = True) -> dict:
    """Smallest fleet per router that meets both latency targets, and the single-machine speed-up
    that would do the same (with `speedup_band`, also at the slowest and fastest measured speed)."""
    blocks = kv_blocks(machine, memory)
    draws = traces(workload, seeds)
    rates = {"today": float(workload["rate"]), "capacity_target": float(slo["capacity_target_rate"])}
    target_slo = ttft_slo(slo)

    def fleet_run(replicas, router, model):
        def run(rate):
            return [summarize(simulate_fleet(t.with_rate(rate), model, policy, cap, sweep["chunk_size"],
                                             blocks, memory["block_size"], sweep["horizon_factor"],
                                             replicas, router, chunk_budget=policies.chunk_budget(sweep)),
                                     target_slo) for t in draws]
        return run

    fleets = {}
    for router in cost_cfg["routers"]:
        if router not in ROUTERS:
            raise ValueError(f"router {router!r}: allowed {', '.join(ROUTERS)}")
        fleets[router] = smallest_fleet(lambda r: _targets_hold(fleet_run(r, router, step_model), rates, slo),
                                        cost_cfg["max_replicas"])

    def speedup_for(model):
        return smallest_speedup(
            lambda speedup: _targets_hold(fleet_run(1, "round_robin", model.scaled(speedup)), rates, slo)[0],
            capacity["tolerance"])

    return {"policy": policy, "max_num_seqs": cap, "kv_blocks": blocks, "fleets": fleets,
            **speedup_for(step_model),
            "speedup_speed_band": {name: speedup_for(model) for name, model in speed_band_models(step_model).items()}
            if speedup_band else {}}


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


# The capstone's four targets, in the order every table and sentence lists them.
TARGETS = ("latency", "capacity", "memory", "cost")


def _interval(row, lo_key: str, hi_key: str, fallback: tuple[str, str]) -> list[float] | None:
    """The capacity stage's interval (seeds' spread and the measured speed band) when it wrote one,
    else the seeds' spread alone."""
    for lo_name, hi_name in ((lo_key, hi_key), fallback):
        if lo_name in row and pd.notna(row.get(lo_name)) and pd.notna(row.get(hi_name)):
            return [float(row[lo_name]), float(row[hi_name])]
    return None


def _capacity_row(capacity_frame: pd.DataFrame, criterion: str, policy: str, cap: int) -> dict:
    rows = capacity_frame[(capacity_frame["criterion_name"] == criterion) & (capacity_frame["policy"] == policy)
                          & (capacity_frame["max_num_seqs"] == cap)]
    row = rows.iloc[0].to_dict()
    return {"rps": float(row["capacity_rps"]), "never_met": bool(row.get("never_met", False)),
            "seeds_range": [float(row["capacity_min_rps"]), float(row["capacity_max_rps"])],
            "interval": _interval(row, "interval_lo_rps", "interval_hi_rps", ("capacity_min_rps", "capacity_max_rps")),
            "with_speed_band": "interval_lo_rps" in row and pd.notna(row.get("interval_lo_rps"))}


def prefill_floor(step_model: CostModel, traces, percentile: float) -> dict:
    """The TTFT percentile the prompts alone impose (ms): each request's prefill with no queue and
    nothing else running; no number of machines lowers it. With the share of each prefill term of the
    step-time model in the prefill of the prompt at that percentile: where a speed-up must come from."""
    prompts = np.concatenate([t.prompt_tokens for t in traces]).astype(int)
    prefill_ms = np.array([step_model.prefill_time(int(p)) * 1e3 for p in prompts])
    at_percentile = int(np.percentile(prompts, percentile, method="nearest"))
    terms = {"prefill_fixed_s": step_model.prefill_fixed_s,
             "prefill_per_token_s": step_model.prefill_per_token_s * at_percentile,
             "prefill_per_token_sq_s": step_model.prefill_per_token_sq_s * at_percentile ** 2}
    total = sum(terms.values())
    longest = int(prompts.max())
    return {"floor_ms": float(np.percentile(prefill_ms, percentile)),
            "prompt_at_percentile": at_percentile,
            "term_shares": {term: value / total for term, value in terms.items() if value > 0} if total else {},
            "longest_prompt": longest, "longest_prompt_ms": step_model.prefill_time(longest) * 1e3}


def _serving_memory(validation: dict | None) -> dict | None:
    measured = (validation or {}).get("serving_memory")
    if not measured or measured.get("peak_rss_bytes") is None:
        return None
    return {"peak_rss_bytes": float(measured["peak_rss_bytes"]), "max_num_seqs": measured.get("max_num_seqs"),
            "policy": (validation or {}).get("policy")}


def _speed(machine: dict | None) -> dict | None:
    speed = (machine or {}).get("speed")
    if not speed:
        return None
    return {"moved_pct": float(speed["moved_pct"]), "moved_more_than_10pct": bool(speed["moved_more_than_10pct"])}


def recommend(latency: pd.DataFrame, capacity_frame: pd.DataFrame, memory: pd.DataFrame, fleet_cells: list[dict],
              cost_cfg: dict, slo: dict, workload: dict, seeds: list[int], step_model: CostModel,
              machine: dict | None = None, validation: dict | None = None) -> dict:
    """The whole decision as data: every configuration scored against the four targets, the cheapest
    that meets all (or the closest), the one physical reason when none does, what it would take, the
    next step, and the intervals of the headline figures. The report only formats this."""
    price = cost_cfg["price_per_hour"]
    demand = offered_tokens_per_s(workload, seeds)
    today_rate = float(workload["rate"])
    pct = f"ttft_ms_p{slo['ttft_percentile']:g}"
    today = over_seeds(latency[np.isclose(latency["rate"], today_rate)], ["policy", "max_num_seqs"], spread=True)
    mem_rows = memory.set_index(["policy", "max_num_seqs"])
    fleets = {(c["policy"], c["max_num_seqs"]): c for c in fleet_cells}
    serving_memory = _serving_memory(validation)

    candidates = []
    for cell in today.to_dict(orient="records"):
        policy, cap = cell["policy"], int(cell["max_num_seqs"])
        latency_ms = _defined(cell[pct])
        mem_row, fleet = mem_rows.loc[(policy, cap)], fleets[(policy, cap)]
        served = _defined(cell["throughput_tok_s"])
        capacity = _capacity_row(capacity_frame, "ttft_slo", policy, cap)
        keeps_up = _capacity_row(capacity_frame, "stable", policy, cap)
        row = {
            "policy": policy, "max_num_seqs": cap, "replicas": 1, "router": None,
            "stable_today": cell["stable"],
            "latency_ms": latency_ms,
            "latency_ms_range": [cell[f"{pct}_min"], cell[f"{pct}_max"]] if latency_ms is not None else None,
            "goodput_rps": _defined(cell["goodput_rps"]),
            "capacity_rps": capacity["rps"], "capacity_interval": capacity["interval"],
            "capacity_never_met": capacity["never_met"], "capacity_with_speed_band": capacity["with_speed_band"],
            "keeps_up_rps": keeps_up["rps"], "keeps_up_interval": keeps_up["interval"],
            "memory_bytes": float(mem_row["total_reserved_bytes"]),
            "memory_used_peak_bytes": float(mem_row["total_used_peak_bytes"]),
            "memory_measured_bytes": serving_memory["peak_rss_bytes"] if serving_memory else None,
            "budget_bytes": float(mem_row["budget_bytes"]),
            "cost_per_1k": money.cost_per_1k_tokens(price, 1, served) if served else None,
            "throughput_tok_s": served,
            "speedup_needed": fleet["speedup_needed"],
            "speedup_bracket": fleet.get("speedup_bracket"),
        }
        candidates.append(_judge(row, slo, cost_cfg))
        for router, found in fleet["fleets"].items():
            if found["feasible"] and found["replicas"] > 1:
                detail = found["detail"]
                fleet_row = dict(row, replicas=found["replicas"], router=router, stable_today=True,
                                 latency_ms=detail["today"]["ttft_ms_mean"], latency_ms_range=None,
                                 capacity_rps=None, capacity_interval=None, capacity_target_met=True,
                                 cost_per_1k=money.cost_per_1k_tokens(price, found["replicas"], demand),
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
    takes = _what_it_would_take(fleets, memory, price, demand, cost_cfg, chosen, today_rate, capacity_frame)
    floor = prefill_floor(step_model, traces(workload, seeds), slo["ttft_percentile"])
    reason = _reason(status, chosen, floor, slo, takes)
    return {
        "status": status,
        "targets": list(TARGETS),
        "chosen": chosen,
        "verdict": _verdict(chosen, slo, cost_cfg, serving_memory),
        "candidates": candidates,
        "offered_tokens_per_s": demand,
        "price_per_hour": price,
        "prefill_floor": floor,
        "reason": reason,
        "what_it_would_take": takes,
        "next_step": _next_step(status, reason, takes),
        "machine_speed": _speed(machine),
        "serving_memory": serving_memory,
        "passed": [t for t in TARGETS if chosen[f"{t}_met"]],
        "missed": [t for t in TARGETS if not chosen[f"{t}_met"]],
    }


def _defined(value) -> float | None:
    return None if value is None or pd.isna(value) else float(value)


def _judge(row: dict, slo: dict, cost_cfg: dict) -> dict:
    row["latency_met"] = row["latency_ms"] is not None and row["latency_ms"] <= slo["ttft_ms"]
    if "capacity_target_met" not in row:
        row["capacity_target_met"] = row["capacity_rps"] >= slo["capacity_target_rate"]
    row["capacity_met"] = row["capacity_target_met"]
    row["memory_met"] = row["memory_bytes"] <= row["budget_bytes"] and (
        row["memory_measured_bytes"] is None or row["memory_measured_bytes"] <= row["budget_bytes"])
    row["cost_met"] = row["cost_per_1k"] is not None and row["cost_per_1k"] <= cost_cfg["target_per_1k_tokens"]
    row["n_pass"] = sum(bool(row[f"{t}_met"]) for t in TARGETS)
    row["passes_all"] = row["n_pass"] == len(TARGETS)
    return row


def _keep_up(chosen: dict, today_rate: float, price: float, demand: float) -> dict | None:
    """Machines needed merely to keep up with today's rate, from one machine's stable rate and its
    interval: the upper end of the rate needs the fewest machines."""
    rps, interval = chosen["keeps_up_rps"], chosen["keeps_up_interval"] or [chosen["keeps_up_rps"]] * 2
    if not rps or not interval[0]:
        return None
    count = math.ceil(today_rate / rps)
    counts = [math.ceil(today_rate / interval[1]), math.ceil(today_rate / interval[0])]
    return {"machines": count, "machines_interval": counts, "machines_vary": counts[0] != counts[1], "one_machine_rps": rps, "one_machine_interval": interval,
            "cost_per_1k": money.cost_per_1k_tokens(price, count, demand),
            "cost_per_1k_interval": [money.cost_per_1k_tokens(price, n, demand) for n in counts]}


def _speedup_interval(factor: float, bracket, band: dict) -> list[float]:
    """The speed-up needed, as an interval: the search's bracket, widened by the same search on the
    step-time model at the slowest and fastest speed the profile measured (the fleet cell's
    speedup_speed_band) when it carries one."""
    lo, hi = bracket if bracket and bracket[1] is not None else (factor, factor)
    for found in band.values():
        low, high = found.get("speedup_bracket") or (None, None)
        if found.get("speedup_needed") is None or high is None:
            continue
        lo, hi = min(lo, low), max(hi, high)
    return [lo, hi]


def _what_it_would_take(fleets: dict, memory: pd.DataFrame, price: float, demand: float, cost_cfg: dict,
                        chosen: dict, today_rate: float, capacity_frame: pd.DataFrame) -> dict:
    fits = set(map(tuple, memory[memory["fits_reserved"]][["policy", "max_num_seqs"]].itertuples(index=False)))
    best_fleet = {}
    for router in cost_cfg["routers"]:
        options = [(f["fleets"][router]["replicas"], key) for key, f in fleets.items()
                   if key in fits and f["fleets"][router]["feasible"]]
        if options:
            replicas, (policy, cap) = min(options)
            best_fleet[router] = {"router": router, "replicas": replicas, "policy": policy, "max_num_seqs": cap,
                                  "cost_per_1k": money.cost_per_1k_tokens(price, replicas, demand)}
            best_fleet[router]["within_cost"] = best_fleet[router]["cost_per_1k"] <= cost_cfg["target_per_1k_tokens"]
    cheapest = min(best_fleet.values(), key=lambda f: (f["replicas"], f["router"])) if best_fleet else None
    speedups = [(f["speedup_needed"], key, f.get("speedup_bracket"), f.get("speedup_speed_band") or {})
                for key, f in fleets.items() if key in fits and f["speedup_needed"] is not None]
    best_speedup = min(speedups, key=lambda s: (s[0], s[1])) if speedups else None
    cell = fleets.get((chosen["policy"], chosen["max_num_seqs"]))
    return {
        "any_fits_memory": bool(fits),
        "fleets": list(best_fleet.values()),
        "cheapest_fleet": cheapest,
        "largest_fleet": _largest_fleet(cell) if cell else None,
        "max_replicas": cost_cfg["max_replicas"],
        "max_replicas_within_cost": money.max_replicas_within(price, demand, cost_cfg["target_per_1k_tokens"]),
        "keep_up": None if chosen["stable_today"] else _keep_up(chosen, today_rate, price, demand),
        "speedup": None if best_speedup is None else
        {"factor": best_speedup[0], "policy": best_speedup[1][0], "max_num_seqs": best_speedup[1][1],
         "interval": _speedup_interval(best_speedup[0], best_speedup[2], best_speedup[3]),
         "with_speed_band": bool(best_speedup[3])},
    }


def _largest_fleet(cell: dict) -> dict | None:
    """How a configuration fares on the largest fleet tried when no fleet met the latency targets: the
    router with the lowest TTFT at today's rate."""
    if any(found["feasible"] for found in cell["fleets"].values()):
        return None
    tried = [{"router": router, "replicas": found["max_replicas"], **found["at_max"]}
             for router, found in sorted(cell["fleets"].items())]
    return min(tried, key=lambda f: (f["today"]["ttft_ms_mean"] is None, f["today"]["ttft_ms_mean"] or 0.0))


def _reason(status: str, chosen: dict, floor: dict, slo: dict, takes: dict) -> dict:
    """The one physical reason the targets are missed, with its numbers, in order of what no fleet fixes."""
    if status == "met":
        return {"kind": "none"}
    if floor["floor_ms"] > slo["ttft_ms"]:
        return {"kind": "prefill_floor", "floor_ms": floor["floor_ms"], "slo_ms": slo["ttft_ms"],
                "speedup_for_floor": floor["floor_ms"] / slo["ttft_ms"]}
    if not takes["any_fits_memory"]:
        return {"kind": "memory"}
    if not chosen["stable_today"]:
        return {"kind": "keep_up", "one_machine_rps": chosen["keeps_up_rps"]}
    if not chosen["latency_met"] or not chosen["capacity_met"]:
        return {"kind": "queue", "floor_ms": floor["floor_ms"], "slo_ms": slo["ttft_ms"]}
    if not chosen["memory_met"]:
        return {"kind": "memory"}
    return {"kind": "cost"}


def _next_step(status: str, reason: dict, takes: dict) -> str:
    """What to do next: deploy, measure on the target machine, buy a fleet, or revisit the budget."""
    if status == "met":
        return "deploy"
    if reason["kind"] == "memory":
        return "revisit_memory"
    if reason["kind"] == "prefill_floor" or takes["cheapest_fleet"] is None:
        return "rerun_on_target_machine"
    return "fleet" if takes["cheapest_fleet"]["within_cost"] else "fleet_over_cost"


def _verdict(chosen: dict, slo: dict, cost_cfg: dict, serving_memory: dict | None) -> list[dict]:
    """One row per target: what was asked, what the chosen configuration achieved (with its interval),
    and whether it passed; `unstable` marks a figure that does not exist because the queue grows."""
    unstable = not chosen["stable_today"]
    return [
        {"target": "latency", "goal_ms": slo["ttft_ms"], "percentile": slo["ttft_percentile"],
         "achieved": chosen["latency_ms"], "interval": chosen["latency_ms_range"], "unstable": unstable,
         "passed": chosen["latency_met"]},
        {"target": "capacity", "goal_rps": slo["capacity_target_rate"], "achieved": chosen["capacity_rps"],
         "interval": chosen["capacity_interval"], "never_met": chosen["capacity_never_met"],
         "held_by_fleet": chosen["replicas"] > 1, "passed": chosen["capacity_met"]},
        {"target": "memory", "goal_bytes": chosen["budget_bytes"], "achieved": chosen["memory_bytes"],
         "used_peak_bytes": chosen["memory_used_peak_bytes"],
         "measured_bytes": serving_memory["peak_rss_bytes"] if serving_memory else None,
         "measured_cap": serving_memory["max_num_seqs"] if serving_memory else None,
         "passed": chosen["memory_met"]},
        {"target": "cost", "goal_per_1k": cost_cfg["target_per_1k_tokens"], "achieved": chosen["cost_per_1k"],
         "unstable": unstable, "passed": chosen["cost_met"]},
    ]
