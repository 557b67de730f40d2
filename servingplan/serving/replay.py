"""Replay a trace on the real engine and set it against a simulation of the same trace.

    replay(trace, model, policy, max_num_seqs, chunk_size, ...) -> (SimResult, steps DataFrame)
    compare(measured, simulated) -> DataFrame   metric, stat, n, measured_ms, measured_lo_ms,
                                                measured_hi_ms, simulated_ms, diff_pct
    request_pairs(measured, simulated) -> DataFrame   per request, for scatter plots
    predict_steps(steps, cost) -> DataFrame     the replay's steps with the cost model's time for each

The metrics are servingplan.metrics' (TTFT = f - a, TPOT = (c - f)/(N - 1) for N >= 2, E2E = c - a,
linear percentiles). compare() uses only the requests that finished in both runs, so the two sides
describe the same population; diff_pct is (simulated - measured) / measured, the cost model's error.
measured_lo_ms and measured_hi_ms bound a bootstrap 90% interval of each measured statistic
(BOOTSTRAP_RESAMPLES resamples of the requests, seeded): a p90 over 40 requests is itself uncertain,
and a simulated value inside that interval agrees with the measurement as far as the trace can tell.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from servingplan.costmodel import CostModel
from servingplan.metrics import per_request, percentile
from servingplan.serving.engine import DEFAULT_MAX_WALL_S, Engine
from servingplan.sim.policies import DEFAULT_CHUNK_BUDGET
from servingplan.sim.simulator import SimResult
from servingplan.workload import Trace

METRICS = ("ttft", "tpot", "e2e")
STATS = ("mean", "p50", "p90", "p99")
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


def replay(trace: Trace, model, policy: str, max_num_seqs: int, chunk_size: int = 512,
           kv_blocks: int | None = None, block_size: int = 16, max_wall_s: float = DEFAULT_MAX_WALL_S,
           seed: int = 0, threads: int | None = None,
           chunk_budget: str = DEFAULT_CHUNK_BUDGET) -> tuple[SimResult, pd.DataFrame]:
    """Serve `trace` in real time on `model` (a loaded GPT-2, see profiling.model.load_model).
    The SimResult's meta holds "errors" ({request id: reason}) and "unfinished" (ids cut off by
    max_wall_s); the steps frame has servingplan.serving.engine.STEP_COLUMNS."""
    run = Engine(model, policy, max_num_seqs, chunk_size, kv_blocks, block_size, threads, chunk_budget).run(
        trace, max_wall_s, seed)
    return run.result, run.steps


def _same_trace(measured: SimResult, simulated: SimResult) -> None:
    if not (np.array_equal(measured.prompt_tokens, simulated.prompt_tokens)
            and np.array_equal(measured.output_tokens, simulated.output_tokens)):
        raise ValueError("compare: the two runs served different traces")


def statistic(values: np.ndarray, stat: str, axis=None):
    if stat == "mean":
        return np.mean(values, axis=axis)
    return np.percentile(values, float(stat[1:]), axis=axis)


def bootstrap_interval(values: np.ndarray, stat: str, level: float = 0.90) -> tuple[float, float]:
    """The central `level` interval of `stat` over resamples of `values` with replacement."""
    rng = np.random.default_rng(BOOTSTRAP_SEED)
    resampled = values[rng.integers(len(values), size=(BOOTSTRAP_RESAMPLES, len(values)))]
    estimates = statistic(resampled, stat, axis=1)
    tail = 100 * (1 - level) / 2
    return float(np.percentile(estimates, tail)), float(np.percentile(estimates, 100 - tail))


def compare(measured: SimResult, simulated: SimResult) -> pd.DataFrame:
    """TTFT, TPOT and E2E (ms) of the requests finished in both runs: mean, p50, p90, p99, with a
    bootstrap 90% interval around each measured value."""
    _same_trace(measured, simulated)
    mine, theirs = per_request(measured), per_request(simulated)
    both = mine["finished"].to_numpy() & theirs["finished"].to_numpy()
    rows = []
    for metric in METRICS:
        column = f"{metric}_s"
        pairs = pd.DataFrame({"a": mine.loc[both, column], "b": theirs.loc[both, column]}).dropna()
        a, b = pairs["a"].to_numpy() * 1e3, pairs["b"].to_numpy() * 1e3
        for stat in STATS:
            if a.size == 0:
                m = s = lo = hi = np.nan
            else:
                m = float(statistic(a, stat)) if stat == "mean" else percentile(a, float(stat[1:]))
                s = float(statistic(b, stat)) if stat == "mean" else percentile(b, float(stat[1:]))
                lo, hi = bootstrap_interval(a, stat)
            rows.append({"metric": metric, "stat": stat, "n": int(a.size), "measured_ms": m,
                         "measured_lo_ms": lo, "measured_hi_ms": hi, "simulated_ms": s,
                         "diff_pct": 100.0 * (s - m) / m if m else np.nan})
    return pd.DataFrame(rows)


def request_pairs(measured: SimResult, simulated: SimResult) -> pd.DataFrame:
    """One row per request: id, its shape, and measured vs simulated TTFT and E2E (ms, NaN where
    that run never got there)."""
    _same_trace(measured, simulated)
    mine, theirs = per_request(measured), per_request(simulated)
    return pd.DataFrame({
        "id": mine["id"], "prompt_tokens": mine["prompt_tokens"], "output_tokens": mine["output_tokens"],
        "measured_ttft_ms": mine["ttft_s"] * 1e3, "simulated_ttft_ms": theirs["ttft_s"] * 1e3,
        "measured_e2e_ms": mine["e2e_s"] * 1e3, "simulated_e2e_ms": theirs["e2e_s"] * 1e3,
        "finished_both": mine["finished"] & theirs["finished"],
    })


def predict_steps(steps: pd.DataFrame, cost: CostModel) -> pd.DataFrame:
    """The replay's steps with the cost model's time for each (predicted_s) and its error
    (error_pct = (predicted - measured) / measured), to split the run-level gap per step."""
    predicted = [cost.step_time(row.batch, row.ctx_sum, row.prefill_calls, row.ctx_max)
                 for row in steps.itertuples()]
    out = steps.copy()
    out["predicted_s"] = predicted
    out["error_pct"] = 100.0 * (out["predicted_s"] - out["duration_s"]) / out["duration_s"]
    return out
