"""Serving metrics of a simulation, defined as vLLM's benchmarks/serve.py defines them.

Per request with arrival a, first token f, completion c and N output tokens:
TTFT = f - a (queueing included), TPOT = (c - f) / (N - 1) for N >= 2, E2E = c - a, and ITL is
every gap between consecutive tokens. Percentiles use numpy's linear interpolation.

A request that did not finish (the run hit its horizon, or it could never fit in the KV cache)
is not good, and its TTFT / TPOT / E2E count as infinite: a percentile that falls among such
requests is infinite, reported as None, never as a large finite number that looks like a latency.
ITL percentiles pool the gaps that were observed; a truncated run (flagged `truncated`) never
observed the gaps of its unfinished requests, so there they are a lower bound.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from itertools import chain

import numpy as np

from servingplan.simulate.misses import MissLimit
from servingplan.simulate.simulator import SimResult
from servingplan.simulate.workload import mean_rate

PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class SLO:
    """Latency targets; a metric whose bound is None is not constrained.

    A request is good when its TTFT <= ttft_ms, its TPOT <= tpot_ms, the itl_percentile-th
    percentile of its own inter-token gaps <= itl_ms, and its E2E latency <= e2el_ms. The aggregate
    SLO holds when, for each bound, the given percentile of the metric over the run is within it (for
    ITL: over all gaps).
    """
    ttft_ms: float | None = None
    ttft_percentile: float = 95.0
    tpot_ms: float | None = None
    tpot_percentile: float = 95.0
    itl_ms: float | None = None
    itl_percentile: float = 99.0
    e2el_ms: float | None = None
    e2el_percentile: float = 95.0

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_percentile"):
                if not 0.0 <= value <= 100.0:
                    raise ValueError(f"SLO {f.name}={value}: must lie in [0, 100]")
            elif value is not None and not value > 0:
                raise ValueError(f"SLO {f.name}={value}: must be > 0 (or None for no bound)")


def percentile(values, q: float) -> float:
    """numpy's linear-interpolation percentile that lets +inf through: inf whenever the q-th
    percentile touches an infinite value, NaN for no values at all."""
    return _sorted_percentile(np.sort(np.asarray(values, dtype=float)), q)


def _sorted_percentile(v: np.ndarray, q: float) -> float:
    """`percentile` of values already sorted ascending."""
    if v.size == 0:
        return math.nan
    position = q / 100.0 * (v.size - 1)
    lo = math.floor(position)
    hi = min(lo + 1, v.size - 1)
    fraction = position - lo
    if fraction == 0.0 or hi == lo:
        return float(v[lo])
    if math.isinf(v[hi]):
        return math.inf
    return float(np.percentile(v, q))


# Requests whose token times are expanded at once: the expansion needs ~60 bytes per token, so the
# gaps are computed in blocks and only the gaps themselves (8 bytes each) are kept.
GAP_BLOCK_REQUESTS = 1024


def _token_grid(token_spans: list) -> tuple[np.ndarray, np.ndarray]:
    """(request index within `token_spans`, emission time) of every token, request-major and in time order."""
    spans_per_request = np.fromiter((len(s) for s in token_spans), dtype=np.int64, count=len(token_spans))
    spans = np.fromiter(chain.from_iterable(chain.from_iterable(token_spans)), dtype=float,
                        count=4 * int(spans_per_request.sum())).reshape(-1, 4)
    start, k, d0, dd = spans[:, 0], spans[:, 1].astype(np.int64), spans[:, 2], spans[:, 3]
    span_of_token = np.repeat(np.arange(len(spans)), k)
    # j = 1..k within each span: a global counter minus the span's offset
    first_token_of_span = np.cumsum(k) - k
    j = (np.arange(span_of_token.size) - first_token_of_span[span_of_token] + 1).astype(float)
    times = start[span_of_token] + j * d0[span_of_token] + dd[span_of_token] * j * (j - 1) / 2
    request_of_span = np.repeat(np.arange(len(token_spans)), spans_per_request)
    return request_of_span[span_of_token], times


def _own_percentile(request: np.ndarray, gaps: np.ndarray, n: int, q: float) -> np.ndarray:
    """The q-th percentile of each of n requests' own gaps; NaN for a request with no gap."""
    out = np.full(n, np.nan)
    if gaps.size == 0:
        return out
    order = np.lexsort((gaps, request))
    request, gaps = request[order], gaps[order]
    counts = np.bincount(request, minlength=n)
    offsets = np.cumsum(counts) - counts
    has_gaps = counts > 0
    position = q / 100.0 * (counts[has_gaps] - 1)
    lo = np.floor(position).astype(np.int64)
    hi = np.minimum(lo + 1, counts[has_gaps] - 1)
    base = offsets[has_gaps]
    below, above = gaps[base + lo], gaps[base + hi]
    out[has_gaps] = below + (above - below) * (position - lo)
    return out


