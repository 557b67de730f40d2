"""Render the capstone report from the files of one pipeline run.

    write_report(inputs, config, config_hash, machine_fingerprint, html_path, md_path, provenance_path,
                 log_dir) -> None

`inputs` maps the report rule's input names (machine, profile, fit_report, ...) to paths, or to lists
of paths (fleet: the planner's fleet cells); the three validation files, the serving memory
(results/validation/serving_memory.json), the fleet cells and the cross-machine decision
(results/plan/decision.json, whose pick opens the first screen) are optional. A run whose cost model was imported (config `costmodel.source` a file) has no profile, fit
or validation: its `machine` is the sizes derived from the architecture (`measured: false`), and the
report says where the cost model came from instead. Every number the report shows is read from those
files or from the run's config; every comparison and pick among them is the planner's (results/plan/
findings.json, servingplan/report/findings.py), this module only formats. The one exception is the capstone
source's own workload figures (config `reference`), the reference the calibration is checked against.
Each section is declared once (reports/templates/report.sections.j2) as blocks that
servingplan/report/blocks.py draws in HTML and in Markdown; the words are in report.text.j2, which
holds wording and the conditionals that choose it, never arithmetic.

The HTML is self-contained (figures as base64 PNG, inline CSS and JS) and lets the reader change
the price per hour; the Markdown links PNG files written beside it. Both are byte-identical for
the same inputs except the provenance date and wall time.
"""
from __future__ import annotations

import base64
import datetime as dt
import hashlib
import math
import os
import platform
import re
import subprocess
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Mapping

import jinja2
from markupsafe import Markup
import numpy as np
import pandas as pd

from servingplan.config import HERE, carry_over_check_skipped, costmodel_source
from servingplan.costmodel import DECODE_KEYS, PREFILL_KEYS, CostModel
from servingplan.io import atomic_path, read_json, write_json, write_text
from servingplan.pipeline import stage_times
from servingplan.plan import money
from servingplan.plan import names
from servingplan.plan.gpu_evidence import read_check
from servingplan.report import blocks, figures
from servingplan.report import measurement
from servingplan.report.findings import sweep_seeds, workload_traces
from servingplan.report.outline import OUTLINE
from servingplan.simulate import policies
from servingplan.simulate.workload import expected_length

TEMPLATE_DIR = Path(__file__).resolve().parents[2] / "reports" / "templates"
REPO_DIR = Path(__file__).resolve().parents[2]
HTML_TEMPLATE = "report.html.j2"
MD_TEMPLATE = "report.md.j2"
FIGURE_DIR_NAME = "figures"
MAX_DECIMALS = 6
REQUIRED_INPUTS = ("machine", "costmodel", "latency", "capacity", "memory", "memory_summary", "recommendation", "findings",
                   "exercise2", "ex2_caps", "ex2_chunks", "ex2_curve")
# what a run that profiled this machine has besides; an imported cost model has none of them
PROFILE_INPUTS = ("profile", "fit_report", "predicted")
VALIDATION_INPUTS = ("validation", "validation_requests", "validation_meta")
# Exercise 2's two readings of the source's curve, in the order the report shows them
EX2_READINGS = ("per_kv_token", "per_sequence")

# What the capstone's source document states about its workload. They are the reference the run's
# calibration is checked against, not results, so they cannot come from the run itself.
@dataclass(frozen=True)
class Validation:
    comparison: pd.DataFrame
    requests: pd.DataFrame
    meta: dict


@dataclass(frozen=True)
class RunResults:
    machine: dict
    profile: pd.DataFrame | None
    fit_report: dict | None
    predicted: pd.DataFrame | None
    cost_model: CostModel
    latency: pd.DataFrame
    capacity: pd.DataFrame
    memory: pd.DataFrame
    memory_summary: dict
    recommendation: dict
    exercise2: dict
    ex2_caps: pd.DataFrame
    ex2_chunks: pd.DataFrame
    ex2_curve: pd.DataFrame
    validation: Validation | None
    fleet_cells: list[dict]
    findings: dict
    decision: dict | None = None
    chunks: pd.DataFrame | None = None
    hardware: dict | None = None
    workload: dict | None = None
    serving_memory: dict | None = None
    # the simulated requests outside the cost model's profiled range (results/plan/coverage.json)
    coverage: dict | None = None
    # how far the targets' estimates can be trusted, measured in the run (results/check/carry_over_check.json)
    carry_over_check: dict | None = None
    # the GPU targets' estimates checked on a real GPU (config gpu_check: servingplan/gpu_check)
    gpu_check: dict | None = None
    # the two engines compared, when llama.cpp ran too (results/llamacpp/engines.json)
    engines: dict | None = None

    @property
    def measured(self) -> bool:
        """Whether this machine was profiled; False when the cost model was imported."""
        return self.machine.get("measured", True)


