"""The capstone planner: latency sweeps, capacity, fleets, speed-ups, and the recommendation.

Each function below is one pipeline cell (a policy and batch cap) or the final decision; the
Snakemake scripts only read inputs and write what these return. The cells that search on verdicts
alone (capacity, fleets, speed-ups) are in servingplan.simulate.searches.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from servingplan.costmodel import CostModel
from servingplan.engine.memory_probe import resident_at
from servingplan.memory import GB, kv_blocks, kv_memory_model, memory_plan, paged_pool_blocks
from servingplan.plan import hardware, money
from servingplan.plan.hardware import HERE
from servingplan.seeds import over_seeds
from servingplan.simulate import policies, simulate
from servingplan.simulate.capacity import speed_band_models
from servingplan.simulate.closed_loop import simulate_load
from servingplan.simulate.metrics import summarize
from servingplan.simulate.searches import capstone_slo, traces


def sweep_rates(sweep_cfg: dict, workload_cfg: dict, slo_cfg: dict) -> list[float]:
    """The configured rates plus today's rate and the capacity target, which the verdict reads."""
    return sorted(set(map(float, sweep_cfg["rates"])) | {float(workload_cfg["rate"]),
                                                          float(slo_cfg["capacity_target_rate"])})


def sweep_cell(step_model, machine, policy, cap, workload, slo, sweep, memory, seeds,
               runtime_bytes: float | None = None, rates: list[float] | None = None) -> pd.DataFrame:
    """Every (rate, seed) of one cell: latency percentiles, goodput, stability, KV use; the KV pool is the
    machine's KV model's (memory.kv_blocks; `runtime_bytes`: the measured serving runtime a paged pool
    sits beside). The rates are the sweep's (sweep_rates) unless `rates` names others."""
    blocks = kv_blocks(machine, memory, cap, runtime_bytes)
    rows = []
    for seed, trace in zip(seeds, traces(workload, seeds)):
        for rate in rates if rates is not None else sweep_rates(sweep, workload, slo):
            result = simulate_load(trace.with_rate(rate), step_model, policy, cap, sweep["chunk_size"], blocks,
                                   memory["block_size"], sweep["horizon_factor"], workload.get("max_concurrency"),
                                   record_tokens=True, chunk_budget=policies.chunk_budget(sweep))
            rows.append({"policy": policy, "max_num_seqs": cap, "chunk_size": sweep["chunk_size"],
                         "rate": rate, "seed": seed, "kv_blocks": blocks,
                         **summarize(result, capstone_slo(slo))})
    return pd.DataFrame(rows)


def chunk_cell(step_model, machine, cap, workload, slo, sweep, memory, seeds,
               runtime_bytes: float | None = None) -> pd.DataFrame:
    """Every chunking policy of the registry at one cap, for each configured chunk size, at today's rate
    and the capacity target rate, per seed: chunk sizes below the longest prompt split it, and trade
    shorter stalls for decoding sequences against more steps per prompt."""
    blocks = kv_blocks(machine, memory, cap, runtime_bytes)
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


