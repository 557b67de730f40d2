"""Exercise 2: turn a TTFT/TPOT SLO into a batch cap, answered from the cost model and simulations.

Every figure of tasks 2.1-2.6 is computed here: the decode curve and its affine fit, the cap the
curve alone allows, the sweep of caps the exercise runs, a chunk-size sweep for an inter-token
latency bound, and the simulated effects the static curve leaves out. The simulator's step
recorder gives the per-step view a run's summary does not keep.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np
import pandas as pd

from servingplan.costmodel import EXERCISE2, CostModel, decode_curve
from servingplan.seeds import derived_seeds
from servingplan.seeds import over_seeds
from servingplan.simulate import workload
from servingplan.simulate import simulate
from servingplan.simulate.fleet import ROUTERS, simulate_fleet
from servingplan.simulate.metrics import SLO, finite_or_none, itl_values, per_request, percentile, summarize
from servingplan.simulate.workload import Trace

POLICY = "continuous_chunked"
# the reading of the source's curve the answers follow: the step-time model's own (b per KV token)
ANSWER_READING = "per_kv_token"
# the rows and the per-sequence context of the exercise's latency table
CURVE_BATCHES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
CURVE_CONTEXT_TOKENS = 2000
# the three goodput outcomes the exercise asks to choose between before simulating
PREDICTION_CHOICES = (1.0, 0.7, 0.3)
# the simulator's own default, so a run here matches the exercise's command line
HORIZON_FACTOR = 20.0
BLOCK_SIZE = 16
# what the replicas of task 2.6 add: the next capacity step
EXTRA_CAPACITY_REPLICAS = 2
PERCENTILES = (50, 90, 95, 99)
# The one share of requests meeting the SLO every answer and figure of the exercise quotes. Goodput over
# the offered rate is not that share: goodput divides by the run's duration, which includes draining the
# last requests, so it sits below attainment.
SHARE_MEETING_SLO = "attainment: requests meeting both SLO bounds over every request that arrived"


@dataclass(frozen=True)
class Exercise2Outputs:
    answers: dict
    cap_sweep: pd.DataFrame
    chunk_sweep: pd.DataFrame
    curve: pd.DataFrame


# -- inputs -----------------------------------------------------------------------------------------

def exercise_workload(cfg: dict) -> dict:
    return {**workload.EXERCISE2, "rate": float(cfg["rate"]), "num_requests": int(cfg["num_requests"])}


def exercise_slo(cfg: dict) -> SLO:
    return SLO(ttft_ms=cfg["slo_ttft_ms"], ttft_percentile=95.0, tpot_ms=cfg["slo_tpot_ms"], tpot_percentile=95.0)


# -- 2.1 / 2.2: the curve ---------------------------------------------------------------------------

def curve_frame(cost: CostModel) -> pd.DataFrame:
    return pd.DataFrame(decode_curve(cost, CURVE_BATCHES, CURVE_CONTEXT_TOKENS))


def fit_affine(batches, step_ms) -> tuple[float, float]:
    """Least-squares a, b (ms) of step_ms = a + b*B."""
    design = np.column_stack([np.ones(len(batches)), np.asarray(batches, dtype=float)])
    (a, b), *_ = np.linalg.lstsq(design, np.asarray(step_ms, dtype=float), rcond=None)
    return float(a), float(b)


def read_curve(curve: pd.DataFrame, cost: CostModel) -> dict:
    a, b = fit_affine(curve["batch"], curve["step_ms"])
    first, last = curve.iloc[0], curve.iloc[-1]
    b_two = (last["step_ms"] - first["step_ms"]) / (last["batch"] - first["batch"])
    a_two = first["step_ms"] - b_two * first["batch"]
    residual = curve["step_ms"] - (a + b * curve["batch"])
    return {
        "context_tokens": CURVE_CONTEXT_TOKENS,
        "batches": [int(x) for x in curve["batch"]],
        "least_squares": {"a_ms": a, "b_ms": b, "max_abs_residual_ms": float(residual.abs().max())},
        "two_rows": {"rows": [int(first["batch"]), int(last["batch"])], "a_ms": float(a_two), "b_ms": float(b_two)},
        "a_meaning": "fixed cost of every decode step, paid once per step whatever the batch: "
                     "streaming the model weights",
        "b_meaning": "cost each extra sequence adds to a step: reading its KV cache "
                     f"({CURVE_CONTEXT_TOKENS} tokens at the curve's context)",
        "b_per_kv_token_ns": b / CURVE_CONTEXT_TOKENS * 1e6,
        "cost_model_a_ms": cost.decode_fixed_s * 1e3,
        "cost_model_b_ms": (cost.decode_per_seq_s + cost.decode_per_ctx_token_s * CURVE_CONTEXT_TOKENS) * 1e3,
        "throughput_growth": float(last["tokens_per_s"] / first["tokens_per_s"]),
        "latency_growth": float(last["step_ms"] / first["step_ms"]),
        "from_batch": int(first["batch"]), "to_batch": int(last["batch"]),
    }


def largest_batch_within(a_ms: float, b_ms: float, budget_ms: float) -> int:
    """Largest integer B with a + b*B <= budget, checked on the inequality itself rather than
    trusting a floored quotient's rounding."""
    batch = max(0, math.floor((budget_ms - a_ms) / b_ms))
    while a_ms + b_ms * (batch + 1) <= budget_ms:
        batch += 1
    while batch > 0 and a_ms + b_ms * batch > budget_ms:
        batch -= 1
    return batch