def load_results(inputs: Mapping) -> RunResults:
    missing = [key for key in REQUIRED_INPUTS if not inputs.get(key)]
    machine = read_json(inputs["machine"]) if not missing else {}
    if machine.get("measured", True):
        missing += [key for key in PROFILE_INPUTS if not inputs.get(key)]
    if missing:
        raise ValueError(f"report: inputs missing: {', '.join(missing)}")
    csv = lambda key: pd.read_csv(inputs[key]) if inputs.get(key) else None  # noqa: E731
    validation = None
    if all(inputs.get(key) and Path(inputs[key]).is_file() for key in VALIDATION_INPUTS):
        meta = read_json(inputs["validation_meta"])
        if meta.get("headline", {}).get("evaluated"):
            validation = Validation(csv("validation"), csv("validation_requests"), meta)
    return RunResults(
        machine=machine, profile=csv("profile"),
        fit_report=read_json(inputs["fit_report"]) if inputs.get("fit_report") else None,
        predicted=csv("predicted"), cost_model=CostModel.from_dict(read_json(inputs["costmodel"])),
        latency=csv("latency"), capacity=csv("capacity"), memory=csv("memory"),
        memory_summary=read_json(inputs["memory_summary"]), recommendation=read_json(inputs["recommendation"]),
        exercise2=read_json(inputs["exercise2"]), ex2_caps=csv("ex2_caps"), ex2_chunks=csv("ex2_chunks"),
        ex2_curve=csv("ex2_curve"), validation=validation,
        fleet_cells=[read_json(path) for path in inputs.get("fleet") or []],
        findings=read_json(inputs["findings"]),
        # the cross-machine decision, once the planner writes it (results/plan/decision.json)
        decision=read_json(inputs["decision"]) if inputs.get("decision") and Path(inputs["decision"]).is_file() else None,
        chunks=csv("chunks"),
        hardware=read_json(inputs["hardware"]) if inputs.get("hardware") else None,
        workload=read_json(inputs["workload"]) if inputs.get("workload") else None,
        # the serving process's measured peak per (policy, cap), in a profiled run
        serving_memory=read_json(inputs["serving_memory"]) if inputs.get("serving_memory") else None,
        coverage=read_json(inputs["coverage"]) if inputs.get("coverage") else None,
        carry_over_check=read_json(inputs["carry_over_check"]) if inputs.get("carry_over_check") else None,
        gpu_check=read_check(inputs["gpu_check"]) if inputs.get("gpu_check") else None,
        engines=read_json(inputs["engines"]) if inputs.get("engines") else None,
    )


def clean(value):
    """JSON-like data with every NaN, infinity and numpy scalar made plain: undefined is None."""
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if isinstance(value, (np.bool_, bool)):
        return bool(value)
    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if value is pd.NA or value is pd.NaT:
        return None
    return value


def records(frame: pd.DataFrame) -> list[dict]:
    return [clean(row) for row in frame.to_dict(orient="records")]


# -- number formatting (shared by both templates) ------------------------------------------------------

def significant(x, sig: int = 3) -> str:
    """`sig` significant digits without trailing zeros, never exponent notation, thousands separated:
    48,136; 0.000579; 6. Below 10**-MAX_DECIMALS a value reads as 0: such a figure is rounding noise
    in every unit the report uses. The page's script formats prices the same way."""
    x = float(x)
    if x == 0:
        return "0"
    decimals = min(MAX_DECIMALS, max(0, sig - 1 - math.floor(math.log10(abs(x)))))
    text = f"{x:,.{decimals}f}"
    text = text.rstrip("0").rstrip(".") if "." in text else text
    return "0" if text == "-0" else text


def _with_unit(unit: str, sig: int = 3):
    def fmt(x, missing="n/a", digits=sig):
        if x is None or (isinstance(x, float) and not math.isfinite(x)):
            return missing
        return f"{significant(x, digits)}{unit}"
    fmt.unit = unit
    return fmt


def fmt_int(x, missing="n/a"):
    return missing if x is None else f"{int(round(float(x))):,}"


def fmt_pct(fraction, missing="n/a", digits=3):
    """A fraction as a percentage."""
    return missing if fraction is None else f"{significant(float(fraction) * 100, digits)}%"


def fmt_usd(x, missing="n/a", digits=3):
    return missing if x is None else f"${significant(x, digits)}"


def fmt_gb(n_bytes, missing="n/a", digits=3):
    return missing if n_bytes is None else f"{significant(float(n_bytes) / 1e9, digits)} GB"


def fmt_range(pair, filter_name: str, missing="n/a"):
    """'lo to hi' of a [lo, hi] pair in the format of the filter named, one value if they agree."""
    if not pair or pair[0] is None or pair[1] is None:
        return missing
    fmt = FILTERS[filter_name]
    lo, hi = fmt(pair[0]), fmt(pair[1])
    unit = getattr(fmt, "unit", "")
    if lo == hi:
        return lo
    return f"{lo.removesuffix(unit) if unit else lo} to {hi}"


def fmt_duration(seconds, missing="n/a", digits=3):
    """Seconds in the unit that keeps the number readable: s, ms, µs or ns."""
    if seconds is None:
        return missing
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(seconds) >= scale:
            return f"{significant(seconds / scale, digits)} {unit}"
    return "0 s" if seconds == 0 else f"{significant(seconds / 1e-9, digits)} ns"


def count(n, noun: str) -> str:
    """'1 machine', '3 machines': a number with its noun in the right number, never 'machine(s)'."""
    n = int(n)
    return f"{n:,} {noun}" if n == 1 else f"{n:,} {noun}s"


def oneline(text):
    """Whitespace collapsed, so a macro's output is one Markdown paragraph; markup stays markup."""
    flat = " ".join(str(text).split())
    return Markup(flat) if isinstance(text, Markup) else flat