def memory_table(machine: dict, latency: pd.DataFrame, memory_cfg: dict, rate: float,
                 runtime_bytes: float | None = None, serving_memory: dict | None = None) -> tuple[pd.DataFrame, dict]:
    """Weights + KV per (policy, cap) of `latency` (the grid's cells and the cap search's): as the
    machine's KV model judges it (memory.memory_plan: the paged pool, or cap slots), beside the
    reservation for the maximum context, the simulation's peak of blocks held and its most preemptions at
    today's rate (over seeds), and, where this machine's serving was measured (`serving_memory`), the
    serving process's resident memory there (measured at that cap, or from the line fitted to the caps
    measured) with the runtime beside weights + KV that it implies."""
    mem = machine["memory"]
    today = latency[np.isclose(latency["rate"], rate)]
    rows = []
    for (policy, cap), group in today.groupby(["policy", "max_num_seqs"], sort=True):
        cap = int(cap)
        plan = memory_plan(cap, mem["param_bytes"], mem["kv_bytes_per_token"], memory_cfg,
                           int(group["peak_kv_blocks"].max()), kv_blocks(machine, memory_cfg, cap, runtime_bytes),
                           runtime_bytes)
        measured = _measured_memory(serving_memory, policy, cap)
        rows.append({"policy": policy, **plan, "preemptions_max": int(group["preemptions"].max()),
                     "resident_bytes": measured["bytes"] if measured else None,
                     "resident_basis": measured["basis"] if measured else None,
                     # what the serving process holds beyond weights + its slots' KV
                     "resident_beyond_reserved_bytes": measured["bytes"] - plan["total_reserved_bytes"]
                     if measured else None})
    table = pd.DataFrame(rows)
    model = machine["model"]
    summary = {
        "kv_memory": kv_memory_model(memory_cfg),
        "budget_bytes": memory_cfg["budget_gb"] * GB,
        "weights_bytes": mem["param_bytes"],
        "params": model.get("params"),
        "kv_bytes_per_token_measured": mem["kv_bytes_per_token"],
        "kv_bytes_per_token_analytic": mem["kv_bytes_per_token_expected"],
        "rss_after_load_bytes": mem["rss_after_load_bytes"],
        "peak_rss_profile_bytes": mem["peak_rss_bytes"],
        "runtime_bytes": runtime_bytes,
        "kv_blocks_in_budget": paged_pool_blocks(machine, memory_cfg, runtime_bytes),
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


def _measured_memory(serving_memory: dict | None, policy: str, cap: int) -> dict | None:
    """The serving process's peak memory on this machine at (policy, cap) (results/validation/serving_memory.json):
    {bytes, basis}, measured there or read from the line fitted to the caps measured; None without the file."""
    return resident_at(serving_memory, policy, cap) if serving_memory else None


def _speed(machine: dict | None) -> dict | None:
    speed = (machine or {}).get("speed")
    if not speed:
        return None
    return {"moved_pct": float(speed["moved_pct"]), "moved_more_than_10pct": bool(speed["moved_more_than_10pct"])}


THIS_MACHINE = {"machine": HERE, "display_name": "this machine", "measured": True}


def _fleet_replicas(found: int, single_capacity: dict, target_rate: float, max_replicas: int) -> int:
    """Replicas of a fleet judged on the pessimistic end: the fewest the fleet search found to meet both
    latency targets, raised until that many machines at the low end of one machine's capacity interval
    hold the capacity target rate (a round-robin share of Poisson arrivals is no burstier than Poisson,
    so each replica holds at least that); the search's own count when even max_replicas would not."""
    low = (single_capacity["interval"] or [single_capacity["rps"]] * 2)[0]
    if not low or single_capacity["never_met"]:
        return found
    needed = max(found, math.ceil(target_rate / low - 1e-12))
    return needed if needed <= max_replicas else found


def latency_capacity_row(cell: dict, capacity_frame: pd.DataFrame, slo: dict) -> dict:
    """One machine's latency and capacity figures at (policy, cap): `cell` is the cell's row of the
    latency table over seeds at today's rate (seeds.over_seeds, with spread), the capacity rows those of
    the capacity table. Judged by _judge_latency_capacity; the grid's cells and the cap search's read it."""
    pct = f"ttft_ms_p{slo['ttft_percentile']:g}"
    policy, cap = cell["policy"], int(cell["max_num_seqs"])
    latency_ms = _defined(cell[pct])
    capacity = _capacity_row(capacity_frame, "ttft_slo", policy, cap)
    keeps_up = _capacity_row(capacity_frame, "stable", policy, cap)
    return {
        "policy": policy, "max_num_seqs": cap, "replicas": 1, "router": None,
        "stable_today": cell["stable"],
        "latency_ms": latency_ms,
        "latency_ms_range": [cell[f"{pct}_min"], cell[f"{pct}_max"]] if latency_ms is not None else None,
        "goodput_rps": _defined(cell["goodput_rps"]),
        "capacity_rps": capacity["rps"], "capacity_interval": capacity["interval"],
        "capacity_never_met": capacity["never_met"], "capacity_with_speed_band": capacity["with_speed_band"],
        "keeps_up_rps": keeps_up["rps"], "keeps_up_interval": keeps_up["interval"],
    }


def today_cells(latency: pd.DataFrame, workload: dict) -> pd.DataFrame:
    """The latency table at today's rate, one row per (policy, cap) over seeds with their spread."""
    return over_seeds(latency[np.isclose(latency["rate"], float(workload["rate"]))], ["policy", "max_num_seqs"],
                      spread=True)


def searched_frames(searches: list[dict]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The latency rows (today's rate, per seed) and capacity rows of the caps the cap searches
    simulated (cap_search), as rows of the grid's latency and capacity tables."""
    latency = [row for found in searches for probe in found["probes"] for row in probe["latency_rows"]]
    capacity = [row for found in searches for probe in found["probes"] for row in probe["capacity_rows"]]
    return pd.DataFrame(latency), pd.DataFrame(capacity)


def with_searched(frame: pd.DataFrame, searched: pd.DataFrame) -> pd.DataFrame:
    """A grid table with the searched caps' rows after it."""
    return frame if searched.empty else pd.concat([frame, searched], ignore_index=True)


def recommend(latency: pd.DataFrame, capacity_frame: pd.DataFrame, memory: pd.DataFrame, fleet_cells: list[dict],
              cost_cfg: dict, slo: dict, workload: dict, seeds: list[int], step_model: CostModel,
              machine: dict | None = None, serving_memory: dict | None = None, label: dict | None = None,
              searches: list[dict] | None = None, kv_memory: dict | None = None) -> dict:
    """One machine's decision as data: every configuration (one machine, or a fleet of it) scored
    against the four targets on the pessimistic end of each interval, the cheapest that meets all (or
    the closest), the one physical reason when none does, what it would take, the next step, the
    options in the decision's form (`decide` ranks them across machines) and the routes to the targets.
    The configurations are the sweep grid's (with their fleets) and the caps the cap search simulated
    (`searches`, one per policy: cap_search; one machine each), whose ranges of caps meeting all four the
    result states. Memory is judged by the machine's KV model (`memory`, memory_table; `kv_memory`: the
    model and why, hardware.kv_memory_of); `serving_memory` (this machine only), the serving process's
    measured peak per (policy, cap), is reported beside it. `label` names the machine (THIS_MACHINE when
    not given). The report only formats this."""
    label = dict(label or THIS_MACHINE)
    searches = searches or []
    price = cost_cfg["price_per_hour"]
    demand = offered_tokens_per_s(workload, seeds)
    today_rate = float(workload["rate"])
    target_rate = float(slo["capacity_target_rate"])
    searched_latency, searched_capacity = searched_frames(searches)
    capacity_frame = with_searched(capacity_frame, searched_capacity)
    today = today_cells(with_searched(latency, searched_latency), workload)
    mem_rows = memory.set_index(["policy", "max_num_seqs"])
    fleets = {(c["policy"], c["max_num_seqs"]): c for c in fleet_cells}
    grid = set(fleets)

    candidates = []
    for cell in today.to_dict(orient="records"):
        policy, cap = cell["policy"], int(cell["max_num_seqs"])
        mem_row, fleet = mem_rows.loc[(policy, cap)], fleets.get((policy, cap))
        # a configuration that does not keep up serves no defined share of the traffic: no dollars
        served = _defined(cell["throughput_tok_s"]) if cell["stable"] else None
        capacity = _capacity_row(capacity_frame, "ttft_slo", policy, cap)
        measured = _measured_memory(serving_memory, policy, cap)
        slowest = _defined(cell.get("throughput_tok_s_min")) if served else None
        fastest = _defined(cell.get("throughput_tok_s_max")) if served else None
        row = {
            **latency_capacity_row(cell, capacity_frame, slo),
            # a cap the cap search simulated, not one of sweep.caps (it has no fleet search)
            "searched": (policy, cap) not in grid,
            "memory_kv_model": mem_row["kv_memory"],
            "memory_bytes": float(mem_row["judged_bytes"]),
            "memory_reserved_bytes": float(mem_row["total_reserved_bytes"]),
            "memory_used_peak_bytes": float(mem_row["total_used_peak_bytes"]),
            "memory_pool_blocks": int(mem_row["pool_blocks"]),
            "memory_fits": bool(mem_row["fits"]),
            "preemptions_max": int(mem_row["preemptions_max"]),
            "memory_runtime_bytes": _defined(mem_row.get("runtime_bytes")),
            "memory_measured_bytes": measured["bytes"] if measured else None,
            "memory_measured_basis": measured["basis"] if measured else None,
            "budget_bytes": float(mem_row["budget_bytes"]),
            "cost_per_1k": money.cost_per_1k_tokens(price, 1, served) if served else None,
            # dollars per 1,000 tokens at the seeds' highest and lowest served throughput
            "cost_per_1k_interval": [money.cost_per_1k_tokens(price, 1, fastest or served),
                                     money.cost_per_1k_tokens(price, 1, slowest or served)] if served else None,
            "throughput_tok_s": served,
            "speedup_needed": fleet["speedup_needed"] if fleet else None,
            "speedup_bracket": fleet.get("speedup_bracket") if fleet else None,
        }
        candidates.append(_judge(row, slo, cost_cfg))
        for router, found in (fleet["fleets"] if fleet else {}).items():
            if found["feasible"] and found["replicas"] > 1:
                detail = found["detail"]
                replicas = _fleet_replicas(found["replicas"], capacity, target_rate, cost_cfg["max_replicas"])
                per_machine = capacity["interval"] or [capacity["rps"]] * 2
                fleet_cost = money.cost_per_1k_tokens(price, replicas, demand)
                fleet_row = dict(row, replicas=replicas, router=router, replicas_searched=found["replicas"],
                                 stable_today=True, latency_ms=detail["today"]["ttft_ms_mean"],
                                 latency_ms_range=detail["today"]["ttft_ms_range"], capacity_rps=replicas * capacity["rps"],
                                 capacity_interval=[replicas * per_machine[0], replicas * per_machine[1]],
                                 capacity_never_met=False, cost_per_1k=fleet_cost,
                                 cost_per_1k_interval=[fleet_cost, fleet_cost], throughput_tok_s=demand)
                candidates.append(_judge(fleet_row, slo, cost_cfg))

    passing = [c for c in candidates if c["passes_all"]]
    if passing:
        # as the decision ranks them (_rank): the cheapest at the dear end, then the most capacity at the low end
        chosen = min(passing, key=lambda c: (c["cost_per_1k_interval"][1], -(c["capacity_judged_rps"] or 0.0),
                                             c["replicas"]))
        status = "met"
    else:
        chosen = min((c for c in candidates if c["replicas"] == 1),
                     key=lambda c: (-c["n_pass"], c["speedup_needed"] if c["speedup_needed"] is not None else math.inf,
                                    c["latency_ms"] if c["latency_ms"] is not None else math.inf))
        status = "not_met"
    takes = _what_it_would_take(fleets, memory, price, demand, cost_cfg, chosen, today_rate, capacity_frame)
    draws = traces(workload, seeds)
    floor = prefill_floor(step_model, draws, slo["ttft_percentile"])
    reason = _reason(status, chosen, floor, slo, takes)
    chosen_measured = _measured_memory(serving_memory, chosen["policy"], chosen["max_num_seqs"])
    options = [_option(c, slo, cost_cfg, price, label["measured"]) for c in candidates]
    return {
        "label": label,
        "status": status,
        "kv_memory": kv_memory,
        # each policy's cap search (cap_search), without its probes' rows (they are candidates above)
        "cap_searches": [{k: v for k, v in found.items() if k != "probes"} for found in searches],
        "targets": list(TARGETS),
        "chosen": chosen,
        "verdict": _verdict(chosen, slo, cost_cfg),
        "candidates": candidates,
        "options": sorted(options, key=_rank),
        "routes": _routes(step_model, draws, slo, candidates, price, demand),
        "offered_tokens_per_s": demand,
        "price_per_hour": price,
        "prefill_floor": floor,
        "reason": reason,
        "what_it_would_take": takes,
        "next_step": _next_step(status, reason, takes),
        "machine_speed": _speed(machine),
        # the measurement the chosen configuration's memory verdict read, if there is one
        "serving_memory": {"peak_rss_bytes": chosen_measured["bytes"], "basis": chosen_measured["basis"],
                           "policy": chosen["policy"], "max_num_seqs": chosen["max_num_seqs"],
                           "context_tokens": int(serving_memory["rows"][0]["context_tokens"])}
        if chosen_measured else None,
        "passed": [t for t in TARGETS if chosen[f"{t}_met"]],
        "missed": [t for t in TARGETS if not chosen[f"{t}_met"]],
    }


def cap_range(option: dict, options: list[dict], search: dict | None) -> dict | None:
    """The caps around a one-machine option (one of `options`, its machine's, in the decision's form)
    that meet all four targets: the cap search's range of caps meeting latency and capacity (from its
    smallest such cap up to the largest it found before a failure or the memory bound), narrowed to the
    run of judged caps meeting all four that holds the option's cap. The caps between two judged ones
    are claimed by verdicts the search checked for order (`monotone`); `judged` lists the caps behind
    the claim; `bound` says what ends it above: the memory bound (slots, or the paged pool) or a failing
    verdict. None for a fleet, an option missing a target, or a policy without a search."""
    if option["replicas"] != 1 or not option["meets_all"] or not search or search["smallest_cap"] is None:
        return None
    low, high = search["range"]
    judged = sorted((o["cap"], o["meets_all"]) for o in options
                    if o["replicas"] == 1 and o["policy"] == option["policy"] and low <= o["cap"] <= high)
    caps = [c for c, _ in judged]
    if option["cap"] not in caps:
        return {"low": option["cap"], "high": option["cap"], "judged": [option["cap"]],
                "monotone": search["monotone"], "bound": "verdict"}
    first = last = caps.index(option["cap"])
    while first > 0 and judged[first - 1][1]:
        first -= 1
    while last + 1 < len(judged) and judged[last + 1][1]:
        last += 1
    return {"low": caps[first], "high": caps[last], "judged": caps[first:last + 1], "monotone": search["monotone"],
            "bound": search["upper"]["bound"] if caps[last] == search["upper"]["cap"] else "verdict"}


def _defined(value) -> float | None:
    return None if value is None or pd.isna(value) else float(value)


def _judge_latency_capacity(row: dict, slo: dict) -> dict:
    """The latency and capacity verdicts of one configuration (latency_capacity_row), each on the
    pessimistic end of its interval: the slowest seed's TTFT percentile at today's rate (a queue that
    grows has none, and fails), the low end of the capacity interval."""
    stable = bool(row["stable_today"])
    worst_ms = (row["latency_ms_range"][1] if row["latency_ms_range"] else row["latency_ms"]) if stable else None
    row["latency_judged_ms"] = worst_ms
    row["latency_met"] = worst_ms is not None and worst_ms <= slo["ttft_ms"]
    lowest_rps = (row["capacity_interval"] or [row["capacity_rps"]])[0]
    row["capacity_judged_rps"] = lowest_rps
    row["capacity_target_met"] = not row["capacity_never_met"] and lowest_rps >= slo["capacity_target_rate"]
    row["capacity_met"] = row["capacity_target_met"]
    return row


def _judge(row: dict, slo: dict, cost_cfg: dict) -> dict:
    """The four verdicts of one configuration, each on the pessimistic end of its interval: latency and
    capacity (_judge_latency_capacity); memory by the machine's KV model (memory.memory_plan's `fits`:
    weights + the paged pool, or + cap slots of the longest context; a measured resident figure is
    reported beside it, not judged, as the target counts weights + KV only); the dearest end of the cost."""
    _judge_latency_capacity(row, slo)
    stable = bool(row["stable_today"])
    row["memory_met"] = bool(row["memory_fits"])
    row["cost_met"] = (stable and row["cost_per_1k_interval"] is not None
                       and row["cost_per_1k_interval"][1] <= cost_cfg["target_per_1k_tokens"])
    row["n_pass"] = sum(bool(row[f"{t}_met"]) for t in TARGETS)
    row["passes_all"] = row["n_pass"] == len(TARGETS)
    return row


def _option(row: dict, slo: dict, cost_cfg: dict, price: float, measured: bool) -> dict:
    """A judged configuration in the decision's form (contract 2 in the developers' notes, without the
    machine's name, which `decide` adds): four verdicts, each with the figure it read, its interval, the
    end of it the verdict judged (`judged`, the pessimistic one), the figure's basis and a note saying
    what the figure is; dollars per 1,000 tokens as an interval, and the machine's price per hour
    they were reckoned at. A configuration that does not keep
    up serves no defined share of the traffic: it has no latency percentile and no dollars (null), and
    both verdicts fail."""
    basis = "simulated" if measured else "estimated"
    stable = bool(row["stable_today"])
    pct = f"p{slo['ttft_percentile']:g}"
    latency_range = row["latency_ms_range"] or [None, None]
    capacity_range = row["capacity_interval"] or [None, None]
    dollars = (row["cost_per_1k_interval"] or [None, None]) if stable else [None, None]
    cost_value = row["cost_per_1k"] if stable else None
    measured_bytes = row["memory_measured_bytes"]
    if not stable:
        latency_note = f"unstable: the queue grows, so no {pct} TTFT exists"
    elif row["replicas"] > 1:
        searched = row.get("replicas_searched", row["replicas"])
        latency_note = (f"{pct} TTFT at today's rate in the simulation of {searched} replicas; "
                        f"judged on the slowest seed's")
    else:
        latency_note = f"{pct} TTFT at today's rate; judged on the slowest seed's"
    verdicts = {
        "latency": {"pass": row["latency_met"], "value": row["latency_ms"], "low": latency_range[0],
                    "high": latency_range[1], "judged": row["latency_judged_ms"], "target": float(slo["ttft_ms"]),
                    "unit": "ms", "basis": basis, "note": latency_note},
        "capacity": {"pass": row["capacity_met"], "value": row["capacity_rps"], "low": capacity_range[0],
                     "high": capacity_range[1], "judged": row["capacity_judged_rps"],
                     "target": float(slo["capacity_target_rate"]), "unit": "req/s", "basis": basis,
                     "note": (f"{row['replicas']} × one machine's interval; judged on its low end" if row["replicas"] > 1
                              else "interval over seeds" + (" and the measured speed band" if row.get(
                                  "capacity_with_speed_band") else "") + "; judged on its low end")},
        "memory": {"pass": row["memory_met"], "value": row["memory_bytes"], "low": None, "high": None,
                   "judged": row["memory_bytes"], "target": row["budget_bytes"], "unit": "bytes",
                   "basis": row["memory_kv_model"], "cap": row["max_num_seqs"],
                   "reserved_bytes": row["memory_reserved_bytes"], "used_peak_bytes": row["memory_used_peak_bytes"],
                   "pool_blocks": row["memory_pool_blocks"], "preemptions": row["preemptions_max"],
                   "runtime_bytes": row["memory_runtime_bytes"], "resident_bytes": measured_bytes,
                   "resident_basis": row["memory_measured_basis"],
                   "note": (f"weights + a paged pool of {row['memory_pool_blocks']} KV blocks, what the budget leaves"
                            + (" beside the measured runtime" if row["memory_runtime_bytes"] is not None else "")
                            + f"; the simulation's peak held {row['memory_used_peak_bytes'] / GB:.3g} GB and preempted "
                            f"{row['preemptions_max']} times at most")
                   if row["memory_kv_model"] == "paged" else
                   f"weights + {row['max_num_seqs']} slots of KV, each reserving the longest context"},
        "cost": {"pass": row["cost_met"], "value": cost_value, "low": dollars[0], "high": dollars[1],
                 "judged": dollars[1], "target": float(cost_cfg["target_per_1k_tokens"]),
                 "unit": "$ per 1,000 tokens", "basis": basis,
                 "note": "judged on the dear end" if stable else
                 "unstable: the queue grows, so no share of the traffic is served at a defined cost"},
    }
    misses = [t for t in TARGETS if not verdicts[t]["pass"]]
    return {"replicas": row["replicas"], "router": row["router"], "policy": row["policy"],
            "cap": row["max_num_seqs"], "searched": bool(row.get("searched")), "stable": stable, "verdicts": verdicts,
            "usd_per_1k": {"value": cost_value if cost_value is not None else dollars[1],
                           "low": dollars[0], "high": dollars[1]},
            "price_per_hour": float(price), "meets_all": not misses, "misses": misses,
            # the one-machine speed-up that would meet both latency targets: among options that miss as
            # much at no defined cost, the nearer one is the one needing the least (as `recommend` judges)
            "speedup_needed": row.get("speedup_needed")}


def _rank(option: dict) -> tuple:
    """The decision's order: options meeting all four targets first; then every option with a defined
    cost before any without (one that does not keep up); then the fewest targets missed; then the
    cheapest at the dear end of its dollars; then, meeting all four, the most capacity at the low end of its
    interval, or else the smallest speed-up needed; then the fewest replicas."""
    high = option["usd_per_1k"]["high"]
    speedup = option.get("speedup_needed")
    # among options meeting all four at the same dollars, the one with the most capacity at its low end
    # (the most headroom over the capacity target); among the others, the one needing the least speed-up
    nearer = (-(option["verdicts"]["capacity"]["judged"] or 0.0) if option["meets_all"]
              else math.inf if speedup is None else speedup)
    return (not option["meets_all"], high is None, len(option["misses"]), math.inf if high is None else high,
            nearer, option["replicas"], option.get("machine", ""), option["policy"], option["cap"], option["router"] or "")


def _as_interval(values: list[float], value: float) -> dict:
    return {"value": float(value), "low": float(min(values)), "high": float(max(values))}


def _routes(step_model: CostModel, draws, slo: dict, candidates: list[dict], price: float, demand: float) -> dict:
    """The two routes to the targets and their cheapest mix. The prefill speed-up: the factor by which
    prefill must shrink for the prompts alone to meet the TTFT percentile (no fleet lowers that floor),
    over the measured speed band. The replicas: the fewest machines that keep up with the capacity target
    rate, from the best configuration that fits memory (its stable rate's interval). The mix: every term
    sped up by the pessimistic prefill factor, then the fewest such machines that keep up (a model s times
    faster keeps up with exactly s times the rate: the simulation's time scales)."""
    ttft = float(slo["ttft_ms"])
    models = [step_model, *speed_band_models(step_model).values()]
    factors = [max(1.0, prefill_floor(model, draws, slo["ttft_percentile"])["floor_ms"] / ttft) for model in models]
    prefill = None if max(factors) <= 1.0 else _as_interval(factors, factors[0])
    fitting = [c for c in candidates if c["replicas"] == 1 and c["memory_met"] and c["keeps_up_rps"]
               and (c["keeps_up_interval"] or [c["keeps_up_rps"]])[0]]
    if not fitting:
        return {"prefill_speedup": prefill, "replicas_to_keep_up": None, "replicas_usd_per_1k": None,
                "cheapest_mix": None}
    best = max(fitting, key=lambda c: ((c["keeps_up_interval"] or [c["keeps_up_rps"]])[0], c["keeps_up_rps"]))
    rps = best["keeps_up_rps"]
    low, high = best["keeps_up_interval"] or [rps, rps]
    rate = float(slo["capacity_target_rate"])

    def machines(speedup: float, one_machine_rps: float) -> int:
        return math.ceil(rate / (speedup * one_machine_rps) - 1e-12)

    def dollars(counts: list[int]) -> dict:
        value, *ends = (money.cost_per_1k_tokens(price, n, demand) for n in counts)
        return _as_interval(ends, value)

    counts = [machines(1.0, rps), machines(1.0, high), machines(1.0, low)]
    speedup = prefill["high"] if prefill else 1.0
    mix = [machines(speedup, rps), machines(speedup, high), machines(speedup, low)]
    return {"prefill_speedup": prefill,
            "replicas_to_keep_up": _as_interval(counts[1:], counts[0]),
            "replicas_usd_per_1k": dollars(counts),
            "cheapest_mix": {"speedup": speedup, "replicas": mix[2], "usd_per_1k": dollars(mix)}}


# the ranked options the report's first screen shows: the pick (or the closest), each machine's best, then
# the next in the ranking up to this many rows; the rest are in results/plan/options.csv
TABLE_HEAD_ROWS = 12


def decide(recommendations: list[dict]) -> dict:
    """The one decision across machines from each machine's `recommend`: every option of every machine
    ranked (`_rank`: meeting all four targets first, then defined costs before the undefined of a
    configuration that does not keep up, then the fewest misses, then the cheapest at the dear end of
    its dollars, then the fewest replicas; each option gets its `rank`, from 1), the pick (the first,
    when it meets all four), else the closest (the first, with what it misses), one line per machine
    with its best option (the first of that machine in the same ranking), the ranks the report's table
    shows (`table_head`, in rank order, each with why it is shown: the pick or the closest, each machine's
    best, then the next in the ranking up to TABLE_HEAD_ROWS; `table_more`: how many it leaves to
    options.csv) and this machine's routes."""
    options = [{**rec["label"], **option} for rec in recommendations for option in rec["options"]]
    ranked = [{**option, "rank": n} for n, option in enumerate(sorted(options, key=_rank), start=1)]
    first = ranked[0] if ranked else None
    pick = first if first and first["meets_all"] else None
    closest = first if first and not first["meets_all"] else None
    machines = []
    for rec in recommendations:
        best = next((o for o in ranked if o["machine"] == rec["label"]["machine"]), None)
        searches = {found["policy"]: found for found in rec.get("cap_searches", [])}
        search = searches.get(best["policy"]) if best else None
        machines.append({**rec["label"], "best": best, "meets_all": bool(best and best["meets_all"]),
                         "misses": best["misses"] if best else list(TARGETS), "kv_memory": rec.get("kv_memory"),
                         "cap_range": cap_range(best, rec["options"], search) if best else None,
                         "cap_search": search})
    shown = {o["rank"] for o in (first, *(m["best"] for m in machines)) if o}
    for option in ranked:
        if len(shown) >= TABLE_HEAD_ROWS:
            break
        shown.add(option["rank"])
    head = [{"rank": rank, "index": rank - 1, "pick": bool(pick) and rank == pick["rank"], "closest": bool(closest) and rank == closest["rank"],
             "best_of": [m["display_name"] for m in machines if m["best"] and m["best"]["rank"] == rank]}
            for rank in sorted(shown)]
    here = next((rec for rec in recommendations if rec["label"]["machine"] == HERE), None)
    routes = here["routes"] if here else {"prefill_speedup": None, "replicas_to_keep_up": None,
                                          "replicas_usd_per_1k": None, "cheapest_mix": None}
    return {"pick": pick, "closest": closest, "options": ranked, "machines": machines, "routes": routes,
            "table_head": head, "table_more": len(ranked) - len(shown)}


def _gb(n_bytes: float | None) -> float | None:
    return None if n_bytes is None else n_bytes / GB


def options_table(decision: dict) -> pd.DataFrame:
    """Every ranked option of the decision as one row of results/plan/options.csv, with display names:
    the machine and whether its numbers are measured, the deployment, each verdict with its figure,
    interval, judged end and basis (memory in decimal GB), and dollars per 1,000 tokens as an interval."""
    # the report's one table of display names; imported here because the report package imports this module
    from servingplan.plan.names import display

    rows = []
    for option in decision["options"]:
        v = option["verdicts"]
        row = {"rank": option["rank"], "machine": option["display_name"],
               "numbers": "measured" if option["measured"] else "estimated", "replicas": option["replicas"],
               "router": display(option["router"]) if option["router"] else "",
               "policy": display(option["policy"]), "cap": option["cap"],
               "meets_all": option["meets_all"], "misses": " ".join(option["misses"]),
               "keeps_up": option["stable"]}
        for target, unit, scale in (("latency", "ms", None), ("capacity", "rps", None), ("memory", "gb", _gb),
                                    ("cost", "usd_per_1k", None)):
            verdict = v[target]
            convert = scale or (lambda x: x)
            row.update({f"{target}_verdict": "pass" if verdict["pass"] else "fail",
                        f"{target}_{unit}": convert(verdict["value"]),
                        # memory is one figure, measured or reserved: no interval
                        **({} if target == "memory" else {f"{target}_{unit}_low": convert(verdict["low"]),
                                                          f"{target}_{unit}_high": convert(verdict["high"])}),
                        f"{target}_{unit}_judged": convert(verdict["judged"]),
                        f"{target}_target_{unit}": convert(verdict["target"]),
                        f"{target}_basis": verdict["basis"], f"{target}_note": verdict["note"]})
        rows.append(row)
    return pd.DataFrame(rows)


def hardware_verdicts(targets: list[tuple[dict, dict, dict]]) -> dict:
    """Each target machine's carry-over and recommendation, from (its config entry, its carry_over.json,
    its recommendation), in the layout of results/plan/hardware_verdicts.json. `carry_over` states what
    the estimate assumes (the launch overhead of a GPU's model calls, its value and basis), the terms
    raised to the target's floor and what the estimate leaves out."""
    return {"targets": [
        {"name": target["name"], "description": target.get("description", ""),
         "bandwidth_gbs": target["bandwidth_gbs"], "gflops": target["gflops"],
         "price_per_hour": rec["price_per_hour"], "price_given": target.get("price_per_hour") is not None,
         "here": carried["here"], "terms": carried["terms"],
         "carry_over": {**hardware.carry_over_notes(target, carried["terms"]),
                        "launch_overhead_configured": target.get("launch_overhead_ms") is not None,
                        "clamped": _clamped(carried["terms"])},
         "recommendation": rec}
        for target, carried, rec in targets]}


def _clamped(rows: list[dict]) -> list[dict]:
    """The carried-over terms raised to the target's floor, one entry per term and floor (the decode
    table's batches together), with the floor's range in seconds."""
    groups: dict[tuple, dict] = {}
    for row in rows:
        if row["clamped"]:
            group = groups.setdefault((row["term"], row["clamped_to"]),
                                      {"term": row["term"], "clamped_to": row["clamped_to"], "batches": [], "floors": []})
            if row["batch"] is not None:
                group["batches"].append(int(row["batch"]))
            group["floors"].append(float(row["floor_target_s"]))
    return [{"term": g["term"], "clamped_to": g["clamped_to"], "batches": g["batches"],
             "floor_s": [min(g["floors"]), max(g["floors"])]} for g in groups.values()]


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
    fits = set(map(tuple, memory[memory["fits"].astype(bool)][["policy", "max_num_seqs"]].itertuples(index=False)))
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
    router whose slowest seed has the lowest TTFT at today's rate."""
    if any(found["feasible"] for found in cell["fleets"].values()):
        return None
    tried = [{"router": router, "replicas": found["max_replicas"], **found["at_max"]}
             for router, found in sorted(cell["fleets"].items())]
    return min(tried, key=lambda f: (f["today"]["ttft_ms_range"] is None, (f["today"]["ttft_ms_range"] or [0.0, 0.0])[1]))


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


def _verdict(chosen: dict, slo: dict, cost_cfg: dict) -> list[dict]:
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
         "kv_model": chosen["memory_kv_model"], "used_peak_bytes": chosen["memory_used_peak_bytes"],
         "measured_bytes": chosen["memory_measured_bytes"],
         "measured_cap": chosen["max_num_seqs"] if chosen["memory_measured_bytes"] is not None else None,
         "measured_basis": chosen["memory_measured_basis"],
         "passed": chosen["memory_met"]},
        {"target": "cost", "goal_per_1k": cost_cfg["target_per_1k_tokens"], "achieved": chosen["cost_per_1k"],
         "unstable": unstable, "passed": chosen["cost_met"]},
    ]
