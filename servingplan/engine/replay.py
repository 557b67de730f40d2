"""Replay a trace on the real engine and set it against a simulation of the same trace.

    replay(trace, model, policy, max_num_seqs, chunk_size, ...) -> (SimResult, steps DataFrame)
    compare(measured, simulated) -> DataFrame   metric, stat, n, measured_ms, measured_lo_ms,
                                                measured_hi_ms, simulated_ms, diff_pct
    request_pairs(measured, simulated) -> DataFrame   per request, for scatter plots
    predict_steps(steps, cost) -> DataFrame     the replay's steps with the cost model's time for each

The metrics are servingplan.simulate.metrics' (TTFT = f - a, TPOT = (c - f)/(N - 1) for N >= 2, E2E = c - a,
linear percentiles). compare() uses only the requests that finished in both runs, so the two sides
describe the same population; diff_pct is (simulated - measured) / measured, the cost model's error.
measured_lo_ms and measured_hi_ms bound a bootstrap 90% interval of each measured statistic
(scipy.stats.bootstrap, bias-corrected and accelerated, BOOTSTRAP_RESAMPLES resamples of the requests,
seeded): a p90 over 40 requests is itself uncertain, and a simulated value inside that interval agrees
with the measurement as far as the trace can tell. BCa corrects the percentile interval's bias and
skew, which for a tail percentile of a few dozen requests is large.
"""
from __future__ import annotations

import warnings

import numpy as np
import pandas as pd
from scipy import stats

from servingplan.costmodel import CostModel
from servingplan.engine.engine import DEFAULT_MAX_WALL_S, Engine
from servingplan.simulate.metrics import per_request, percentile
from servingplan.simulate.policies import DEFAULT_CHUNK_BUDGET
from servingplan.simulate.simulator import SimResult
from servingplan.simulate.workload import Trace

METRICS = ("ttft", "tpot", "e2e")
STATS = ("mean", "p50", "p90", "p99")
BOOTSTRAP_RESAMPLES = 2000
BOOTSTRAP_SEED = 0


def replay(trace: Trace, model, policy: str, max_num_seqs: int, chunk_size: int = 512,
           kv_blocks: int | None = None, block_size: int = 16, max_wall_s: float = DEFAULT_MAX_WALL_S,
           seed: int = 0, threads: int | None = None,
           chunk_budget: str = DEFAULT_CHUNK_BUDGET) -> tuple[SimResult, pd.DataFrame]:
    """Serve `trace` in real time on `model` (a loaded GPT-2, see profile.model.load_model).
    The SimResult's meta holds "errors" ({request id: reason}) and "unfinished" (ids cut off by
    max_wall_s); the steps frame has servingplan.simulate.steps.STEP_COLUMNS, then the engine's
    ENGINE_STEP_COLUMNS."""
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
    """The BCa bootstrap interval at `level` of `stat` over resamples of `values` with replacement,
    seeded (BOOTSTRAP_SEED), so the same values give the same interval. Values that cannot vary (one
    request, or all equal) have nothing to resample: the interval is the value itself. Where BCa has no
    answer (its bias correction is infinite when every resample lies on one side of the estimate, as
    for a percentile sitting on a run of ties) the plain percentile interval is given."""
    values = np.asarray(values, dtype=float)
    if values.size < 2 or np.all(values == values[0]):
        value = float(statistic(values, stat))
        return value, value
    for method in ("BCa", "percentile"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", stats.DegenerateDataWarning)
            found = stats.bootstrap((values,), lambda sample, axis: statistic(sample, stat, axis=axis),
                                    vectorized=True, n_resamples=BOOTSTRAP_RESAMPLES, confidence_level=level,
                                    method=method, rng=np.random.default_rng(BOOTSTRAP_SEED)).confidence_interval
        if np.isfinite(found.low) and np.isfinite(found.high):
            break
    return float(found.low), float(found.high)


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