FILTERS = {
    "num": _with_unit(""), "ms": _with_unit(" ms"), "s": _with_unit(" s"), "rps": _with_unit(" req/s"),
    "tps": _with_unit(" tokens/s"), "times": _with_unit("×"), "ns": _with_unit(" ns"),
    "gbs": _with_unit(" GB/s"), "gflops": _with_unit(" GFLOP/s"), "tokens": _with_unit(" tokens"),
    "int": fmt_int, "pct": fmt_pct, "dur": fmt_duration, "usd": fmt_usd, "gb": fmt_gb, "range": fmt_range,
    "oneline": oneline, "count": count,
}


# -- sections ------------------------------------------------------------------------------------------

def summary_section(run: RunResults, config: dict) -> dict:
    """The planner's decision, as the templates print it."""
    rec = clean(run.recommendation)
    return {**rec, "verdict": {row["target"]: row for row in rec["verdict"]}, "n_pass": len(rec["passed"])}


def costmodel_origin(run: RunResults, config: dict) -> dict | None:
    """Where an imported step-time model came from and what it says, term by term; None when the
    model was fitted to this run's profile."""
    if run.measured:
        return None
    cost = run.cost_model
    return {
        "path": costmodel_source(config), "name": cost.name, "source": cost.source, "ctx_mode": cost.ctx_mode,
        "terms": [{"term": f"decode_{key}", "value": getattr(cost, f"decode_{key}")} for key in DECODE_KEYS]
        + [{"term": f"prefill_{key}", "value": getattr(cost, f"prefill_{key}")} for key in PREFILL_KEYS],
    }


def machine_section(run: RunResults) -> dict:
    if not run.measured:
        return {"measured": False, "model": clean(run.machine["model"]), "memory": clean(run.machine["memory"]),
                "reduced_model": bool(run.machine["model"].get("config_overrides"))}
    report = clean(run.fit_report)
    return {
        "measured": True,
        "machine": clean(run.machine["machine"]),
        "model": clean(run.machine["model"]),
        "memory": clean(run.machine["memory"]),
        "roofline": clean(run.machine["roofline"]),
        "profile_wall_time_s": clean(run.machine.get("wall_time_s")),
        "physical": report["physical"],
        "reduced_model": bool(run.machine["model"].get("config_overrides")),
    }


def profiling_section(run: RunResults) -> dict:
    from_cost_model = {
        **run.findings["prompts"],
        "decode_table": clean(run.findings["decode_table"]),
        "decode_table_largest": max((b for b, _ in run.cost_model.decode_batch_fixed_s), default=None),
    }
    if not run.measured:
        return {"imported": True, **from_cost_model}
    report = clean(run.fit_report)
    profile = run.profile
    decode = profile[profile["kind"] == "decode"]
    prefill = profile[(profile["kind"] == "prefill") & (profile["batch"] == 1)]
    longest_prefill = prefill.loc[prefill["prompt_len"].idxmax()]

    def decode_at(batch) -> dict:
        """Medians over the contexts profiled at one batch size."""
        rows = decode[decode["batch"] == batch]
        return {"batch": int(batch), "step_ms": clean(rows["median_s"].median() * 1e3),
                "efficiency": clean(rows["efficiency"].median()), "bound": _mode(rows["bound"])}

    return {
        "imported": False,
        **from_cost_model,
        "n_points": len(profile),
        "parts": report["parts"],
        "heldout_mape": report["heldout_mape"],
        "mape_goal": report["mape_goal"],
        "goal_met": report["goal_met"],
        "physical": report["physical"],
        "systematic_parts": sorted(part for part, found in report["residual_structure"].items()
                                   if found["systematic"]),
        "batched_prefill": report.get("batched_prefill", []),
        "batched_largest": _largest_batched(report.get("batched_prefill", [])),
        "holdout_fraction": report["holdout"]["fraction"],
        "n_holdout": len(report["holdout"]["point_ids"]),
        "decode_smallest": decode_at(decode["batch"].min()),
        "decode_largest": decode_at(decode["batch"].max()),
        "prefill_longest_len": int(longest_prefill["prompt_len"]),
        "prefill_longest_ms": float(longest_prefill["median_s"]) * 1e3,
        "prefill_efficiency_longest": float(longest_prefill["efficiency"]),
        "prefill_bound_longest": longest_prefill["bound"],
    }


def _largest_batched(rows: list[dict]) -> dict | None:
    """The largest batched prefill profiled, and whether one call for the batch saves time over separate calls."""
    if not rows:
        return None
    largest = max(rows, key=lambda r: r["batch"])
    return {**largest, "saves": largest["batched_over_separate"] < 1}


def _mode(series: pd.Series):
    return series.value_counts().sort_index().idxmax() if len(series) else None


def workload_section(config: dict, traces, rec: dict, described: dict | None) -> dict:
    """A trace file as the workload stage described it (results/workload/workload.json), or the
    Poisson spec with its calibration against the capstone source."""
    workload = config["workload"]
    if described and described["kind"] == "trace":
        return {"trace": described, "offered_tokens_per_s": rec["offered_tokens_per_s"]}
    n = int(workload["num_requests"])
    expected_output = expected_length(workload["output"])
    totals = [int(t.output_tokens.sum()) for t in traces]
    source = config["reference"]
    source_per_reply = source["output_tokens"] / source["requests"]
    return {
        "trace": None,
        "spec": workload,
        "seeds": len(traces),
        "num_requests": n,
        "rate": float(workload["rate"]),
        "mean_duration_s": float(np.mean([t.duration_s for t in traces])),
        "expected_prompt_tokens": expected_length(workload["prompt"]),
        "expected_output_tokens": expected_output,
        "expected_total_output_tokens": expected_output * n,
        "drawn_total_output_tokens": [min(totals), max(totals)],
        "expected_output_tokens_per_s": expected_output * float(workload["rate"]),
        "offered_tokens_per_s": rec["offered_tokens_per_s"],
        "source": source,
        "source_per_reply": source_per_reply,
        "calibration_error": expected_output / source_per_reply - 1.0,
        "same_request_count_as_source": n == source["requests"],
    }


