"""The cap search: on one machine and policy, the caps between and beyond the sweep grid's that meet the
latency and capacity targets, so that the decision judges the cheapest cap the models support and not
only the grid's points.

It reads the grid's verdicts (the collected latency and capacity tables, judged as the decision judges
them: planner.latency_capacity_row) and simulates only the caps it must, each the way a grid cell is
simulated (its latency at today's rate over the seeds, planner.sweep_cell; its capacity under the TTFT
SLO and bare stability, searches.capacity_cell), on the KV pool the machine's KV model gives that cap:
1. the largest cap memory allows (memory.largest_cap_in_memory): slots of the longest context beside
   the weights, or, for a paged pool, the cap above which the pool binds first;
2. if a cap up to there meets both targets, the smallest that does, by bisection between the largest
   cap known to fail below the smallest known to pass (capacity.int_bisect), and the cap after it: the
   verdicts are not assumed monotone in the cap, and every judged cap that breaks the order is named.
"""
from __future__ import annotations

import pandas as pd

from servingplan.memory import kv_blocks, largest_cap_in_memory
from servingplan.plan.planner import (_judge_latency_capacity, capacity_rows, latency_capacity_row, sweep_cell,
                                      today_cells, traces)
from servingplan.simulate.capacity import int_bisect
from servingplan.simulate.searches import capacity_cell

# what a searched cap's capacity is judged on (the decision reads these two; the grid's third, joint
# attainment, feeds only the report's figures)
SEARCH_CRITERIA = ("ttft_slo", "stable")


def cap_search(step_model, machine: dict, policy: str, workload: dict, slo: dict, sweep: dict, memory: dict,
               seeds: list[int], capacity: dict, latency_grid: pd.DataFrame, capacity_grid: pd.DataFrame,
               runtime_bytes: float | None = None) -> dict:
    """The search's result (results/machines/{machine}/search/{policy}.json): the memory bound
    (`upper`), every judged cap with its verdict and source (the grid or a probe), the smallest cap
    meeting latency and capacity (None when none up to the bound does), the range of caps meeting both
    from it, whether the judged verdicts are monotone in the cap (and which caps are not), and the
    probes' rows in the grid tables' layout (the decision judges them with the grid's)."""
    draws = traces(workload, seeds)
    shortest = int(min(t.prompt_tokens.min() for t in draws))
    upper = largest_cap_in_memory(machine, memory, shortest, runtime_bytes)
    grid_latency = latency_grid[latency_grid["policy"] == policy]
    grid_capacity = capacity_grid[capacity_grid["policy"] == policy]
    judged: dict[int, dict] = {}
    probes: list[dict] = []

    def verdict(latency: pd.DataFrame, capacity_frame: pd.DataFrame, cap: int) -> dict:
        cell = today_cells(latency[latency["max_num_seqs"] == cap], workload).iloc[0].to_dict()
        row = _judge_latency_capacity(latency_capacity_row(cell, capacity_frame, slo), slo)
        return {"cap": cap, "latency_met": bool(row["latency_met"]), "capacity_met": bool(row["capacity_met"]),
                "met": bool(row["latency_met"] and row["capacity_met"]),
                "latency_judged_ms": row["latency_judged_ms"], "capacity_judged_rps": row["capacity_judged_rps"]}

    for cap in sorted({int(c) for c in grid_latency["max_num_seqs"]}):
        if cap <= upper["cap"]:
            judged[cap] = {**verdict(grid_latency, grid_capacity, cap), "source": "grid"}

    def met(cap: int) -> bool:
        if cap not in judged:
            latency = sweep_cell(step_model, machine, policy, cap, workload, slo, sweep, memory, seeds,
                                 runtime_bytes, rates=[float(workload["rate"])])
            cell = capacity_cell(step_model, machine, policy, cap, workload, slo, sweep, memory, seeds, capacity,
                                 criteria=SEARCH_CRITERIA, runtime_bytes=runtime_bytes)
            capacity_frame = pd.DataFrame(list(capacity_rows(cell)))
            judged[cap] = {**verdict(latency, capacity_frame, cap), "source": "search"}
            probes.append({"cap": cap, "kv_blocks": kv_blocks(machine, memory, cap, runtime_bytes),
                           "latency_rows": _records(latency), "capacity_rows": _records(capacity_frame)})
        return judged[cap]["met"]

    smallest = None
    if upper["cap"] >= 1:
        met(upper["cap"])
        passing = sorted(c for c, v in judged.items() if v["met"])
        if passing:
            failing_below = [c for c, v in judged.items() if not v["met"] and c < passing[0]]
            # cap 0 serves nothing: the bisection's known failure when no judged cap below fails
            _, smallest = int_bisect(lambda cap: not met(cap), max(failing_below, default=0),
                                     passing[0])
            if smallest + 1 <= upper["cap"]:
                met(smallest + 1)
    out_of_order = sorted(c for c, v in judged.items() if smallest is not None and (
        (c < smallest and v["met"]) or (c > smallest and not v["met"])))
    if smallest is None:
        found_range = None
    else:
        fails_above = [c for c, v in judged.items() if c > smallest and not v["met"]]
        below_failure = min(fails_above) if fails_above else upper["cap"] + 1
        found_range = [smallest, max(c for c, v in judged.items() if v["met"] and smallest <= c < below_failure)]
    return {"policy": policy, "kv_memory": memory["kv_memory"], "upper": upper, "smallest_cap": smallest,
            "range": found_range, "monotone": not out_of_order, "out_of_order": out_of_order,
            "judged": [judged[c] for c in sorted(judged)], "simulated_caps": [p["cap"] for p in probes],
            "probes": probes}


def _records(frame: pd.DataFrame) -> list[dict]:
    """A table's rows for JSON: an undefined figure (NaN) is null."""
    return frame.astype(object).where(frame.notna(), None).to_dict(orient="records")