def naive_cap_answer(fit: dict, budget_ms: float) -> dict:
    a, b = fit["least_squares"]["a_ms"], fit["least_squares"]["b_ms"]
    cap = largest_batch_within(a, b, budget_ms)
    return {
        "inequality": f"{a:.4f} ms + {b:.4f} ms * B <= {budget_ms:g} ms",
        "a_ms": a, "b_ms": b, "tpot_budget_ms": budget_ms,
        "b_max_real": (budget_ms - a) / b,
        "b_max": cap,
        "b_max_plus_1": cap + 1,
        "step_ms_at_b_max": a + b * cap,
        "step_ms_at_b_max_plus_1": a + b * (cap + 1),
    }


# -- simulations -------------------------------------------------------------------------------------

def _run(trace, cost, policy, cap, chunk, record_tokens=False):
    return simulate(trace, cost, policy, cap, chunk, None, BLOCK_SIZE, HORIZON_FACTOR, record_tokens)


def run_figures(result, slo: SLO) -> dict:
    """One run's table row: latency percentiles, goodput, the share meeting the SLO (attainment, the one
    share the exercise quotes: SHARE_MEETING_SLO), stability; with inter-token gaps when the run recorded
    token times."""
    summary = summarize(result, slo)
    row = {f"{m}_p{q}": summary[f"{m}_p{q}"] for m in ("ttft_ms", "tpot_ms") for q in PERCENTILES}
    row["ttft_ms_mean"] = summary["ttft_ms_mean"]
    row["tpot_ms_mean"] = summary["tpot_ms_mean"]
    if result.token_spans is not None:
        gaps_ms = itl_values(result) * 1e3
        row.update({"itl_ms_p50": finite_or_none(percentile(gaps_ms, 50)), "itl_ms_p99": finite_or_none(percentile(gaps_ms, 99)),
                    "itl_ms_max": finite_or_none(gaps_ms.max()) if gaps_ms.size else None})
    row.update({key: summary[key] for key in ("goodput_rps", "attainment", "stable", "slo_holds",
                                              "throughput_tok_s", "preemptions", "peak_running")})
    return row


def with_means(rows: list[dict], key: str) -> pd.DataFrame:
    """Per-seed rows (stat "run") followed by one "mean" row per value of `key` (and of `reading`, when
    the rows carry one), aggregated over seeds the one way the pipeline does (servingplan.seeds)."""
    runs = pd.DataFrame(rows)
    by = [c for c in ("reading", key) if c in runs]
    means = over_seeds(runs, by).drop(columns="seeds").assign(stat="mean", seed=None)
    frame = pd.concat([runs.assign(stat="run"), means], ignore_index=True)
    frame["seed"] = frame["seed"].astype("Int64")
    return frame[["stat"] + [c for c in frame.columns if c != "stat"]]


def literal_curve_model(preset: CostModel = EXERCISE2) -> CostModel:
    """The source's curve read literally: b = 0.086 ms per sequence whatever its context, instead of
    the preset's reading (b spread over the curve's 2,000 KV tokens, so a sequence costs what its own
    context holds)."""
    return replace(preset, decode_per_seq_s=preset.decode_per_ctx_token_s * CURVE_CONTEXT_TOKENS,
                   decode_per_ctx_token_s=0.0, name="exercise2_per_sequence")


def cap_sweep(traces, seeds, models: dict, caps, chunk, slo) -> tuple[pd.DataFrame, dict]:
    """The exercise's sweep under each reading of the curve ({reading: step-time model}): its table,
    and every run by (reading, cap) for the answers that look inside."""
    runs = {(reading, cap): [_run(trace, model, POLICY, cap, chunk) for trace in traces]
            for reading, model in models.items() for cap in caps}
    rows = [{"reading": reading, "max_num_seqs": cap, "seed": seed, **run_figures(result, slo)}
            for (reading, cap), results in runs.items() for seed, result in zip(seeds, results)]
    return with_means(rows, "max_num_seqs"), runs