def simulation_section(run: RunResults, config: dict, traces) -> dict:
    """The planner's findings on the sweep at today's rate, with the policies' display labels."""
    slo, workload = config["slo"], config["workload"]
    found = clean(run.findings["simulation"])
    labelled = lambda cell: {**cell, "policy_label": policies.label(cell["policy"])}  # noqa: E731
    itl = found["itl"]
    busiest = found["max_preemptions"]
    return {
        **found,
        "today_rate": float(workload["rate"]), "target_rate": float(slo["capacity_target_rate"]),
        "rates": sorted(float(r) for r in run.latency["rate"].unique()),
        "percentile": slo["ttft_percentile"], "slo_ms": slo["ttft_ms"], "tpot_ms": slo["tpot_ms"],
        "seeds": len(sweep_seeds(run.latency)),
        "cells": [labelled(c) for c in found["cells"]], "n_cells": len(found["cells"]),
        "best_slo": labelled(found["best_slo"]), "best_stable": labelled(found["best_stable"]),
        "policy_labels": [policies.label(p) for p in sorted(run.latency["policy"].unique(), key=policies.order)],
        "itl": itl and {**itl, "chunked_label": policies.label(itl["chunked"]), "plain_label": policies.label(itl["plain"])},
        "max_preemptions": busiest and {**busiest, "policy_label": policies.label(busiest["policy"])},
        "rate_min": config["capacity"]["rate_min"],
        "chunk_size": config["sweep"]["chunk_size"],
        "prompts_fit_one_chunk": max(int(t.prompt_tokens.max()) for t in traces) <= config["sweep"]["chunk_size"],
    }


def chunk_section(run: RunResults, config: dict, traces) -> dict | None:
    """The planner's chunk-sweep findings at today's rate, with the longest prompt drawn and the chunk sizes
    that split it."""
    found = clean(run.findings["chunk_sweep"])
    if found is None:
        return None
    longest = max(int(t.prompt_tokens.max()) for t in traces)
    return {**found, "rows": [{**r, "policy_label": policies.label(r["policy"])} for r in found["rows"]],
            "longest_prompt": longest, "splitting": [c for c in found["chunks"] if c < longest],
            "budget": policies.CHUNK_BUDGETS[policies.chunk_budget(config["sweep"])]}


def memory_section(run: RunResults) -> dict:
    """The memory arithmetic, and beside it the serving process's measured peak at the chosen configuration
    (the one the memory verdict read), every configuration measured and the profiler's own peak."""
    summary = clean(run.memory_summary)
    measured = clean(run.serving_memory or {})
    return {
        "summary": summary,
        "kv_matches_analytic": summary["kv_bytes_per_token_measured"] == summary["kv_bytes_per_token_analytic"],
        "kv_per_sequence_bytes": summary["kv_bytes_per_token_measured"] * summary["max_context"],
        "headroom_bytes": summary["budget_bytes"] - summary["weights_bytes"],
        "serving": clean(run.recommendation).get("serving_memory"),
        "serving_rows": measured.get("rows", []),
        "serving_model": measured.get("model"),
        "serving_check": measured.get("check"),
        "profiler_peak_bytes": measured.get("profiler_peak_rss_bytes"),
    }


def cost_section(run: RunResults, config: dict, summary: dict) -> dict:
    rec = clean(run.recommendation)
    decision = clean(run.decision) or {}
    return {
        # the deployment the decision names first (its pick, or the closest): the chart marks it
        "chosen": decision.get("pick") or decision.get("closest"),
        "price_per_hour": rec["price_per_hour"],
        "target_per_1k": config["cost"]["target_per_1k_tokens"],
        "max_replicas": config["cost"]["max_replicas"],
        "offered_tokens_per_s": rec["offered_tokens_per_s"],
        "fleets": summary["what_it_would_take"]["fleets"],
    }


def browser_cost_data(cost: dict) -> dict:
    """What the page's script needs to recompute every cost it shows when the price changes."""
    return {"price_per_hour": cost["price_per_hour"], "target_per_1k": cost["target_per_1k"],
            "max_replicas": cost["max_replicas"], "offered_tokens_per_s": cost["offered_tokens_per_s"],
            # the one money formula evaluated at $1 per machine-hour for 1 .. max_replicas machines
            "usd_per_1k_at_one_dollar": [money.cost_per_1k_tokens(1.0, replicas, cost["offered_tokens_per_s"])
                                         for replicas in range(1, cost["max_replicas"] + 1)],
            "marks": {f"{f['replicas']} machines, {f['router'].replace('_', ' ')}": f["replicas"]
                      for f in cost["fleets"]},
            "chosen": chosen_mark(cost["chosen"])}


