"""How far the carry-over to another machine can be trusted, measured in the run: the step-time model
fitted at the profile's threads is carried by the roofline (servingplan.plan.hardware.carry_over, the same
method every `hardware:` target's estimate uses) to "this machine at 1 thread", whose roofline is a
1-thread profile's own peak probes; then every (policy, cap) cell's capacity, searched as the capacity
stage searches it (servingplan.simulate.searches.capacity_cell), is compared with the capacity of the model
fitted to that 1-thread profile. The truth of this one target is measurable here, which no other
target's is.

The errors are estimate / measured - 1 per (criterion, cell): negative, the estimate is pessimistic
(it expects less capacity than the machine has). GOAL is issue 18's: every cell within +-15%.

Why a cell misses shows in the calls it is made of (`calls`): a decode step at each batch size and a
prefill of a short and a long prompt, each timed by the model fitted here, the carried-over model and
the 1-thread model. The carried call's ratio to this machine's is what the carry-over assumed (a CPU
target's rule: the floors scaled by the probes, the time above them kept); the 1-thread model's ratio is
what the machine did. Calls, not terms, are compared: the two fits may pick
different model forms (a per-batch table or the line, a squared prefill term or none), so one term
alone need not mean the same thing in both.
"""
from __future__ import annotations

import math

import numpy as np

from servingplan import architecture
from servingplan.costmodel import CostModel
from servingplan.memory import SIM_MEMORY_KEYS
from servingplan.pipeline import config_keys
from servingplan.plan import hardware
from servingplan.profile.grid import ragged_contexts
from servingplan.seeds import simulation_seeds
from servingplan.simulate.searches import capacity_cell

GOAL = 0.15
# a window's ratio is applied when it departs from one by more than this many standard errors; a median's
# standard error is sqrt(pi / 2) (about 1.25) times the mean's, sigma / sqrt(n)
WINDOW_SIGMAS = 2.0
MEDIAN_EFFICIENCY = math.sqrt(math.pi / 2)
# what the profile's window readings and the 1-thread profile's speed trace must share to be compared
WINDOW_KEYS = ("threads", "reference_decode", "reference_prefill", "warmup", "repeats")
CRITERIA = ("ttft_slo", "stable")
# The calls compared (see the module docstring): decode steps at the context of the profile's decode
# reference, at the batch sizes the capacity cells run, and prefills of a short and the longest prompt.
CALL_CONTEXT = 256
CALL_BATCHES = (1, 2, 4, 8, 16, 32)
CALL_PROMPTS = (64, 512)
ONE_THREAD = {"name": "this machine at 1 thread", "kind": "cpu"}


def _capacities(cost: CostModel, machine: dict, policy: str, cap: int, settings: dict) -> dict:
    cell = capacity_cell(cost, machine, policy, cap, settings["workload"], settings["slo"], settings["sweep"],
                         settings["memory"], settings["seeds"], settings["capacity"], criteria=CRITERIA)
    return {name: cell[name]["capacity_rps"] for name in CRITERIA}


def settings_of(config: dict) -> dict:
    """The settings `check` reads, from a whole config: the sections rule carry_over_check passes as its
    params (rules/check.smk), with this machine's KV model in the memory section, for a caller outside the
    pipeline (the benchmarks)."""
    return {"workload": config_keys(config["workload"]), "slo": config_keys(config["slo"]),
            "sweep": config_keys(config["sweep"], drop=("chunk_sizes", "rates")),
            "memory": config_keys(hardware.memory_for(config, hardware.HERE), keep=SIM_MEMORY_KEYS),
            "capacity": config_keys(config["capacity"]), "seeds": simulation_seeds(config)}


def check(cost_here: CostModel, machine_here: dict, cost_one: CostModel, machine_one: dict, model: dict,
          settings: dict) -> dict:
    """The check's result (results/check/carry_over_check.json): the two rooflines, one row per
    (criterion, policy, cap) with the measured and carried capacities and their error (null where
    either has no capacity), and the summary the report quotes. `settings` holds the config sections
    the capacity search reads (workload, slo, sweep, memory, capacity) and the simulation seeds."""
    here = hardware.here_roofline(machine_here)
    target = {**hardware.here_roofline(machine_one), **ONE_THREAD}
    carried, terms = hardware.carry_over(cost_here, architecture.architecture(model), here, target)
    window = window_correction(machine_here, machine_one, cost_one)
    truth = (cost_one.slowed(window["decode"]["applied"], window["prefill"]["applied"], name=cost_one.name)
             if window["corrected"] else cost_one)
    calls = compare_calls(cost_here, carried, truth)
    rows = []
    for policy in settings["sweep"]["policies"]:
        for cap in settings["sweep"]["caps"]:
            measured = _capacities(truth, machine_one, policy, int(cap), settings)
            estimated = _capacities(carried, machine_one, policy, int(cap), settings)
            as_run = measured if truth is cost_one else _capacities(cost_one, machine_one, policy, int(cap), settings)
            for name in CRITERIA:
                rows.append({"criterion": name, "policy": policy, "cap": int(cap),
                             "measured_rps": measured[name], "estimated_rps": estimated[name],
                             "error": _error(estimated[name], measured[name]),
                             "measured_as_run_rps": as_run[name], "error_as_run": _error(estimated[name], as_run[name])})
    return {"goal": GOAL, "threads_here": int(machine_here["machine"]["threads"]), "window": window,
            "summary_as_run": summarize(rows, "error_as_run"),
            "calls": calls, "worst_call": max(calls, key=lambda row: abs(row["error"])),
            "threads_target": int(machine_one["machine"]["threads"]),
            "roofline_here": {k: here[k] for k in ("bandwidth_gbs", "gflops")},
            "roofline_target": {k: target[k] for k in ("bandwidth_gbs", "gflops")},
            "clamped_terms": [row["term"] for row in terms if row["clamped"]],
            "rows": rows, "summary": summarize(rows),
            # how well the 1-thread model, the truth here, predicts its own held-out points
            "truth_fit": {key: cost_one.meta.get(key) for key in ("heldout_mape", "mape_goal", "goal_met")}}