def inter_token_gaps(result: SimResult, q: float | None = None) -> tuple[np.ndarray, np.ndarray | None]:
    """Every inter-token gap (seconds), request by request, and when `q` is given the q-th percentile
    of each request's own gaps (NaN for a request with no gap), in one pass over the token times."""
    if result.token_spans is None:
        raise ValueError("ITL needs token times: simulate with record_tokens=True")
    n = len(result.token_spans)
    pooled, own = [], (np.full(n, np.nan) if q is not None else None)
    for first in range(0, n, GAP_BLOCK_REQUESTS):
        block = result.token_spans[first:first + GAP_BLOCK_REQUESTS]
        request, times = _token_grid(block)
        same_request = request[1:] == request[:-1]
        gaps = np.diff(times)[same_request]
        pooled.append(gaps)
        if q is not None:
            own[first:first + len(block)] = _own_percentile(request[1:][same_request], gaps, len(block), q)
    return (np.concatenate(pooled) if pooled else np.empty(0)), own


def itl_values(result: SimResult) -> np.ndarray:
    """Every inter-token gap (seconds) of every request, request by request."""
    return inter_token_gaps(result)[0]


def request_itl_percentile(result: SimResult, q: float) -> np.ndarray:
    """The q-th percentile of each request's own gaps (seconds); NaN for a request with no gap."""
    return inter_token_gaps(result, q)[1]


def request_columns(result: SimResult) -> dict[str, np.ndarray]:
    """per_request's columns as arrays, which summarize and the capacity and fleet searches read without
    building a frame (their processes then never import pandas)."""
    n_out = np.asarray(result.output_tokens)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(n_out >= 2, (result.completion_s - result.first_token_s) / (n_out - 1), np.nan)
    return {
        "id": np.arange(len(result.arrival_s)),
        "arrival_s": result.arrival_s,
        "prompt_tokens": result.prompt_tokens,
        "output_tokens": n_out,
        "scheduled_s": result.scheduled_s,
        "first_token_s": result.first_token_s,
        "completion_s": result.completion_s,
        "queue_s": result.scheduled_s - result.arrival_s,
        "ttft_s": result.first_token_s - result.arrival_s,
        "tpot_s": tpot,
        "e2e_s": result.completion_s - result.arrival_s,
        "generated": result.generated,
        "preemptions": result.preemptions,
        "recomputed_tokens": result.recomputed_tokens,
        "rejected": result.rejected,
        "finished": result.finished,
    }


def per_request(result: SimResult):
    """One row per request (a pandas DataFrame); NaN where a time was never reached."""
    import pandas as pd    # imported here: see request_columns

    return pd.DataFrame(request_columns(result))


def good_requests(result: SimResult, slo: SLO, frame=None, own_itl: np.ndarray | None = None) -> np.ndarray:
    """Boolean mask of the requests that finished and met every bound of `slo`. `frame` (per_request or
    request_columns) and `own_itl` (request_itl_percentile at slo.itl_percentile) are computed when not
    given."""
    frame = request_columns(result) if frame is None else frame
    good = np.array(frame["finished"], dtype=bool)
    if slo.ttft_ms is not None:
        good &= np.asarray(frame["ttft_s"]) * 1e3 <= slo.ttft_ms
    if slo.tpot_ms is not None:
        # vLLM counts a one-token reply's TPOT as 0 for goodput
        tpot = np.asarray(frame["tpot_s"])
        good &= (np.asarray(frame["output_tokens"]) < 2) | (tpot * 1e3 <= slo.tpot_ms)
    if slo.itl_ms is not None:
        if own_itl is None:
            own_itl = request_itl_percentile(result, slo.itl_percentile)
        good &= np.isnan(own_itl) | (own_itl * 1e3 <= slo.itl_ms)
    if slo.e2el_ms is not None:
        good &= np.asarray(frame["e2e_s"]) * 1e3 <= slo.e2el_ms
    return good