def chosen_mark(option: dict | None) -> dict | None:
    """The decision's first option as the cost chart marks it: its label, its replicas and, for another
    machine, that machine's price (this machine's follows the price entered on the page)."""
    if option is None:
        return None
    here = option["machine"] == HERE
    deployment = (f"{option['replicas']} × {option['display_name']}, {names.display(option['policy'])} cap {option['cap']}"
                  + ("" if here else f" at ${option['price_per_hour']:g}/h"))
    return {"label": f"{'pick' if option['meets_all'] else 'closest'}: {deployment}", "replicas": option["replicas"],
            "price_per_hour": None if here else option["price_per_hour"]}


def hardware_section(run: RunResults, config: dict) -> dict | None:
    """Each target machine's verdicts, estimated on the cost model carried over by the roofline, beside
    this machine's; with every term's bound and scale factor. None when the config names no target."""
    targets = clean(run.hardware or {}).get("targets") or []
    if not targets:
        return None
    rows = []
    for target in targets:
        rec = target["recommendation"]
        rows.append({**{k: v for k, v in target.items() if k != "recommendation"},
                     "status": rec["status"], "chosen": rec["chosen"], "reason": rec["reason"],
                     "verdict": {row["target"]: row for row in rec["verdict"]},
                     "passed": rec["passed"], "missed": rec["missed"], "n_pass": len(rec["passed"]),
                     "speedup": rec["what_it_would_take"]["speedup"],
                     "weights_scale": _term(target["terms"], "prefill_fixed_s"),
                     "products_scale": _term(target["terms"], "prefill_per_token_s")})
    here = clean(run.recommendation)
    return {"targets": rows, "here": targets[0]["here"], "here_chosen": here["chosen"],
            "here_n_pass": len(here["passed"]), "here_verdict": {row["target"]: row for row in here["verdict"]},
            "accuracy": clean(run.carry_over_check), "accuracy_skipped": carry_over_check_skipped(config),
            **gpu_check_quote(run, rows)}


def gpu_check_quote(run: RunResults, targets: list[dict]) -> dict:
    """What the section on other machines says of the GPU check (config gpu_check): the check's summary
    (its errors, computed by the check) with its entry's display name and whether it carried this machine's
    fit, and how many targets are GPUs and how many of them pay the host time the check measured."""
    gpu = [target for target in targets if target["carry_over"]["target_kind"] == "gpu"]
    quote = None
    if run.gpu_check is not None:
        summary = clean(run.gpu_check["summary"])
        here = run.machine.get("machine", {}).get("fingerprint")
        quote = {**summary, "entry_display": names.brief(names.machine(summary["entry"])),
                 "same_machine": summary["carried_from"]["machine_fingerprint"] == here}
    return {"gpu_check": quote, "gpu_targets": len(gpu),
            "gpu_targets_measured_overhead": sum(t["carry_over"]["launch_overhead_source"] == "measured" for t in gpu)}


def _term(terms: list[dict], name: str) -> dict:
    return next(term for term in terms if term["term"] == name)


def validation_section(run: RunResults, workload: dict) -> dict | None:
    if run.validation is None:
        return None
    comparison = run.validation.comparison
    meta = clean(run.validation.meta)
    fitted = comparison[comparison["cost_model"] == "as_fitted"]
    corrected = comparison[comparison["cost_model"] == "drift_corrected"].set_index(["load_fraction", "metric", "stat"])
    rows = []
    for (fraction, rate), group in fitted.groupby(["load_fraction", "rate"], sort=True):
        stats = {}
        for r in group.itertuples():
            twin = corrected.loc[(r.load_fraction, r.metric, r.stat)]
            stats[f"{r.metric}_{r.stat}"] = {
                "measured": clean(r.measured_ms), "simulated": clean(r.simulated_ms), "diff_pct": clean(r.diff_pct),
                "n": int(r.n), "corrected": clean(twin["simulated_ms"]), "corrected_diff_pct": clean(twin["diff_pct"]),
                "measured_lo": clean(r.measured_lo_ms), "measured_hi": clean(r.measured_hi_ms),
                "corrected_agrees": bool(twin["agrees"])}
        rows.append({"load_fraction": float(fraction), "rate": float(rate), "stats": stats})
    requests = run.validation.requests
    found = meta["findings"]
    return {
        "meta": meta,
        "headline": meta["headline"],
        "findings": found,
        # the planner's gaps by figure and cost model: gaps["ttft_p90"]["as_fitted"]
        "gaps": {f"{key}_{stat}": {gap["cost_model"]: gap for gap in found["requests"]
                                   if (gap["metric"], gap["stat"]) == (key, stat)}
                 for key, stat in {(gap["metric"], gap["stat"]) for gap in found["requests"]}},
        "ttft_tail_breaks_first": _ttft_tail_breaks_first(meta["headline"]),
        "policy_label": policies.label(meta["policy"]),
        "rows": rows,
        "served": [t for t in meta["traces"] if not t.get("skipped")],
        "truncated": [t for t in meta["traces"] if t.get("measured_truncated")],
        "skipped": [t for t in meta["traces"] if t.get("skipped")],
        "from_trace_file": bool(workload.get("trace")),
        "n_requests": int(len(requests)),
        "n_finished_both": int(requests["finished_both"].astype(bool).sum()),
    }


def engines_section(run: RunResults, config: dict) -> dict | None:
    """The engines compared (servingplan.llamacpp.compare), with the words for their schedulers."""
    if run.engines is None:
        return None
    engines = clean(run.engines)
    return {**engines, "policy_label": {name: policies.label(served["policy"])
                                        for name, served in engines["serving"].items()}}


