"""vLLM's benchmark result file (vllm/benchmarks/serve.py --save-result), written for one simulated run.

One run (one policy, cap, rate and seed) is one flat dict: the setup keys (date, backend, label,
model_id, num_prompts, --metadata pairs, request_rate, burstiness, max_concurrency), the counts as
integers, the throughputs, the per-request lists at the top level (with --save-detailed, as vLLM
keeps them only then), and mean/median/std/p<q> of each --percentile-metrics metric in ms. The file is
named as vLLM names it, {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json, and --append-result
adds the dict as one more JSON line, as vLLM does.

A run that did not keep up (its queue grew, or it was cut short) has no steady state, so every
throughput, the goodput and every latency statistic is null: no number stands for those quantities
under any key. Its counts, duration and lists stay.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from servingplan.io import write_text
from servingplan.simulate.metrics import finite_or_none, percentile, per_request

BACKEND = "servingplan-sim"
# vLLM's --percentile-metrics names; client_queue_time exists only with --max-concurrency
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el", "client_queue_time")
DEFAULT_PERCENTILE_METRICS = ("ttft", "tpot", "itl")
DETAILED_LISTS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "latencies", "queue_times", "errors")
THROUGHPUT_KEYS = ("request_throughput", "request_goodput", "output_throughput", "total_token_throughput",
                   "max_output_tokens_per_s")
# every key vLLM's result file may hold (besides the p<q>_<metric>_ms family): --metadata may not shadow one
RESULT_KEYS = ("date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
               "request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed",
               "total_input_tokens", "total_output_tokens", *THROUGHPUT_KEYS, *DETAILED_LISTS, "generated_texts",
               "max_concurrent_requests", "policy", "max_num_seqs", "seed", "workload", "chunk_budget", "trace", "stable")
DATE_FORMAT = re.compile(r"\d{8}-\d{6}")
METADATA_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
MAX_METADATA_VALUE = 256


def percentile_word(q: float) -> str:
    """vLLM's spelling of a percentile in a key: 99 -> '99', 99.9 -> '99.9'."""
    return str(int(q)) if int(q) == q else str(q)


def rate_word(rate: float) -> str:
    """The rate as vLLM's file name spells its float argument: 20 -> '20.0', inf -> 'inf'."""
    return str(float(rate))


def result_filename(label: str, rate: float, max_concurrency: int | None, model_id: str, date: str) -> str:
    concurrency = f"-concurrency{max_concurrency}" if max_concurrency is not None else ""
    return f"{label}-{rate_word(rate)}qps{concurrency}-{model_id.split('/')[-1]}-{date}.json"


def metadata_pair(text: str) -> tuple[str, str]:
    """One --metadata KEY=VALUE item; the key may not shadow a result key (checked by the caller)."""
    key, equals, value = text.partition("=")
    key, value = key.strip(), value.strip()
    if not equals or not METADATA_KEY.fullmatch(key) or len(value) > MAX_METADATA_VALUE:
        raise ValueError(f"{text!r}: must be KEY=VALUE with KEY of letters, digits, _ . - (at most 64, not starting "
                         f"with a digit) and VALUE at most {MAX_METADATA_VALUE} characters")
    return key, value


def _stats(values_s: np.ndarray, percentiles, defined: bool, name: str) -> dict:
    ms = np.asarray(values_s, dtype=float) * 1e3
    ok = defined and ms.size > 0
    out = {f"mean_{name}_ms": finite_or_none(np.mean(ms)) if ok else None,
           f"median_{name}_ms": finite_or_none(percentile(ms, 50)) if ok else None,
           f"std_{name}_ms": finite_or_none(np.std(ms)) if ok else None}
    for q in percentiles:
        out[f"p{percentile_word(q)}_{name}_ms"] = finite_or_none(percentile(ms, q)) if ok else None
    return out


def peak_output_tokens_per_s(starts: np.ndarray, token_times: list[np.ndarray]) -> float:
    """vLLM's max_output_tokens_per_s: output tokens counted in one-second buckets from the first send."""
    stamps = np.concatenate(token_times) if token_times else np.empty(0)
    if stamps.size == 0:
        return 0.0
    buckets = np.floor(stamps - starts.min()).astype(np.int64)
    # counted per bucket that holds a token: a bincount's array would take a slot for every second of the
    # run, 800 MB for a trace spanning the 1e8 s allowed
    _, counts = np.unique(buckets[buckets >= 0], return_counts=True)
    return float(counts.max())