def finite_or_none(x) -> float | None:
    """JSON has no NaN or infinity: an undefined or infinite figure is None."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _latency_stats(prefix: str, values_s: np.ndarray, sort_in_place: bool = False) -> dict:
    """Mean and PERCENTILES in ms. The values are sorted once for every percentile; with `sort_in_place`
    (for millions of ITL gaps) in their own array, which then stays sorted."""
    out = {f"{prefix}_mean": finite_or_none(float(np.mean(values_s)) * 1e3) if values_s.size else None}
    if sort_in_place:
        values_s.sort()
    ordered = values_s if sort_in_place else np.sort(np.asarray(values_s, dtype=float))
    for q in PERCENTILES:
        out[f"{prefix}_p{q}"] = finite_or_none(_sorted_percentile(ordered, q) * 1e3)
    return out


def _slo_outcome(result: SimResult, slo: SLO | None, frame: dict, ttft: np.ndarray, tpot: np.ndarray,
                 e2e: np.ndarray, gaps: np.ndarray | None, own_itl: np.ndarray | None) -> tuple[np.ndarray, bool]:
    """The good requests and whether the aggregate SLO holds, from summarize's arrays (unfinished
    requests' latencies infinite)."""
    if slo is None:
        return frame["finished"], True
    good = good_requests(result, slo, frame, own_itl)
    checks = []
    if slo.ttft_ms is not None:
        checks.append(percentile(ttft, slo.ttft_percentile) * 1e3 <= slo.ttft_ms)
    if slo.tpot_ms is not None and tpot.size:
        checks.append(percentile(tpot, slo.tpot_percentile) * 1e3 <= slo.tpot_ms)
    if slo.itl_ms is not None:
        if gaps.size:
            checks.append(percentile(gaps, slo.itl_percentile) * 1e3 <= slo.itl_ms)
    if slo.e2el_ms is not None:
        checks.append(percentile(e2e, slo.e2el_percentile) * 1e3 <= slo.e2el_ms)
    return good, all(checks)