def _ttft_tail_breaks_first(headline: dict) -> bool:
    """The drift-corrected model misses the goal on the TTFT tail, where waiting time amplifies speed error."""
    worst = headline["drift_corrected"]["worst_abs_ttft_p90_diff_pct"]
    return not headline["drift_corrected"]["met"] and worst is not None and worst > headline["goal_pct"]


def seed_means(sweep: pd.DataFrame, key: str) -> pd.DataFrame:
    """The rows exercise 2 writes as the mean over seeds, in order of `key`."""
    return sweep[sweep["stat"] == "mean"].sort_values(key)


def exercise2_section(run: RunResults) -> dict:
    """The answers, the chunk sweep, and the cap sweep with the curve's two readings side by side."""
    means = seed_means(run.ex2_caps, "max_num_seqs")
    caps = [{"cap": int(cap), **{r["reading"]: r for r in records(group)}}
            for cap, group in means.groupby("max_num_seqs", sort=True)]
    return {"answers": clean(run.exercise2), "caps": caps, "readings": EX2_READINGS,
            "chunks": records(seed_means(run.ex2_chunks, "chunk_size"))}


def assumptions_section(run: RunResults, config: dict) -> dict:
    machine = run.machine.get("machine", {})
    steps = run.validation.meta["headline"] if run.validation is not None else None
    bias = clean(steps.get("step_bias_drift_corrected_pct")) if steps else None
    return {
        "random_weights": bool(run.machine["model"]["random_weights"]),
        "threads": machine.get("threads"), "logical_cores": machine.get("logical_cores"),
        "physical_cores": machine.get("physical_cores"),
        "prompt": config["workload"]["prompt"], "output": config["workload"]["output"],
        "price_per_hour": config["cost"]["price_per_hour"],
        "tpot_ms": config["slo"]["tpot_ms"],
        "max_context": config["memory"]["max_context"], "block_size": config["memory"]["block_size"],
        "rss_after_load_bytes": run.machine["memory"].get("rss_after_load_bytes"),
        "weights_bytes": run.machine["memory"]["param_bytes"],
        "step_bias_pct": bias,
        # a negative per-step error: the engine's steps took longer than the model predicts
        "model_predicts_faster": bias is not None and bias < 0,
        "horizon_factor": config["sweep"]["horizon_factor"],
    }


# -- provenance ----------------------------------------------------------------------------------------

