"""A vLLM-bench-style streaming client for llama-server's OpenAI-compatible /v1/completions.

Each request sends token ids as its prompt (so the tokenizer's content never matters), `max_tokens` with
`ignore_eos` (so every request generates exactly its output length), `stream`, `timings_per_token`, and
`cache_prompt: false` (a slot reuses no earlier prompt's KV: every prompt token is computed, as simulated).
llama-server may hold back tokens (an incomplete UTF-8 sequence, a possible stop string) and send them
later in one chunk; with `timings_per_token` every chunk carries `timings.predicted_n`, the tokens
generated so far, so held-back tokens are still counted, each stamped with the arrival of the chunk that
brought it (as vLLM's benchmark stamps a chunk).

Times are seconds on one monotonic clock from the run's start. Per request with scheduled arrival a,
first token f, completion c (the last token's arrival) and N tokens, as servingplan.simulate.metrics defines them
(vLLM's benchmarks/serve.py): TTFT = f - a, TPOT = (c - f) / (N - 1) for N >= 2, E2E = c - a, ITL = every
gap between consecutive tokens (0 between tokens that arrived in one chunk).

Only loopback or the project's own test hosts are ever targets: `base_url` comes from the caller, who
starts the server.
"""
from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import numpy as np


@dataclass
class RequestResult:
    index: int
    arrival_s: float                     # scheduled send time, from the run's start
    prompt_tokens: int
    max_tokens: int
    sent_s: float = float("nan")         # when the request actually went out
    token_times_s: list = field(default_factory=list)   # one per generated token
    error: str | None = None
    finish_reason: str | None = None
    server_timings: dict | None = None   # the last `timings` object llama-server sent

    @property
    def output_tokens(self) -> int:
        return len(self.token_times_s)

    @property
    def ok(self) -> bool:
        return self.error is None and self.output_tokens == self.max_tokens

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0] - self.arrival_s if self.ok else float("inf")

    @property
    def tpot_s(self) -> float:
        n = self.output_tokens
        if not self.ok:
            return float("inf")
        return (self.token_times_s[-1] - self.token_times_s[0]) / (n - 1) if n >= 2 else float("nan")

    @property
    def e2e_s(self) -> float:
        return self.token_times_s[-1] - self.arrival_s if self.ok else float("inf")

    @property
    def itl_s(self) -> list:
        return list(np.diff(self.token_times_s)) if self.ok else []