def choose_cap(sweep: pd.DataFrame, reading: str) -> dict:
    """The best cap (highest mean goodput among caps stable on every seed: an unstable run has no
    goodput) and the recommended one: the smallest stable cap whose mean goodput reaches the best cap's
    worst seed. Within the seeds' spread a larger cap buys nothing measurable, and costs longer steps
    and more KV memory."""
    rows = sweep[sweep["reading"] == reading]
    means = rows[rows["stat"] == "mean"].set_index("max_num_seqs")
    stable = means[means["stable"].astype(bool) & means["goodput_rps"].notna()]
    caps = [int(c) for c in means.index]
    if stable.empty:
        return {"reading": reading, "best_cap": None, "recommended_cap": None, "stable_caps": [],
                "unstable_caps": caps}
    best = int(stable["goodput_rps"].astype(float).idxmax())
    seeds_at_best = rows[(rows["stat"] == "run") & (rows["max_num_seqs"] == best)]["goodput_rps"].astype(float)
    floor = float(seeds_at_best.min())
    recommended = int(min(c for c, g in stable["goodput_rps"].astype(float).items() if g >= floor))
    share = stable["attainment"].astype(float)
    return {"reading": reading, "best_cap": best, "recommended_cap": recommended,
            "best_goodput_rps": float(stable.loc[best, "goodput_rps"]),
            "best_seeds_goodput_rps": [floor, float(seeds_at_best.max())],
            "recommended_goodput_rps": float(stable.loc[recommended, "goodput_rps"]),
            "best_attainment": float(share[best]), "recommended_attainment": float(share[recommended]),
            "recommended_is_best": recommended == best,
            "stable_caps": [int(c) for c in stable.index],
            "unstable_caps": [c for c in caps if c not in set(int(x) for x in stable.index)],
            "smallest_stable_cap": int(min(stable.index))}


def picked_cap(choice: dict, caps) -> dict:
    """The cap every later answer and figure of the exercise uses: the reading's recommended cap; when no
    swept cap keeps up there is none to recommend, and the answers study the largest swept cap instead."""
    if choice["recommended_cap"] is not None:
        return {"picked_cap": choice["recommended_cap"], "basis": "recommended", "reading": choice["reading"]}
    return {"picked_cap": max(caps), "basis": "largest_swept_none_keeps_up", "reading": choice["reading"]}


def _means(sweep: pd.DataFrame) -> pd.DataFrame:
    return sweep[sweep["stat"] == "mean"]


def chunk_sweep(traces, seeds, cost, cap, chunks, slo) -> pd.DataFrame:
    rows = [{"chunk_size": chunk, "seed": seed, "max_num_seqs": cap,
             **run_figures(_run(trace, cost, POLICY, cap, chunk, record_tokens=True), slo)}
            for chunk in chunks for seed, trace in zip(seeds, traces)]
    return with_means(rows, "chunk_size")


def step_log(trace: Trace, cost: CostModel, policy: str, cap: int, chunk: int) -> pd.DataFrame:
    """Every engine step of one run (the simulator's own step recorder): each step's batch, prefill
    tokens and time, which the summary of a run does not keep."""
    return simulate(trace, cost, policy, cap, chunk, None, BLOCK_SIZE, HORIZON_FACTOR, record_steps=True).step_table


# -- the answers -------------------------------------------------------------------------------------

def prefill_load(traces, cfg: dict, cost: CostModel) -> dict:
    """Share of every second a single engine must spend computing prompts at the offered rate, for
    the simulated traces and for the exercise's nominal prompt length."""
    mean_prompt = float(np.mean([t.prompt_tokens.mean() for t in traces]))
    prefill_s = float(np.mean([np.mean([cost.prefill_time(int(p)) for p in t.prompt_tokens]) for t in traces]))
    nominal_prompt = workload.EXERCISE2["prompt"]["mean"]
    return {
        "rate_rps": float(cfg["rate"]),
        "mean_prompt_tokens": mean_prompt,
        "prefill_ms_per_request": prefill_s * 1e3,
        "prefill_fraction": float(cfg["rate"]) * prefill_s,
        "nominal_prompt_tokens": nominal_prompt,
        "nominal_prefill_ms": cost.prefill_time(nominal_prompt) * 1e3,
        "nominal_prefill_fraction": float(cfg["rate"]) * cost.prefill_time(nominal_prompt),
    }