def _git(*args) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=REPO_DIR, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def sha256_of(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def input_files(inputs: Mapping) -> dict[str, str]:
    """Every input file by a label: its input name, with the file name for inputs that are lists."""
    files = {}
    for key, value in sorted(inputs.items()):
        if isinstance(value, (str, Path)):
            files[key] = str(value)
        else:
            files.update({f"{key}:{Path(path).name}": str(path) for path in value})
    return files


def provenance(inputs: Mapping, config_hash: str, machine_fingerprint: str, log_dir) -> dict:
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain")
    spans = stage_times(log_dir)
    started = min(s for s, _ in spans) if spans else None
    finished = max(f for _, f in spans) if spans else None
    stamp = lambda t: dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat(timespec="seconds")  # noqa: E731
    return {
        "config_hash": config_hash,
        "git_commit": commit,
        "git_dirty": None if status is None else bool(status),
        "generated_utc": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine_fingerprint": machine_fingerprint,
        "pipeline_wall_time_s": finished - started if spans else None,
        "pipeline_started_utc": stamp(started) if spans else None,
        "pipeline_finished_utc": stamp(finished) if spans else None,
        "stages_logged": len(spans),
        "inputs": {label: {"path": path, "sha256": sha256_of(path)}
                   for label, path in input_files(inputs).items() if Path(path).is_file()},
        "versions": {"python": platform.python_version(),
                     **{name: version(name) for name in ("numpy", "pandas", "matplotlib", "jinja2")}},
    }


# -- rendering -----------------------------------------------------------------------------------------

# every figure the report may show, in the order build_figures makes them
FIGURE_NAMES = ("workload", "ttft_vs_rate", "capacity", "attainment", "goodput", "preemptions", "itl", "memory", "cost",
                "ex2_curve", "ex2_caps", "ex2_chunks")


def build_figures(run: RunResults, config: dict, context: dict, traces) -> dict[str, bytes]:
    slo, workload = config["slo"], config["workload"]
    today, target = float(workload["rate"]), float(slo["capacity_target_rate"])
    cost, ex2 = context["cost"], context["exercise2"]["answers"]
    made = {
        "workload": figures.workload_histograms(traces, today, "replayed" if workload.get("trace") else "drawn"),
        "ttft_vs_rate": figures.ttft_vs_rate(run.latency, slo["ttft_percentile"], slo["ttft_ms"], today, target),
        "capacity": figures.capacity_per_cap(run.capacity, today, target),
        "attainment": figures.attainment_heatmap(run.latency, "good requests (%)"),
        "goodput": figures.by_cap(run.latency, "goodput_rps", {"today": today, "target": target},
                                  "goodput (good requests/s)", "Goodput per cap",
                                  {"today": (today, "offered"), "target": (target, "offered")}),
        "preemptions": figures.by_cap(run.latency, "preemptions", {"today": today, "target": target},
                                      "preemptions per run", "KV-cache preemptions (recompute) per cap"),
        "itl": figures.by_cap(run.latency, "itl_ms_p99", {"today": today, "target": target},
                              "p99 inter-token gap (ms)", "Inter-token stalls: p99 gap between tokens"),
        "memory": figures.memory_bars(run.memory, context["memory"]["summary"]["budget_bytes"],
                                      serving_rss=context["memory"]["serving_rows"],
                                      serving_model=context["memory"]["serving_model"]),
        "cost": figures.cost_vs_replicas(cost["price_per_hour"], cost["offered_tokens_per_s"], cost["target_per_1k"],
                                         cost["max_replicas"], context["cost_data"]["marks"],
                                         context["cost_data"]["chosen"]),
        "ex2_curve": figures.exercise2_curve(run.ex2_curve, ex2["2.1"]["least_squares"]["a_ms"],
                                             ex2["2.1"]["least_squares"]["b_ms"], ex2["2.2"]["tpot_budget_ms"],
                                             ex2["2.2"]["b_max"]),
        "ex2_caps": figures.exercise2_caps(seed_means(run.ex2_caps, "max_num_seqs"), ex2["2.2"]["b_max"],
                                           ex2["pick"]["picked_cap"], ex2["2.2"]["tpot_budget_ms"]),
        "ex2_chunks": figures.exercise2_chunks(seed_means(run.ex2_chunks, "chunk_size"), ex2["2.3"]["itl_bound_ms"]),
    }
    if run.measured:
        heldout = set(clean(run.fit_report)["holdout"]["point_ids"])
        made["prefill_profile"] = figures.prefill_profile(run.profile, run.cost_model, heldout)
        made["decode_profile"] = figures.decode_profile(run.profile, run.cost_model, heldout)
        made["residuals"] = figures.residuals(run.predicted)
        made["roofline_efficiency"] = figures.roofline_efficiency(run.profile)
        made["speed_trace"] = measurement.speed_trace_figure(run.machine,
                                                             run.validation.meta if run.validation else None)
    if run.validation is not None:
        made["validation_ttft"] = figures.ttft_scatter(run.validation.requests)
        if any(row["batch"] > 0 for row in run.validation.meta["steps_by_batch"]):
            made["steps_by_batch"] = measurement.steps_by_batch_figure(run.validation.meta)
    # a figure with nothing stable or nothing but zeros to draw is left out; the report says why where it would stand
    return {name: figures.png_bytes(fig) for name, fig in made.items() if fig is not None}


# the figures drawn by figures.by_cap, whose omission has either reason; every other figure is left out
# only when nothing it covers keeps up
BY_CAP_FIGURES = {"goodput": "goodput_rps", "preemptions": "preemptions", "itl": "itl_ms_p99"}


def figure_omissions(run: RunResults, config: dict, figure_png: dict) -> dict[str, str]:
    """Why each figure left out is missing: figures.NO_STABLE_POINT or figures.ALL_ZERO."""
    rates = {"today": float(config["workload"]["rate"]), "target": float(config["slo"]["capacity_target_rate"])}
    return {name: figures.by_cap_omission(run.latency, BY_CAP_FIGURES[name], rates) if name in BY_CAP_FIGURES
            else figures.NO_STABLE_POINT
            for name in FIGURE_NAMES if name not in figure_png}


def build_context(run: RunResults, config: dict, provenance_record: dict, traces) -> dict:
    summary = summary_section(run, config)
    cost = cost_section(run, config, summary)
    hardware = hardware_section(run, config)
    engines = engines_section(run, config)
    return {
        "title": config["report"]["title"],
        "config": config,
        "summary": summary,
        "decision": clean(run.decision),
        "machine": machine_section(run),
        "profiling": profiling_section(run),
        "workload": workload_section(config, traces, clean(run.recommendation), clean(run.workload)),
        "coverage": clean(run.coverage),
        "simulation": simulation_section(run, config, traces),
        "chunk_sweep": chunk_section(run, config, traces),
        "memory": memory_section(run),
        "cost": cost,
        "cost_data": browser_cost_data(cost),
        "validation": validation_section(run, config["workload"]),
        "hardware": hardware,
        "engines": engines,
        "measurement": clean(measurement.measurement_summary(run.machine, run.fit_report,
                                                             run.validation.meta if run.validation else None))
        if run.measured else None,
        "costmodel_origin": costmodel_origin(run, config),
        "exercise2": exercise2_section(run),
        "assumptions": assumptions_section(run, config),
        "provenance": provenance_record,
        "policy_label": policies.label,
        # the section on other machines stands only when the config names some; the engines', when llama.cpp ran
        "outline": [section for section in OUTLINE
                    if (section.id != "hardware" or hardware) and (section.id != "engines" or engines)],
    }


def environment() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATE_DIR), extensions=["jinja2.ext.do"],
        # Markdown too: config text must not become raw HTML there either, and entities render as characters.
        autoescape=jinja2.select_autoescape(enabled_extensions=("html.j2", "md.j2", "text.j2", "sections.j2"), default_for_string=False),
        undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
    )
    env.filters.update(FILTERS)
    env.globals.update(verdict_cell=blocks.Verdict, display=names.display, NO_STABLE_POINT=figures.NO_STABLE_POINT)
    return env


