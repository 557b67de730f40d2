"""The GPU check's comparisons: the CPU model carried over to the GPU's entry against the model measured
on the GPU, and the capstone's figures on each. Pure arithmetic and simulation, no device: the tests
check it on hand-made models.

Every error is carried / measured - 1, as the 1-thread check's (servingplan.check.carry_check): for a time
(a term, a decode batch's f(B), a call) negative means the estimate expects it faster than the GPU ran
it (optimistic); for a capacity, negative means the estimate expects less capacity (pessimistic).

    term_rows(measured, carried, probed, fit_physical)        one row per cost-model term
    decode_batch_rows(measured, carried, probed, batches)     one row per decode batch: f(B)
    call_rows(cpu, carried, measured)                         carry_check's calls: decode steps, prefills
    capstone_cells(cost, machine, memory, settings, cells)    p90 TTFT at today's rate, capacity at the SLO
    capstone_rows(measured, carried)                          the two side by side, with their errors
"""
from __future__ import annotations

from servingplan import roofline
from servingplan.check import carry_check
from servingplan.costmodel import CostModel
from servingplan.plan.planner import sweep_cell
from servingplan.seeds import figures_over_seeds
from servingplan.simulate.searches import capacity_cell

# the capacity criterion the capstone states (ttft p90 within slo.ttft_ms)
CAPSTONE_CRITERION = "ttft_slo"


def relative_error(estimated: float | None, measured: float | None) -> float | None:
    """estimated / measured - 1, or None where either is missing or the measurement is zero."""
    if estimated is None or measured is None or measured == 0:
        return None
    return estimated / measured - 1.0


def term_rows(measured: CostModel, carried: CostModel, probed: CostModel | None, fit_physical: dict) -> list[dict]:
    """Each fitted term of the GPU's model beside the CPU model carried over to the GPU's entry (and,
    when given, to the rates and host time the GPU measured: `probed`), with the errors; `fit_physical` is
    the GPU fit's report `physical` (each term's floor and whether the bound holds it there: a term held
    at its floor was not resolved by the profile, only bounded)."""
    rows = []
    for term in roofline.TERMS:
        value, estimate = getattr(measured, term), getattr(carried, term)
        reading = fit_physical.get(term, {})
        row = {"term": term, "measured_s": value, "carried_s": estimate, "error": relative_error(estimate, value),
               "measured_at_floor": reading.get("at_floor"), "floor_s": reading.get("floor")}
        if probed is not None:
            row.update(probed_s=getattr(probed, term), probed_error=relative_error(getattr(probed, term), value))
        rows.append(row)
    return rows


def decode_batch_rows(measured: CostModel, carried: CostModel, probed: CostModel | None, batches) -> list[dict]:
    """f(B), the batch part of a decode step, of each model at each of `batches` (the GPU profile's):
    its table value where it has one, else its line or the interpolation between table values
    (CostModel.decode_batch_time), so two fits with different forms compare at the same batches."""
    rows = []
    for batch in sorted({int(b) for b in batches}):
        value, estimate = measured.decode_batch_time(batch), carried.decode_batch_time(batch)
        row = {"batch": batch, "measured_s": value, "carried_s": estimate, "error": relative_error(estimate, value)}
        if probed is not None:
            probed_s = probed.decode_batch_time(batch)
            row.update(probed_s=probed_s, probed_error=relative_error(probed_s, value))
        rows.append(row)
    return rows


def call_rows(cpu: CostModel, carried: CostModel, measured: CostModel) -> list[dict]:
    """The 1-thread check's calls (decode steps at batches 1 to 32, prefills of 64 and 512 tokens) on the
    CPU model, carried over and measured on the GPU: carry_check.compare_calls, whose `error` is the
    carried call's against the GPU's."""
    return carry_check.compare_calls(cpu, carried, measured)


def capstone_cells(cost: CostModel, machine: dict, memory: dict, settings: dict, cells) -> list[dict]:
    """Per (policy, cap) of `cells`, on `cost`: the TTFT percentile at today's rate (workload.rate: the mean
    over seeds and the seeds' range; None when a seed's queue does not keep up) as the latency sweep
    computes it (planner.sweep_cell), and the capacity at the TTFT target with its interval over seeds and
    speed band, as the capacity stage searches it (searches.capacity_cell). `settings` holds the config
    sections both read (workload, slo, sweep, capacity) and the simulation seeds; `memory` is the memory
    section with the KV model the machine is planned with."""
    workload, slo, sweep = settings["workload"], settings["slo"], settings["sweep"]
    today = float(workload["rate"])
    percentile = f"ttft_ms_p{slo['ttft_percentile']:g}"
    out = []
    for policy, cap in cells:
        latency = sweep_cell(cost, machine, policy, cap, workload, slo, sweep, memory, settings["seeds"], rates=[today])
        figures = figures_over_seeds(latency[percentile].tolist(), bool(latency["stable"].all()), spread=True)
        found = capacity_cell(cost, machine, policy, cap, workload, slo, sweep, memory, settings["seeds"],
                              settings["capacity"], criteria=(CAPSTONE_CRITERION,))[CAPSTONE_CRITERION]
        out.append({"policy": policy, "cap": int(cap), "rate": today, "stable": figures is not None,
                    "ttft_ms": figures["mean"] if figures else None,
                    "ttft_ms_range": [figures["min"], figures["max"]] if figures else None,
                    "capacity_rps": found["capacity_rps"], "capacity_interval_rps": found["interval_rps"],
                    "never_met": found["never_met"]})
    return out


def capstone_rows(measured: list[dict], carried: list[dict]) -> list[dict]:
    """The capstone's figures of each cell on the GPU's model and on the carried one, with the errors of
    the carried: its TTFT percentile's (None where either queue does not keep up) and its capacity's
    (None where the measured model never meets the target)."""
    rows = []
    for mine, theirs in zip(measured, carried):
        if (mine["policy"], mine["cap"]) != (theirs["policy"], theirs["cap"]):
            raise ValueError(f"capstone_rows: cell {mine['policy']} cap {mine['cap']} set against "
                             f"{theirs['policy']} cap {theirs['cap']}")
        rows.append({"policy": mine["policy"], "cap": mine["cap"], "rate": mine["rate"],
                     "measured": mine, "carried": theirs,
                     "ttft_error": relative_error(theirs["ttft_ms"], mine["ttft_ms"]),
                     "capacity_error": relative_error(theirs["capacity_rps"], mine["capacity_rps"])})
    return rows


# carry_check.summarize names a direction for capacities (all errors negative: pessimistic); an estimate
# of a time that is short of the measured one is the optimistic one
TIME_DIRECTION = {"pessimistic": "optimistic", "optimistic": "pessimistic", "mixed": "mixed"}


def error_summary(rows: list[dict], key: str = "error", of: str = "capacity") -> dict | None:
    """carry_check.summarize over the rows' `key` errors (None where a row has none): how many within
    its goal, the median and largest |error|, and the direction, for `of` "capacity" or "time" (whose
    direction is the reverse: a time estimated short of the measured one is optimistic)."""
    summary = carry_check.summarize([{"error": row[key]} for row in rows])
    if summary is not None and of == "time":
        summary["direction"] = TIME_DIRECTION[summary["direction"]]
    return summary
