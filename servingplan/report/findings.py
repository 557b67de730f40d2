"""The comparisons the report states about the simulations, decided here so the report only formats.

    findings(latency, capacity, chunks, cost_model, slo, workload) -> dict   results/plan/findings.json
    capacity_interval(row) -> [lo, hi]                                         the one interval fallback

From the collected sweep at today's rate: each (policy, cap) cell with its TTFT percentile over seeds
and both capacities; the cells with the most capacity; the inter-token comparison of each chunking
policy with the policy it refines, at the largest cap where both have a percentile; the chunk sweep's
smallest-against-largest chunk at the largest cap where both keep up; the run that preempted most;
and the step-time model evaluated: its per-batch decode table beside the line it replaces, and its
prefill of the workload's prompts.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

from servingplan.costmodel import CostModel
from servingplan.seeds import over_seeds
from servingplan.simulate import policies
from servingplan.simulate.workload import generate


def _plain(value):
    """A float, or None where undefined (an unstable run's percentile)."""
    return None if value is None or pd.isna(value) or not math.isfinite(float(value)) else float(value)


def capacity_interval(row) -> list[float]:
    """The capacity's interval: the search's own bracket when it gave one, else the spread over seeds."""
    interval = [row.get("interval_lo_rps"), row.get("interval_hi_rps")]
    if any(v is None or pd.isna(v) for v in interval):
        interval = [row["capacity_min_rps"], row["capacity_max_rps"]]
    return [float(v) for v in interval]


def _capacity(capacity: pd.DataFrame, name: str, key) -> dict:
    row = capacity.loc[(name, *key)]
    return {"rps": float(row["capacity_rps"]), "range": capacity_interval(row), "never_met": bool(row["never_met"])}


def simulation_cells(latency: pd.DataFrame, capacity: pd.DataFrame, slo: dict, today: float) -> dict:
    """Every (policy, cap) at today's rate and what the report compares among them."""
    pct = f"ttft_ms_p{slo['ttft_percentile']:g}"
    target = float(slo["capacity_target_rate"])
    cells_by_rate = over_seeds(latency, ["policy", "max_num_seqs", "rate"], spread=True)
    at_today = cells_by_rate[np.isclose(cells_by_rate["rate"], today)]
    indexed = capacity.set_index(["criterion_name", "policy", "max_num_seqs"])
    cells = []
    for row in at_today.to_dict(orient="records"):
        key = (row["policy"], int(row["max_num_seqs"]))
        ttft = _plain(row[pct])
        cells.append({
            "policy": row["policy"], "cap": key[1], "stable": bool(row["stable"]), "ttft_ms": ttft,
            "ttft_range": [_plain(row[f"{pct}_min"]), _plain(row[f"{pct}_max"])] if ttft is not None else None,
            "goodput_rps": _plain(row["goodput_rps"]),
            **{f"capacity_{name}": _capacity(indexed, name, key) for name in ("ttft_slo", "stable")},
        })
    cells.sort(key=lambda c: (policies.order(c["policy"]), c["cap"]))
    best_slo = max(cells, key=lambda c: (c["capacity_ttft_slo"]["rps"], -c["cap"]))
    best_stable = max(cells, key=lambda c: (c["capacity_stable"]["rps"], -c["cap"]))
    busiest = cells_by_rate.loc[cells_by_rate["preemptions"].idxmax()] if len(cells_by_rate) else None
    return {
        "cells": cells,
        "n_stable_today": sum(c["stable"] for c in cells),
        "n_meeting_slo_today": sum(c["ttft_ms"] is not None and c["ttft_ms"] <= slo["ttft_ms"] for c in cells),
        "best_slo": best_slo, "best_slo_positive": best_slo["capacity_ttft_slo"]["rps"] > 0,
        "best_stable": best_stable, "best_stable_below_today": best_stable["capacity_stable"]["rps"] < today,
        "any_meets_target": any(c["capacity_ttft_slo"]["rps"] >= target for c in cells),
        "itl": itl_comparison(at_today),
        "max_preemptions": None if busiest is None or not busiest["preemptions"] > 0 else {
            "mean": float(busiest["preemptions"]), "policy": busiest["policy"],
            "cap": int(busiest["max_num_seqs"]), "rate": float(busiest["rate"])},
    }


def itl_comparison(at_today: pd.DataFrame) -> dict | None:
    """p99 inter-token gap of the first chunking policy against the policy it refines, at the largest cap
    where both are stable on every seed (an unstable run has no percentile); when no such cap exists,
    how many caps they share."""
    for policy in policies.REGISTRY:
        if policy.unchunked is None:
            continue
        chunked = at_today[at_today["policy"] == policy.name].set_index("max_num_seqs")
        plain = at_today[at_today["policy"] == policy.unchunked].set_index("max_num_seqs")
        shared = sorted(set(chunked.index) & set(plain.index))
        defined = [cap for cap in shared if pd.notna(chunked.loc[cap, "itl_ms_p99"])
                   and pd.notna(plain.loc[cap, "itl_ms_p99"])]
        if not defined:
            return {"defined": False, "caps": len(shared), "chunked": policy.name, "plain": policy.unchunked}
        cap = defined[-1]
        ratio = float(chunked.loc[cap, "itl_ms_p99"] / plain.loc[cap, "itl_ms_p99"])
        return {"defined": True, "cap": int(cap), "chunked_ms": float(chunked.loc[cap, "itl_ms_p99"]),
                "plain_ms": float(plain.loc[cap, "itl_ms_p99"]), "ratio": ratio, "no_shorter": ratio >= 1,
                "chunked": policy.name, "plain": policy.unchunked}
    return None


def chunk_comparison(chunks: pd.DataFrame, slo: dict, today: float) -> dict | None:
    """The chunk sweep at today's rate per cap and chunk size, and the smallest chunk against the largest
    at the largest cap where both keep up; None when the run swept no chunk sizes."""
    if chunks is None or chunks.empty:
        return None
    pct = f"ttft_ms_p{slo['ttft_percentile']:g}"
    cells = over_seeds(chunks, ["policy", "max_num_seqs", "chunk_size", "rate"])
    cells = cells[np.isclose(cells["rate"], today)]
    rows = [{"policy": r["policy"], "cap": int(r["max_num_seqs"]), "chunk": int(r["chunk_size"]),
             "stable": bool(r["stable"]), "itl_ms_p99": _plain(r["itl_ms_p99"]), "ttft_ms": _plain(r[pct])}
            for r in cells.sort_values(["max_num_seqs", "chunk_size"]).to_dict(orient="records")]
    sizes = sorted(int(c) for c in cells["chunk_size"].unique())
    both = [cap for cap in sorted({r["cap"] for r in rows})
            if all(r["stable"] for r in rows if r["cap"] == cap and r["chunk"] in (sizes[0], sizes[-1]))]
    compare = None
    if both and len(sizes) > 1:
        at = {r["chunk"]: r for r in rows if r["cap"] == both[-1]}
        compare = {"cap": both[-1], "small": at[sizes[0]], "large": at[sizes[-1]]}
    return {"rows": rows, "chunks": sizes, "compare": compare}


def decode_table(cost: CostModel) -> list[dict]:
    """The per-batch decode table beside the line a + b·B it replaces, in ms."""
    return [{"batch": b, "table_ms": seconds * 1e3, "line_ms": (cost.decode_fixed_s + cost.decode_per_seq_s * b) * 1e3}
            for b, seconds in cost.decode_batch_fixed_s]


def workload_traces(workload: dict, seeds: list[int]):
    """The traces as the simulations replay them at today's rate: a trace file's arrival gaps rescaled
    to workload.rate, as every pipeline stage rescales them."""
    if workload.get("trace"):
        return [generate(workload, seed).with_rate(float(workload["rate"])) for seed in seeds]
    return [generate(workload, seed) for seed in seeds]


def sweep_seeds(latency: pd.DataFrame) -> list[int]:
    return sorted(int(s) for s in latency["seed"].unique())


def prompt_prefill(cost: CostModel, traces) -> dict:
    """The step-time model's prefill of the workload's prompts, on average."""
    prompts = np.concatenate([t.prompt_tokens for t in traces])
    return {"mean_prompt_prefill_ms": float(np.mean([cost.prefill_time(int(p)) for p in prompts])) * 1e3,
            "mean_prompt_tokens": float(prompts.mean())}


def findings(latency: pd.DataFrame, capacity: pd.DataFrame, chunks: pd.DataFrame | None, cost: CostModel,
             slo: dict, workload: dict) -> dict:
    today = float(workload["rate"])
    return {"simulation": simulation_cells(latency, capacity, slo, today),
            "chunk_sweep": chunk_comparison(chunks, slo, today),
            "decode_table": decode_table(cost),
            "prompts": prompt_prefill(cost, workload_traces(workload, sweep_seeds(latency)))}