class CostText:
    """Cost figures as the templates print them. In HTML each one is a span carrying what the page's
    script needs to recompute it when the reader edits the price; in Markdown it is plain text."""

    def __init__(self, price_per_hour: float, target_per_1k: float, html: bool):
        self.price_per_hour, self.target_per_1k, self.html = price_per_hour, target_per_1k, html

    def _span(self, css_class: str, text: str, **data) -> str:
        if not self.html:
            return text
        attributes = Markup("").join(Markup(' data-{}="{}"').format(k.replace("_", "-"), v) for k, v in data.items())
        return Markup('<span class="{}"{}>{}</span>').format(css_class, attributes, text)

    def per_1k(self, replicas, tokens_per_s) -> float | None:
        return money.cost_per_1k_tokens(self.price_per_hour, replicas, tokens_per_s) if tokens_per_s else None

    @staticmethod
    def at_one_dollar(replicas, tokens_per_s) -> str:
        """The cost at $1 per machine-hour: the page scales it by the price entered."""
        return repr(money.cost_per_1k_tokens(1.0, replicas, float(tokens_per_s)))

    def money(self, replicas, tokens_per_s, missing="n/a"):
        """$ per 1,000 output tokens for `replicas` machines serving `tokens_per_s`."""
        value = self.per_1k(replicas, tokens_per_s)
        if value is None:
            return missing
        return self._span("cost", fmt_usd(value), usd_at_one_dollar=self.at_one_dollar(replicas, tokens_per_s))

    def check(self, replicas, tokens_per_s, within: str, above: str, missing="n/a"):
        """`within` when that cost meets the target, else `above`."""
        value = self.per_1k(replicas, tokens_per_s)
        if value is None:
            return missing
        return self._span("cost-check", within if value <= self.target_per_1k else above,
                          usd_at_one_dollar=self.at_one_dollar(replicas, tokens_per_s), within=within, above=above)

    def price(self):
        return self._span("price", fmt_usd(self.price_per_hour))

    def replicas_within(self, tokens_per_s):
        """The most machines the cost target pays for at this traffic."""
        machines = money.max_replicas_within(self.price_per_hour, tokens_per_s, self.target_per_1k)
        return self._span("replicas-within", count(machines, "machine"),
                          usd_at_one_dollar=self.at_one_dollar(1, tokens_per_s))


def png_css_size(png: bytes) -> tuple[int, int]:
    """The CSS size of a figure drawn at twice the screen's density: half its pixels each way."""
    width, height = int.from_bytes(png[16:20], "big"), int.from_bytes(png[20:24], "big")
    return width // 2, height // 2


def table_sources(inputs: Mapping, html_path) -> dict:
    """Each single-file input as a link relative to the HTML page, so a table can point at its data, and
    the path a reader finds it at: as the pipeline names it (results/...), or its file name."""
    base = Path(html_path).resolve().parent
    return {key: {"href": Path(os.path.relpath(Path(path).resolve(), base)).as_posix(),
                  "path": Path(path).as_posix() if not Path(path).is_absolute() else Path(path).name}
            for key, path in inputs.items() if isinstance(path, (str, Path)) and Path(path).is_file()}


def render(context: dict, figure_png: dict[str, bytes], figure_dir_name: str = FIGURE_DIR_NAME) -> tuple[str, str]:
    """(HTML, Markdown) of the report; the HTML embeds the figures, the Markdown links them."""
    env = environment()
    price, target = context["cost"]["price_per_hour"], context["cost"]["target_per_1k"]
    html_blocks = blocks.HtmlBlocks(
        context["sources"],
        figure_src={name: "data:image/png;base64," + base64.b64encode(png).decode("ascii") for name, png in figure_png.items()},
        figure_size={name: png_css_size(png) for name, png in figure_png.items()})
    html = env.get_template(HTML_TEMPLATE).render(
        **context, B=html_blocks, cost_text=CostText(price, target, html=True), max_decimals=MAX_DECIMALS)
    md_blocks = blocks.MarkdownBlocks(context["sources"], {name: f"{figure_dir_name}/{name}.png" for name in figure_png})
    md = env.get_template(MD_TEMPLATE).render(**context, B=md_blocks, cost_text=CostText(price, target, html=False))
    # The templates open with macro definitions and their blocks leave blank lines behind; Markdown
    # treats any run of blank lines as one.
    return html.lstrip(), re.sub(r"\n{3,}", "\n\n", md.lstrip())


def write_report(inputs: Mapping, config: dict, config_hash: str, machine_fingerprint: str, html_path, md_path,
                 provenance_path, log_dir) -> None:
    run = load_results(inputs)
    traces = workload_traces(config["workload"], sweep_seeds(run.latency))
    record = provenance(inputs, config_hash, machine_fingerprint, log_dir)
    context = {**build_context(run, config, record, traces), "sources": table_sources(inputs, html_path)}
    figure_png = build_figures(run, config, context, traces)
    context["figure_omissions"] = figure_omissions(run, config, figure_png)
    html, md = render(context, figure_png)

    figure_dir = Path(md_path).parent / FIGURE_DIR_NAME
    figure_dir.mkdir(parents=True, exist_ok=True)
    for stale in figure_dir.glob("*.png"):
        if stale.stem not in figure_png:
            stale.unlink()
    for name, png in figure_png.items():
        with atomic_path(figure_dir / f"{name}.png") as tmp:
            tmp.write_bytes(png)
    write_text(md_path, md)
    write_text(html_path, html)
    write_json(provenance_path, record)