def _error(estimated: float | None, measured: float | None) -> float | None:
    return estimated / measured - 1.0 if measured and estimated is not None else None


def window_correction(machine_here: dict, machine_one: dict, cost_one: CostModel) -> dict:
    """By how much the 1-thread model runs slower than the machine did at 1 thread in the profile's window,
    per reference kind, and the factor the model is multiplied by to bring it to that window.

    The profile read the check's reference shapes at 1 thread in its own window (machine.json
    `check_references`, servingplan.profile.measure.WindowReadings), with the estimator the 1-thread
    profile times its calls with (WINDOW_KEYS must match). A kind's ratio is the 1-thread model's time
    for that shape over the window's median reading: the model, not the 1-thread profile's own reference
    readings, since the model is what the check compares, and those readings can run slow while its
    calls do not (docs/benchmarks.md). A kind's factor is applied only where its ratio departs from one
    by more than WINDOW_SIGMAS standard errors of the window's median, so a model that agrees with the
    window within the readings' noise stands as measured."""
    readings = machine_here.get("check_references")
    if readings and any(readings[key] != machine_one["settings"].get(key) for key in WINDOW_KEYS):
        readings = None
    result = {"read": bool(readings), "readings": len({row["label"] for row in readings["readings"]}) if readings else 0}
    model_s = {}
    if readings:
        batch, context = readings["reference_decode"]
        model_s = {"decode": cost_one.decode_time(batch, sum(ragged_contexts(batch, context)), context),
                   "prefill": cost_one.prefill_time(int(readings["reference_prefill"]))}
    for kind in ("decode", "prefill"):
        if kind not in model_s or kind not in readings["by_kind"]:
            result[kind] = {"ratio": None, "standard_error": None, "applied": 1.0}
            continue
        window = readings["by_kind"][kind]
        ratio = model_s[kind] / window["median_s"]
        error = MEDIAN_EFFICIENCY * window["log_sigma"] / math.sqrt(window["n"])
        result[kind] = {"ratio": ratio, "window_s": window["median_s"],
                        "model_s": model_s[kind], "standard_error": error,
                        "applied": 1.0 / ratio if abs(math.log(ratio)) > WINDOW_SIGMAS * error else 1.0}
    # the kinds whose factor was applied (the report names them), and the rule's threshold it states
    result["corrected"] = [kind for kind in ("decode", "prefill") if result[kind]["applied"] != 1.0]
    result["sigmas"] = WINDOW_SIGMAS
    return result


def call_times(cost: CostModel) -> list[tuple[str, int, float]]:
    """(kind, size, seconds) of each compared call under `cost`: decode steps by batch (every sequence at
    CALL_CONTEXT cached tokens), prefills by prompt length."""
    decode = [("decode", batch, cost.decode_time(batch, batch * CALL_CONTEXT, CALL_CONTEXT)) for batch in CALL_BATCHES]
    return decode + [("prefill", tokens, cost.prefill_time(tokens)) for tokens in CALL_PROMPTS]


def compare_calls(cost_here: CostModel, carried: CostModel, cost_one: CostModel) -> list[dict]:
    """One row per compared call: its time here, carried over and measured at 1 thread, the ratio the
    carry-over assumed (carried / here), the ratio measured (1 thread / here) and the carried call's
    error (carried / measured - 1)."""
    rows = []
    for (kind, size, here), (_, _, estimated), (_, _, measured) in zip(call_times(cost_here), call_times(carried),
                                                                    call_times(cost_one)):
        rows.append({"kind": kind, "size": size, "context": CALL_CONTEXT if kind == "decode" else 0,
                     "seconds_here": here, "seconds_estimated": estimated, "seconds_measured": measured,
                     "ratio_assumed": estimated / here, "ratio_measured": measured / here,
                     "error": estimated / measured - 1.0})
    return rows


def summarize(rows: list[dict], key: str = "error") -> dict | None:
    """Cells compared, how many within the goal, the median and largest |error| (signed: the largest),
    and the direction: pessimistic when every error is negative, optimistic when every one is positive,
    else mixed; of each row's `key`. None when no cell has both capacities."""
    errors = [row[key] for row in rows if row[key] is not None]
    if not errors:
        return None
    largest = max(errors, key=abs)
    direction = ("pessimistic" if all(e < 0 for e in errors) else
                 "optimistic" if all(e > 0 for e in errors) else "mixed")
    return {"cells": len(errors), "within_goal": sum(abs(e) <= GOAL for e in errors),
            "median_abs_error": float(np.median(np.abs(errors))), "largest_error": float(largest),
            "direction": direction, "uncompared": len(rows) - len(errors)}