def decode_load(traces, rate: float) -> dict:
    """Decode tokens per second the load demands and the mean KV context each of them reads: a
    request with prompt p and N output tokens decodes tokens 2..N at contexts p+1 .. p+N-1."""
    decode_tokens = np.concatenate([np.maximum(t.output_tokens - 1, 0) for t in traces]).astype(float)
    prompts = np.concatenate([t.prompt_tokens for t in traces]).astype(float)
    ctx_read = decode_tokens * prompts + decode_tokens * (decode_tokens + 1) / 2
    return {"decode_tokens_per_s": rate * float(decode_tokens.mean()),
            "mean_decode_context": float(ctx_read.sum() / decode_tokens.sum())}


def tpot_floor_ms(cost: CostModel, rate: float, prefill_s_per_request: float, traces) -> float | None:
    """The least mean time between decode steps a fully busy engine can sustain at `rate`, whatever
    the cap: per second, steps * a + (KV tokens read) * c + prefill = 1, and one step emits one
    token per decoding sequence. None when prefill and KV reads alone fill the second."""
    load = decode_load(traces, rate)
    kv_share = cost.decode_per_ctx_token_s * load["decode_tokens_per_s"] * load["mean_decode_context"]
    per_seq_share = cost.decode_per_seq_s * load["decode_tokens_per_s"]
    spare = 1.0 - rate * prefill_s_per_request - kv_share - per_seq_share
    return cost.decode_fixed_s / spare * 1e3 if spare > 0 else None


def _spread(values) -> dict:
    v = np.asarray(values, dtype=float)
    v = v[np.isfinite(v)]
    return {"mean": finite_or_none(v.mean()) if v.size else None,
            **{f"p{q}": finite_or_none(np.percentile(v, q)) if v.size else None for q in PERCENTILES}}


def cell_summary(results, slo) -> dict:
    """Mean over seeds of one configuration's figures; None where undefined (an unstable run)."""
    means = over_seeds(pd.DataFrame([run_figures(r, slo) for r in results]).assign(cell=0), ["cell"])
    return {k: (None if isinstance(v, float) and math.isnan(v) else v)
            for k, v in means.drop(columns=["cell", "seeds"]).iloc[0].to_dict().items()}


def queueing(results) -> dict:
    waits = np.concatenate([per_request(r)["queue_s"].to_numpy() for r in results]) * 1e3
    ttft = np.concatenate([per_request(r)["ttft_s"].to_numpy() for r in results]) * 1e3
    if not all(r.stable for r in results):
        return {"stable": False}
    return {"stable": True, "queue_ms": _spread(waits), "ttft_ms": _spread(ttft),
            "queue_share_of_mean_ttft": finite_or_none(np.nanmean(waits) / np.nanmean(ttft))}


def tpot_spread(results, budget_ms: float) -> dict:
    frames = [per_request(r) for r in results]
    tpot = np.concatenate([f["tpot_s"].to_numpy() for f in frames]) * 1e3
    tpot = tpot[np.isfinite(tpot)]
    if not all(r.stable for r in results):
        return {"stable": False, "budget_ms": budget_ms}
    return {"stable": True, "per_request_tpot_ms": _spread(tpot),
            "share_above_budget": float(np.mean(tpot > budget_ms)),
            "budget_ms": budget_ms,
            "p95_over_mean": float(np.percentile(tpot, 95) / tpot.mean())}


def prefill_interference(steps: pd.DataFrame) -> dict:
    with_chunk = steps["prefill_tokens"] > 0
    decoding = steps["batch"] > 0
    carrying = with_chunk & decoding
    plain = ~with_chunk & decoding
    return {
        "steps": int(len(steps)),
        "share_of_steps_with_prefill": float(with_chunk.mean()),
        "share_of_busy_time_in_prefill_steps": float(steps["duration_s"][with_chunk].sum() / steps["duration_s"].sum()),
        "mean_step_ms_with_prefill": finite_or_none(steps["duration_s"][carrying].mean() * 1e3),
        "mean_step_ms_decode_only": finite_or_none(steps["duration_s"][plain].mean() * 1e3),
        "mean_added_ms_by_prefill": finite_or_none((steps["duration_s"] - steps["decode_s"])[carrying].mean() * 1e3),
        "mean_prefill_tokens_per_carrying_step": finite_or_none(steps["prefill_tokens"][with_chunk].mean()),
        "mean_step_ms_seen_by_decodes": finite_or_none(np.average(steps["duration_s"][decoding],
                                                           weights=steps["batch"][decoding]) * 1e3),
    }