def random_prompts(lengths, vocab_size: int = 50257, seed: int = 0) -> list[list[int]]:
    """Distinct random token-id prompts: no two share a prefix long enough for llama-server to pick a slot
    by prompt similarity (its default threshold is 10% of the prompt), so slots go by LRU as simulated."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab_size, int(n)).tolist() for n in lengths]


def _body(prompt: list, max_tokens: int, model: str) -> bytes:
    return json.dumps({"model": model, "prompt": prompt, "max_tokens": int(max_tokens), "ignore_eos": True,
                       "temperature": 0.0, "stream": True,
                       "timings_per_token": True, "cache_prompt": False}).encode()


def stream_completion(base_url: str, prompt: list, max_tokens: int, *, t0: float, result: RequestResult,
                      timeout_s: float = 60.0, model: str = "servingplan",
                      clock=time.perf_counter) -> RequestResult:
    """Send one streaming completion and fill `result` (times from `t0` on `clock`). Never raises for
    the server's or the network's failures: they land in `result.error`."""
    url = urlsplit(base_url)
    conn = http.client.HTTPConnection(url.hostname, url.port or 80, timeout=timeout_s)
    deadline = clock() + timeout_s
    seen = 0
    try:
        result.sent_s = clock() - t0
        conn.request("POST", url.path.rstrip("/") + "/v1/completions", body=_body(prompt, max_tokens, model),
                     headers={"Content-Type": "application/json", "Accept": "text/event-stream"})
        resp = conn.getresponse()
        if resp.status != 200:
            result.error = f"HTTP {resp.status}: {resp.read(2000).decode(errors='replace').strip()}"
            return result
        done = False
        while True:
            line = resp.readline()
            now = clock()
            if now > deadline:
                result.error = f"timeout: no completion within {timeout_s:g} s"
                return result
            if not line:
                break
            line = line.strip()
            if not line.startswith(b"data:"):
                if line.startswith(b"error:"):
                    result.error = f"server error: {line[6:].decode(errors='replace').strip()}"
                    return result
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                break
            data = json.loads(payload)
            if "error" in data:
                result.error = f"server error: {json.dumps(data['error'])}"
                return result
            choice = (data.get("choices") or [{}])[0]
            timings = data.get("timings")
            if timings:
                result.server_timings = timings
            if timings and "predicted_n" in timings:
                count = int(timings["predicted_n"])
            elif choice.get("text"):
                count = seen + 1
            else:
                count = seen
            usage = data.get("usage") or {}
            count = max(count, int(usage.get("completion_tokens", 0)))
            if count > seen:
                result.token_times_s.extend([now - t0] * (count - seen))
                seen = count
            if choice.get("finish_reason"):
                result.finish_reason = choice["finish_reason"]
        if not done:
            result.error = "incomplete: the stream ended without [DONE]"
        elif seen != max_tokens:
            result.error = f"expected {max_tokens} tokens, got {seen}"
    except (socket.timeout, TimeoutError):
        result.error = f"timeout: no data for {timeout_s:g} s"
    except (OSError, http.client.HTTPException, json.JSONDecodeError, ValueError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
    return result


def run_trace(base_url: str, arrivals_s, prompts, max_tokens, *, timeout_s: float = 120.0,
              model: str = "servingplan", clock=time.perf_counter, while_idle=None) -> list[RequestResult]:
    """Replay a trace open-loop: request i goes out at arrivals_s[i] (seconds from the start) on its own
    thread, whatever the server's state, as vLLM's benchmark does. Returns results in trace order. Bounded:
    one request per trace entry, each at most `timeout_s`.

    `while_idle(seconds)`, if given, is called when every request sent so far has finished and the next
    one is due in `seconds`: the server is idle until then. It must return within them (the next request
    goes out when it returns, late if it overran)."""
    results = [RequestResult(i, float(a), len(p), int(m)) for i, (a, p, m) in
               enumerate(zip(arrivals_s, prompts, max_tokens))]
    threads = []
    t0 = clock()
    for res, prompt in zip(results, prompts):
        if while_idle is not None and threads:
            for th in threads:   # until every request in flight has finished, or the next one is due
                th.join(max(0.0, t0 + res.arrival_s - clock()))
            wait = t0 + res.arrival_s - clock()
            if wait > 0 and not any(th.is_alive() for th in threads):
                while_idle(wait)
        wait = t0 + res.arrival_s - clock()
        if wait > 0:
            time.sleep(wait)
        th = threading.Thread(target=stream_completion, args=(base_url, prompt, res.max_tokens),
                              kwargs=dict(t0=t0, result=res, timeout_s=timeout_s, model=model, clock=clock),
                              daemon=True)
        th.start()
        threads.append(th)
    for th in threads:
        th.join(timeout_s + 5)
    for res, th in zip(results, threads):
        if th.is_alive() and res.error is None:
            res.error = "timeout: the request thread did not finish"
    return results


def summarize(results) -> dict:
    """TTFT / TPOT / ITL / E2E in ms: mean, p50, p90, p95, p99, counting a failed request as infinite."""
    out = {"requests": len(results), "completed": sum(r.ok for r in results),
           "errors": sorted({r.error for r in results if r.error})}
    for name in ("ttft", "tpot", "e2e"):
        values = np.array([getattr(r, f"{name}_s") for r in results], dtype=float) * 1000.0
        values = values[~np.isnan(values)]
        out.update(_stats(name, values))
    out.update(_stats("itl", np.array([g for r in results for g in r.itl_s], dtype=float) * 1000.0))
    return out


def _stats(name: str, ms: np.ndarray) -> dict:
    if not len(ms):
        return {f"{name}_ms_{k}": None for k in ("mean", "p50", "p90", "p95", "p99")}
    finite = np.isfinite(ms)
    row = {f"{name}_ms_mean": float(ms.mean()) if finite.all() else None}
    for q in (50, 90, 95, 99):
        with np.errstate(invalid="ignore"):      # inf - inf where the percentile falls among failures
            v = float(np.percentile(ms, q))
        row[f"{name}_ms_p{q}"] = v if np.isfinite(v) else None
    return row
