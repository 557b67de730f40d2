"""How far the carry-over to another machine can be trusted, measured in the run: the step-time model
fitted at the profile's threads is carried by the roofline (servingplan.hardware.carry_over, the same
method every `hardware:` target's estimate uses) to "this machine at 1 thread", whose roofline is a
1-thread profile's own peak probes; then every (policy, cap) cell's capacity, searched as the capacity
stage searches it (servingplan.searches.capacity_cell), is compared with the capacity of the model
fitted to that 1-thread profile. The truth of this one target is measurable here, which no other
target's is.

The errors are estimate / measured - 1 per (criterion, cell): negative, the estimate is pessimistic
(it expects less capacity than the machine has). GOAL is issue 18's: every cell within +-15%.
"""
from __future__ import annotations

import numpy as np

from servingplan import architecture, hardware
from servingplan.costmodel import CostModel
from servingplan.searches import capacity_cell

GOAL = 0.15
CRITERIA = ("ttft_slo", "stable")
ONE_THREAD = {"name": "this machine at 1 thread", "kind": "cpu"}


def _capacities(cost: CostModel, machine: dict, policy: str, cap: int, settings: dict) -> dict:
    cell = capacity_cell(cost, machine, policy, cap, settings["workload"], settings["slo"], settings["sweep"],
                         settings["memory"], settings["seeds"], settings["capacity"], criteria=CRITERIA)
    return {name: cell[name]["capacity_rps"] for name in CRITERIA}


def check(cost_here: CostModel, machine_here: dict, cost_one: CostModel, machine_one: dict, model: dict,
          settings: dict) -> dict:
    """The check's result (results/check/carry_over_check.json): the two rooflines, one row per
    (criterion, policy, cap) with the measured and carried capacities and their error (null where
    either has no capacity), and the summary the report quotes. `settings` holds the config sections
    the capacity search reads (workload, slo, sweep, memory, capacity) and the simulation seeds."""
    here = hardware.here_roofline(machine_here)
    target = {**hardware.here_roofline(machine_one), **ONE_THREAD}
    carried, terms = hardware.carry_over(cost_here, architecture.architecture(model), here, target)
    rows = []
    for policy in settings["sweep"]["policies"]:
        for cap in settings["sweep"]["caps"]:
            measured = _capacities(cost_one, machine_one, policy, int(cap), settings)
            estimated = _capacities(carried, machine_one, policy, int(cap), settings)
            for name in CRITERIA:
                known = bool(measured[name]) and estimated[name] is not None
                rows.append({"criterion": name, "policy": policy, "cap": int(cap),
                             "measured_rps": measured[name], "estimated_rps": estimated[name],
                             "error": estimated[name] / measured[name] - 1.0 if known else None})
    return {"goal": GOAL, "threads_here": int(machine_here["machine"]["threads"]),
            "threads_target": int(machine_one["machine"]["threads"]),
            "roofline_here": {k: here[k] for k in ("bandwidth_gbs", "gflops")},
            "roofline_target": {k: target[k] for k in ("bandwidth_gbs", "gflops")},
            "clamped_terms": [row["term"] for row in terms if row["clamped"]],
            "rows": rows, "summary": summarize(rows)}


def summarize(rows: list[dict]) -> dict | None:
    """Cells compared, how many within the goal, the median and largest |error| (signed: the largest),
    and the direction: pessimistic when every error is negative, optimistic when every one is positive,
    else mixed. None when no cell has both capacities."""
    errors = [row["error"] for row in rows if row["error"] is not None]
    if not errors:
        return None
    largest = max(errors, key=abs)
    direction = ("pessimistic" if all(e < 0 for e in errors) else
                 "optimistic" if all(e > 0 for e in errors) else "mixed")
    return {"cells": len(errors), "within_goal": sum(abs(e) <= GOAL for e in errors),
            "median_abs_error": float(np.median(np.abs(errors))), "largest_error": float(largest),
            "direction": direction, "uncompared": len(rows) - len(errors)}