def context_growth(traces, steps: pd.DataFrame, cost: CostModel, naive: dict) -> dict:
    """The contexts decodes really read, against the curve's fixed per-sequence context."""
    prompts = np.concatenate([t.prompt_tokens for t in traces]).astype(float)
    outputs = np.concatenate([t.output_tokens for t in traces]).astype(float)
    decoding = steps[steps["batch"] > 0]
    per_sequence_ctx = float(decoding["ctx_sum"].sum() / decoding["batch"].sum())
    cap, budget_ms = naive["b_max"], naive["tpot_budget_ms"]

    def step_ms(ctx):
        return cost.decode_time(cap, cap * ctx, ctx) * 1e3

    per_seq_ms = (cost.decode_per_seq_s + cost.decode_per_ctx_token_s * per_sequence_ctx) * 1e3
    return {
        "mean_context_at_first_decode": float(np.mean(prompts + 1)),
        "mean_context_at_completion": float(np.mean(prompts + outputs)),
        "p99_context_at_completion": float(np.percentile(prompts + outputs, 99)),
        "mean_context_per_decoding_sequence": per_sequence_ctx,
        "mean_context_per_decode_token_of_trace": decode_load(traces, 1.0)["mean_decode_context"],
        "curve_context": CURVE_CONTEXT_TOKENS,
        "naive_cap": cap,
        "step_ms_at_naive_cap_curve": naive["step_ms_at_b_max"],
        "step_ms_at_naive_cap_first_decode_context": step_ms(float(np.mean(prompts + 1))),
        "step_ms_at_naive_cap_completion_context": step_ms(float(np.mean(prompts + outputs))),
        "step_ms_at_naive_cap_simulated_context": step_ms(per_sequence_ctx),
        "cap_within_budget_at_simulated_context": largest_batch_within(cost.decode_fixed_s * 1e3, per_seq_ms,
                                                                       budget_ms),
        "mean_decode_batch": float(decoding["batch"].mean()),
        "simulated_context_cheaper": bool(step_ms(per_sequence_ctx) < naive["step_ms_at_b_max"]),
    }


def raw_goodput_peak(sweep: pd.DataFrame, reading: str) -> dict:
    """The cap a naive reading of the sweep would pick: the most good requests per second in any single
    run, stable or not. When that run is unstable its goodput is an artefact of the trace's length (the
    queue keeps growing), which is why the recommendation only compares caps that keep up."""
    runs = sweep[(sweep["reading"] == reading) & (sweep["stat"] == "run")].dropna(subset=["goodput_rps"])
    if runs.empty:
        return {"raw_peak_cap": None, "raw_peak_cap_unstable": None}
    peak = runs.loc[runs["goodput_rps"].astype(float).idxmax()]
    return {"raw_peak_cap": int(peak["max_num_seqs"]), "raw_peak_cap_unstable": not bool(peak["stable"])}


def pick_chunk(chunks: pd.DataFrame, itl_bound_ms: float) -> dict:
    """The largest swept chunk whose mean p99 inter-token gap meets the bound, and the largest that
    also keeps the engine stable (small chunks cap the prompt tokens per step and starve prefill)."""
    means = _means(chunks).sort_values("chunk_size")
    meets = means[means["itl_ms_p99"].notna() & (means["itl_ms_p99"].astype(float) <= itl_bound_ms)]
    meets_stable = meets[meets["stable"].astype(bool)]
    stable = means[means["stable"].astype(bool) & means["itl_ms_p99"].notna()]
    if len(meets_stable):
        chosen, basis = int(meets_stable["chunk_size"].max()), "meets_bound"
    elif len(stable):
        chosen, basis = int(stable.loc[stable["itl_ms_p99"].astype(float).idxmin(), "chunk_size"]), "smallest_gap"
    else:
        chosen, basis = None, "none_stable"
    return {
        "chosen_chunk": chosen, "chosen_chunk_basis": basis,
        "chunk_for_itl_bound": int(meets["chunk_size"].max()) if len(meets) else None,
        "chunk_for_itl_bound_and_stable": int(meets_stable["chunk_size"].max()) if len(meets_stable) else None,
        "per_chunk": [{"chunk_size": int(r.chunk_size), "itl_ms_p99": finite_or_none(r.itl_ms_p99),
                       "itl_ms_max": finite_or_none(r.itl_ms_max), "attainment": finite_or_none(r.attainment),
                       "stable": bool(r.stable)} for r in means.itertuples()],
    }