def peak_concurrency(starts: np.ndarray, ends: np.ndarray) -> int:
    """vLLM's max_concurrent_requests: most requests in flight at once over half-open [send, end)."""
    events = sorted([(t, 1) for t in starts] + [(t, -1) for t in ends])
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


def run_result(result, summary: dict, *, rate: float, burstiness: float, max_concurrency: int | None,
               num_prompts: int, model_id: str, label: str, date: str, metadata: dict, percentiles,
               percentile_metrics, goodput: bool, detailed: bool, extra: dict) -> dict:
    """One simulated run as vLLM's flat result dict. `summary` is servingplan.simulate.metrics.summarize of the
    run; `goodput` says whether a goodput bound was given (vLLM writes request_goodput null otherwise);
    `extra` adds this simulator's own keys (policy, cap, seed ...) after vLLM's setup keys."""
    frame = per_request(result)
    finished = frame["finished"].to_numpy()
    n_in, n_out = frame["prompt_tokens"].to_numpy(), frame["output_tokens"].to_numpy()
    starts = np.asarray(result.arrival_s, dtype=float)
    stable = bool(summary["stable"])
    duration = float(summary["duration_s"])
    completed = int(finished.sum())
    total_in, total_out = int(n_in[finished].sum()), int(n_out[finished].sum())
    token_times = [result.token_times(i) for i in np.flatnonzero(finished)] if result.token_spans is not None else []
    queue = np.asarray(result.meta.get("client_queue_s", np.zeros(len(starts))), dtype=float)
    keeps_up = stable and duration > 0
    out = {"date": date, "endpoint_type": BACKEND, "backend": BACKEND, "label": label, "model_id": model_id,
           "tokenizer_id": None, "num_prompts": int(num_prompts), **metadata,
           "request_rate": rate if math.isfinite(rate) else "inf",
           "burstiness": burstiness if math.isfinite(burstiness) else "inf",
           "max_concurrency": max_concurrency, **extra, "stable": stable,
           "duration": duration, "completed": completed, "failed": int(len(frame) - completed),
           "total_input_tokens": total_in, "total_output_tokens": total_out,
           "request_throughput": completed / duration if keeps_up else None,
           "request_goodput": summary["goodput_rps"] if keeps_up and goodput else None,
           "output_throughput": total_out / duration if keeps_up else None,
           "total_token_throughput": (total_in + total_out) / duration if keeps_up else None}
    if detailed:
        gaps = [np.diff(result.token_times(i)).tolist() if finished[i] and result.token_spans is not None else []
                for i in range(len(frame))]
        errors = ["does not fit in the KV cache" if rejected else "" if done else "unfinished"
                  for rejected, done in zip(frame["rejected"], finished)]
        out.update({"input_lens": n_in.tolist(), "output_lens": np.where(finished, n_out, 0).tolist(),
                    "start_times": starts.tolist(), "ttfts": [finite_or_none(v) for v in frame["ttft_s"]],
                    "itls": gaps, "latencies": [finite_or_none(v) for v in frame["e2e_s"]],
                    "queue_times": queue.tolist(), "errors": errors})
    out["max_output_tokens_per_s"] = peak_output_tokens_per_s(starts, token_times) if keeps_up and token_times else None
    ends = np.asarray(frame["completion_s"], dtype=float)
    out["max_concurrent_requests"] = peak_concurrency(starts[finished], ends[finished]) if completed else 0
    series = {"ttft": np.where(np.isnan(frame["ttft_s"]), math.inf, frame["ttft_s"]),
              "tpot": np.where(finished, frame["tpot_s"], math.inf)[n_out >= 2],
              "itl": np.concatenate([np.diff(t) for t in token_times]) if token_times else np.empty(0),
              "e2el": np.where(finished, frame["e2e_s"], math.inf),
              "client_queue_time": queue}
    for name in percentile_metrics:
        out.update(_stats(series[name], percentiles, stable, name))
    return out


def save(path: Path, result: dict, append: bool) -> None:
    """Write `result` as the file's one JSON document, or with `append` add it to the file as vLLM's
    --append-result does (a newline, then the dict); either way atomically."""
    text = json.dumps(result, allow_nan=False)  # JSON has no NaN or Infinity: undefined figures are null
    if append and path.exists():
        previous = path.read_text()
        text = (previous + "\n" + text) if previous else text
    write_text(path, text)


def read_results(path: Path) -> list[dict]:
    """Every result dict in a file written by `save` (one, or one per line when appended)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]