def _latencies(frame: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """TTFT, TPOT (of requests with two or more tokens) and E2E in seconds, infinite where unfinished,
    from request_columns."""
    finished = frame["finished"]
    n_out = frame["output_tokens"]
    ttft = np.where(np.isnan(frame["ttft_s"]), math.inf, frame["ttft_s"])
    e2e = np.where(finished, frame["e2e_s"], math.inf)
    tpot = np.where(finished, frame["tpot_s"], math.inf)[n_out >= 2]
    return ttft, tpot, e2e


def _misses_at_position(n: int, q: float) -> float:
    """How many of n values over a bound put the bound below their q-th percentile whatever the rest
    are: those filling _sorted_percentile's lower position and every one above it (which the
    interpolation never goes below). inf for no values."""
    return n - math.floor(q / 100.0 * (n - 1)) if n else math.inf


def miss_limit(slo: SLO, output_tokens, attainment_goal: float | None = None) -> MissLimit | None:
    """The misses that settle a verdict failing before its run ends (simulate.misses), for a trace of
    requests with these `output_tokens`: with `attainment_goal`, joint attainment of `slo` below it;
    else the aggregate SLO (any of its TTFT and TPOT percentiles over its bound). None when misses of
    TTFT or TPOT cannot settle it (no such bound, or no attainment goal above 0)."""
    n_out = np.asarray(output_tokens)
    n, multi_token = len(n_out), int(np.sum(n_out >= 2))
    if slo.ttft_ms is None and slo.tpot_ms is None:
        return None
    if attainment_goal is not None:
        # good / n >= goal fails once n - bad, the most requests that can still be good, falls below it
        bad = next((b for b in range(n + 1) if (n - b) / n < attainment_goal), None) if n else None
        return None if bad is None else MissLimit(slo.ttft_ms, slo.tpot_ms, bad=bad)
    return MissLimit(slo.ttft_ms, slo.tpot_ms,
                     ttft_misses=_misses_at_position(n, slo.ttft_percentile) if slo.ttft_ms is not None else math.inf,
                     tpot_misses=(_misses_at_position(multi_token, slo.tpot_percentile) if slo.tpot_ms is not None
                                  else math.inf))


def _refuse_stopped(result: SimResult) -> None:
    if result.misses_settled:
        raise ValueError("a run stopped once its SLO verdicts were settled failing has no figures to report")


def slo_verdict(result: SimResult, slo: SLO | None = None) -> dict:
    """What a capacity criterion reads of summarize(result, slo), without its latency statistics:
    `stable`, `attainment` and `slo_holds`, computed by the same code."""
    _refuse_stopped(result)
    frame = request_columns(result)
    ttft, tpot, e2e = _latencies(frame)
    gaps = own_itl = None
    if slo is not None and slo.itl_ms is not None:
        gaps, own_itl = inter_token_gaps(result, slo.itl_percentile)
    good, holds = _slo_outcome(result, slo, frame, ttft, tpot, e2e, gaps, own_itl)
    n = len(result.arrival_s)
    return {"stable": bool(result.stable), "attainment": float(good.sum()) / n if n else None,
            "slo_holds": bool(holds)}


def summarize(result: SimResult, slo: SLO | None = None) -> dict:
    """Flat, JSON-friendly summary of one run: latency statistics in ms (None = infinite or
    undefined), throughput, goodput and SLO attainment, and the run's stability facts.

    As in vLLM, throughput counts the output tokens of finished requests, and throughput and goodput
    divide by the run's duration, from the first arrival to the last completion (or to the end of
    a truncated run). With no SLO every finished request is good. A run stopped on its settled verdicts
    (simulate.misses) is refused."""
    _refuse_stopped(result)
    frame = request_columns(result)
    n = len(result.arrival_s)
    finished = frame["finished"]
    n_out = frame["output_tokens"]
    # unfinished requests count as infinitely late
    ttft, tpot, e2e = _latencies(frame)

    first_arrival = float(result.arrival_s[0]) if n else 0.0
    duration = float(result.end_s) - first_arrival
    out = {
        "num_requests": n,
        "finished": int(finished.sum()),
        "rejected": int(np.sum(result.rejected)),
        "duration_s": duration,
        # the trace's own rate, by its one definition: a burst (within a microsecond) has none
        "request_rate": mean_rate(result.arrival_s),
        "throughput_tok_s": float(n_out[finished].sum()) / duration if duration > 0 else None,
    }
    out.update(_latency_stats("ttft_ms", ttft))
    out.update(_latency_stats("tpot_ms", tpot))
    gaps = own_itl = None
    if result.token_spans is not None:
        gaps, own_itl = inter_token_gaps(result, slo.itl_percentile if slo and slo.itl_ms is not None else None)
        out.update(_latency_stats("itl_ms", gaps, sort_in_place=True))
    elif slo is not None and slo.itl_ms is not None:
        raise ValueError("ITL needs token times: simulate with record_tokens=True")
    out.update(_latency_stats("e2e_ms", e2e))

    good, holds = _slo_outcome(result, slo, frame, ttft, tpot, e2e, gaps, own_itl)
    out.update({
        "good": int(good.sum()),
        "goodput_rps": float(good.sum()) / duration if duration > 0 else None,
        "attainment": float(good.sum()) / n if n else None,
        "slo_holds": bool(holds),
        "stable": bool(result.stable),
        "truncated": bool(result.truncated),
        "preemptions": int(np.sum(result.preemptions)),
        "recomputed_tokens": int(np.sum(result.recomputed_tokens)),
        "peak_kv_blocks": int(result.peak_kv_blocks),
        "peak_running": int(result.peak_running),
    })
    return out