def run(cfg: dict, master_seed: int, cost: CostModel = EXERCISE2) -> Exercise2Outputs:
    """Every answer of the exercise from its config section (`exercise2`) and the master seed."""
    slo = exercise_slo(cfg)
    budget_ms = float(cfg["slo_tpot_ms"])
    seeds = derived_seeds(master_seed, int(cfg["seeds"]))
    spec = exercise_workload(cfg)
    traces = [workload.generate(spec, seed) for seed in seeds]
    chunk = int(cfg["chunk_size"])
    caps = sorted(int(c) for c in cfg["sweep_caps"])
    chunk_sizes = sorted(int(c) for c in cfg["chunk_sizes"])

    curve = curve_frame(cost)
    fit = read_curve(curve, cost)
    naive = naive_cap_answer(fit, budget_ms)
    models = {"per_kv_token": cost, "per_sequence": literal_curve_model(cost)}
    sweep, runs = cap_sweep(traces, seeds, models, caps, chunk, slo)
    readings = {reading: {**choose_cap(sweep, reading), **raw_goodput_peak(sweep, reading)} for reading in models}
    by_cap = _means(sweep[sweep["reading"] == ANSWER_READING]).set_index("max_num_seqs")
    runs_by_cap = {cap: results for (reading, cap), results in runs.items() if reading == ANSWER_READING}
    pick = picked_cap(readings[ANSWER_READING], caps)
    cap = pick["picked_cap"]
    naive_runs = [_run(t, cost, POLICY, naive["b_max"], chunk) for t in traces]
    naive_cell = {"cap": naive["b_max"], **cell_summary(naive_runs, slo)}
    chunks = chunk_sweep(traces, seeds, cost, cap, chunk_sizes, slo)
    load = prefill_load(traces, cfg, cost)
    steps_naive = step_log(traces[0], cost, POLICY, naive["b_max"], chunk)
    steps_picked = step_log(traces[0], cost, POLICY, cap, chunk)

    answers = {
        "inputs": {
            "cost_model": cost.to_dict(), "workload": spec, "seeds": seeds, "policy": POLICY,
            "slo": {"ttft_ms": slo.ttft_ms, "ttft_percentile": slo.ttft_percentile,
                    "tpot_ms": slo.tpot_ms, "tpot_percentile": slo.tpot_percentile},
            "chunk_size": chunk, "sweep_caps": caps, "chunk_sizes": chunk_sizes,
            "kv_blocks": None, "block_size": BLOCK_SIZE, "horizon_factor": HORIZON_FACTOR,
            "step_log_seed": seeds[0], "share_meeting_slo": SHARE_MEETING_SLO, "answer_reading": ANSWER_READING,
        },
        "pick": pick,
        "2.1": fit,
        "2.2": naive,
        "2.3": spend_ttft_budget(traces, cost, cap, chunk, slo, load, chunks, steps_picked, budget_ms),
        "2.4": {**predict_then_check(fit, naive, by_cap, pick, readings[ANSWER_READING], caps[-1], naive_cell,
                                     load, cfg),
                "readings": readings, "recommended_cap": readings[ANSWER_READING]["recommended_cap"]},
        "2.5": explain_gap(traces, cost, naive, cap, runs_by_cap[cap], naive_runs, steps_naive,
                           steps_picked, budget_ms, readings[ANSWER_READING], load),
        "2.6": next_lever(traces, cost, by_cap, naive_cell, cap, chunk, slo, load, cfg),
    }
    return Exercise2Outputs(answers, sweep, chunks, curve)


def spend_ttft_budget(traces, cost, cap, chunk, slo, load, chunks, steps, budget_ms) -> dict:
    """2.3: prefill load, whole versus chunked prefill at the picked cap, and a chunk for an ITL bound."""
    whole = cell_summary([_run(t, cost, "continuous", cap, chunk, record_tokens=True) for t in traces], slo)
    chunked = cell_summary([_run(t, cost, POLICY, cap, chunk, record_tokens=True) for t in traces], slo)
    # the question moves the SLO from mean TPOT to the p99 gap; the budget itself stays what product set
    itl_bound_ms = budget_ms
    decode_steps = steps[steps["batch"] > 0]
    return {
        "prefill_load": load,
        "chunks_per_nominal_prompt": math.ceil(load["nominal_prompt_tokens"] / chunk),
        "at_cap": cap,
        "whole_prefill": {"policy": "continuous", **whole},
        "chunked_prefill": {"policy": POLICY, "chunk_size": chunk, **chunked},
        "ttft_p95_ratio_chunked_over_whole": _ratio(chunked["ttft_ms_p95"], whole["ttft_ms_p95"]),
        "chunking_raises_ttft": _raises(chunked["ttft_ms_p95"], whole["ttft_ms_p95"]),
        "itl_p99_ratio_chunked_over_whole": _ratio(chunked["itl_ms_p99"], whole["itl_ms_p99"]),
        "itl_max_ratio_chunked_over_whole": _ratio(chunked["itl_ms_max"], whole["itl_ms_max"]),
        "itl_bound_ms": itl_bound_ms, "itl_bound_percentile": 99.0,
        "itl_bound_basis": "the TPOT budget, applied to the p99 inter-token gap instead of the p95 TPOT",
        "mean_decode_step_ms": float(decode_steps["decode_s"].mean() * 1e3),
        "chunk_fitting_beside_mean_decode_step": _chunk_fitting(cost, itl_bound_ms,
                                                                decode_steps["decode_s"].mean() * 1e3),
        **pick_chunk(chunks, itl_bound_ms),
    }


def predict_then_check(fit, naive, by_cap, pick, choice, largest_cap, naive_cell, load, cfg) -> dict:
    """2.4: what the curve alone predicts, and what the sweep shows. The prediction (b) is checked at the
    predicted cap itself (the curve's cap, simulated); `attainment` is the share of requests meeting the
    SLO (SHARE_MEETING_SLO)."""
    a, b = fit["least_squares"]["a_ms"], fit["least_squares"]["b_ms"]
    best_cap, cap = choice["best_cap"], pick["picked_cap"]
    budget_ms = naive["tpot_budget_ms"]
    goodput = by_cap["goodput_rps"].astype(float)
    # the curve alone says every token of every request costs t_step(cap), and TTFT one prefill
    curve_says_all_good = a + b * naive["b_max"] <= budget_ms and load["nominal_prefill_ms"] <= cfg["slo_ttft_ms"]

    def by(column):
        return {int(c): finite_or_none(v) for c, v in by_cap[column].items()}

    def at(c):
        return {"cap": c, "stable": bool(by_cap["stable"][c]), "goodput_rps": finite_or_none(goodput[c]),
                "attainment": finite_or_none(by_cap["attainment"][c])}

    predicted = naive_cell["attainment"]
    return {
        "best_cap": best_cap, "picked_cap": cap, "largest_cap": largest_cap, "naive_cap": naive["b_max"],
        "goodput_rps_by_cap": by("goodput_rps"),
        "attainment_by_cap": by("attainment"),
        "stable_by_cap": {int(c): bool(v) for c, v in by_cap["stable"].items()},
        "at_best_cap": at(best_cap) if best_cap is not None else None,
        "at_picked_cap": at(cap),
        "at_largest_cap": at(largest_cap),
        "at_naive_cap": naive_cell,
        "prediction_from_curve": {
            "cap": naive["b_max"], "step_ms_at_cap": a + b * naive["b_max"],
            "attainment": float(curve_says_all_good),
            "step_ms_at_largest_cap": a + b * largest_cap,
            "largest_cap_meets_tpot": bool(a + b * largest_cap <= budget_ms),
        },
        "choices": list(PREDICTION_CHOICES),
        # (b) checked where it was predicted: the share meeting the SLO at the curve's cap; none when its
        # queue grows (an unstable run has no share)
        "prediction_check": {"cap": naive["b_max"], "stable": bool(naive_cell["stable"]), "attainment": predicted,
                             "closest_choice": (None if predicted is None else
                                                min(PREDICTION_CHOICES, key=lambda c: abs(c - predicted)))},
        "goodput_falls_from_picked_to_largest_cap": _falls(goodput[largest_cap], goodput[cap]),
        "picked_cap_below_naive_cap": cap < naive["b_max"],
    }


def explain_gap(traces, cost, naive, cap, picked_runs, naive_runs, steps_naive, steps_picked,
                budget_ms, choice: dict, load: dict) -> dict:
    """2.5: what decides the cap on this workload first (which caps keep up with the load at all:
    prefill's share of every second and the decode batch the load needs), then the four effects the
    static curve leaves out, each measured at the picked cap and at the curve's."""
    naive_cap = naive["b_max"]
    decoding = steps_picked[steps_picked["batch"] > 0]
    below = [c for c in choice["unstable_caps"] if choice["stable_caps"] and c < min(choice["stable_caps"])]
    return {
        "keep_up": {"unstable_caps": choice["unstable_caps"], "largest_cap_that_falls_behind": max(below, default=None),
                    "smallest_cap_that_keeps_up": min(choice["stable_caps"], default=None),
                    "prefill_fraction": load["prefill_fraction"], "rate_rps": load["rate_rps"],
                    "mean_decode_batch_at_picked_cap": float(decoding["batch"].mean()) if len(decoding) else None,
                    "picked_cap": cap},
        "queueing_delay": {"picked_cap": {"cap": cap, **queueing(picked_runs)},
                           "naive_cap": {"cap": naive_cap, **queueing(naive_runs)}},
        "tpot_spread": {"naive_cap": {"cap": naive_cap, **tpot_spread(naive_runs, budget_ms)},
                        "picked_cap": {"cap": cap, **tpot_spread(picked_runs, budget_ms)}},
        "prefill_interference": {"naive_cap": {"cap": naive_cap, **prefill_interference(steps_naive)},
                                 "picked_cap": {"cap": cap, **prefill_interference(steps_picked)}},
        "context_growth": context_growth(traces[:1], steps_naive, cost, naive),
    }


def next_lever(traces, cost, by_cap, naive_cell, cap, chunk, slo, load, cfg) -> dict:
    """2.6: the share meeting the SLO at the picked cap, how far the knob goes at all (every swept cap and
    the naive one), and what one more replica does at the same offered rate and the same picked cap."""
    rate = float(cfg["rate"])
    # only caps that keep up have an attainment to compare
    attainment = {int(c): float(v) for c, v in by_cap["attainment"].items() if pd.notna(v)}
    if naive_cell["attainment"] is not None:
        attainment[naive_cell["cap"]] = naive_cell["attainment"]
    stable = [int(c) for c, s in by_cap["stable"].items() if s]
    fleet = {router: cell_summary([simulate_fleet(t, cost, POLICY, cap, chunk, None, BLOCK_SIZE,
                                                  HORIZON_FACTOR, EXTRA_CAPACITY_REPLICAS, router)
                                   for t in traces], slo)
             for router in ROUTERS}
    best_router = max(fleet, key=lambda r: (fleet[r]["attainment"] is not None, fleet[r]["attainment"] or 0.0, r))
    prefill_s = load["prefill_ms_per_request"] / 1e3
    floor_ms = tpot_floor_ms(cost, rate, prefill_s, traces)
    return {
        "picked_cap": cap,
        "attainment_at_picked_cap": attainment.get(cap),
        "best_attainment_over_caps": max(attainment.values(), default=None),
        "cap_of_best_attainment": max(attainment, key=attainment.get) if attainment else None,
        "attainment_over_stable_swept_caps": _range([attainment[c] for c in stable]),
        "prefill_fraction": load["prefill_fraction"],
        "tpot_floor_ms_any_cap": floor_ms,
        "tpot_floor_state": "no_room" if floor_ms is None else (
            "above_budget" if floor_ms > float(cfg["slo_tpot_ms"]) else "within_budget"),
        "tpot_budget_ms": float(cfg["slo_tpot_ms"]),
        "replicas": EXTRA_CAPACITY_REPLICAS,
        "prefill_fraction_per_replica": load["prefill_fraction"] / EXTRA_CAPACITY_REPLICAS,
        "tpot_floor_ms_per_replica": tpot_floor_ms(cost, rate / EXTRA_CAPACITY_REPLICAS, prefill_s, traces),
        "fleet_cap": cap,
        "fleet_by_router": fleet,
        "fleet_best_router": best_router,
        "fleet_attainment": fleet[best_router]["attainment"],
    }


def _falls(x, y) -> bool | None:
    """Whether x is below y; None when either is undefined (an unstable run has no goodput)."""
    return None if pd.isna(x) or pd.isna(y) else bool(x < y)


def _raises(x, y) -> bool | None:
    """Whether x is above y; None when either is undefined (an unstable run)."""
    return None if x is None or y is None else bool(x > y)


def _ratio(x, y):
    return finite_or_none(x / y) if x is not None and y else None


def _range(values) -> dict:
    v = np.asarray(values, dtype=float)
    return {"min": finite_or_none(v.min()), "max": finite_or_none(v.max())} if v.size else {"min": None, "max": None}


def _chunk_fitting(cost: CostModel, bound_ms: float, decode_ms: float) -> int | None:
    """Largest prefill chunk whose fixed and per-token cost, added to a mean decode step, stays within
    the ITL bound; the cost model's terms in cached tokens are left out (a first chunk has none)."""
    spare_s = (bound_ms - decode_ms) / 1e3 - cost.prefill_fixed_s
    if spare_s < 0 or cost.prefill_per_token_s <= 0:
        return None
    return int(spare_s // cost.prefill_per_token_s)
