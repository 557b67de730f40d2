"""Closed-loop load: at most N requests in flight, the next one sent when one finishes.

This is vLLM's benchmark client with --max-concurrency N (vllm/benchmarks/serve.py): requests are
drawn on their arrival schedule, then wait on a FIFO semaphore of N slots; a request's latencies
(TTFT, TPOT, ITL, E2E) are measured from when it is sent, i.e. from when it gets a slot, and the
wait for a slot is reported apart as its client queue time. A request the engine refuses (it can
never fit in the KV cache) returns at once and frees its slot. With N unbounded every request is
sent at its arrival, which is the open loop (used here for an infinite rate: all arrivals at t=0).

The engine is the simulator's own Replica, driven one step at a time: a step never runs past a
completion (a run of identical decode steps stops at the first sequence to finish), so the time a
slot frees is the exact completion time of the request that held it. A run always drains (at most N
requests are ever in the engine), so nothing is cut at a horizon.
"""
from __future__ import annotations

import math
from bisect import insort

import numpy as np

from servingplan.costmodel import CostModel
from servingplan.simulate.policies import DEFAULT_CHUNK_BUDGET
from servingplan.simulate.scheduler import Seq
from servingplan.simulate.simulator import Replica, SimResult, Timeline, simulate
from servingplan.simulate.workload import Trace


def simulate_load(trace: Trace, cost: CostModel, policy: str, max_num_seqs: int, chunk_size: int,
                  kv_blocks: int | None, block_size: int, horizon_factor: float, max_concurrency: int | None = None,
                  **options) -> SimResult:
    """The workload's load shape: the simulator's open loop, or with `max_concurrency` the closed loop
    (the pipeline's workload.max_concurrency)."""
    if max_concurrency is None:
        return simulate(trace, cost, policy, max_num_seqs, chunk_size, kv_blocks, block_size, horizon_factor,
                        **options)
    return simulate_closed_loop(trace, cost, policy, max_num_seqs, max_concurrency, chunk_size, kv_blocks,
                                block_size, **options)


def simulate_closed_loop(trace: Trace, cost: CostModel, policy: str, max_num_seqs: int,
                         max_concurrency: int | None, chunk_size: int = 512, kv_blocks: int | None = None,
                         block_size: int = 16, record_tokens: bool = False,
                         chunk_budget: str = DEFAULT_CHUNK_BUDGET) -> SimResult:
    """Serve `trace` with at most `max_concurrency` requests in flight (None: no limit). The result's
    arrival_s are the send times, as vLLM measures from them; meta holds the drawn arrivals
    ("scheduled_arrival_s") and each request's wait for a slot ("client_queue_s")."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency {max_concurrency}: must be >= 1")
    n = len(trace)
    slots = n if max_concurrency is None else max_concurrency
    timeline = Timeline(n, record_tokens)
    replica = Replica(cost, policy, max_num_seqs, chunk_size, kv_blocks, block_size, timeline, None, chunk_budget)
    seqs = [Seq(i, int(p), int(o)) for i, (p, o) in enumerate(zip(trace.prompt_tokens, trace.output_tokens))]
    arrivals = np.asarray(trace.arrival_s, dtype=float)
    sent = np.full(n, np.nan)
    rejected = np.zeros(n, dtype=bool)
    # the times slots were given back (a completion, or the send time of a refused request), sorted,
    # and the requests holding a slot
    returns, in_flight = [], set()
    for i in range(n):
        slot_time = -math.inf
        needed = i - slots + 1  # requests before i that must have given their slot back
        if needed > 0:
            while len(returns) < needed:
                if not replica._step(math.inf):
                    raise RuntimeError("closed loop: the engine idles with requests in flight")
                _collect(timeline, in_flight, returns)
            slot_time = returns[needed - 1]
        send = max(float(arrivals[i]), slot_time)
        if send > replica.t:
            replica.advance(send, math.inf)
            _collect(timeline, in_flight, returns)
        sent[i] = send
        rejected[i] = not replica.add(seqs[i], send)
        if rejected[i]:
            insort(returns, send)
        else:
            in_flight.add(i)
    replica.advance(math.inf, math.inf)
    return SimResult(
        arrival_s=sent, prompt_tokens=np.asarray(trace.prompt_tokens), output_tokens=np.asarray(trace.output_tokens),
        scheduled_s=timeline.scheduled, first_token_s=timeline.first, completion_s=timeline.done,
        generated=np.array([s.generated for s in seqs]), preemptions=np.array([s.preemptions for s in seqs]),
        recomputed_tokens=np.array([s.recomputed_tokens for s in seqs]), rejected=rejected,
        token_spans=timeline.spans, end_s=replica.t, truncated=not replica.sched.idle, steps=replica.steps,
        events=replica.events, peak_running=replica.peak_running, peak_kv_blocks=replica.peak_blocks,
        peak_kv_tokens=replica.peak_tokens,
        # a closed loop cannot fall behind its arrivals: at most N requests are ever in the engine, and
        # the wait for a slot is the client's (client_queue_s), so keeping up rests on draining alone
        backlog_growth_s=None, policy=policy,
        max_num_seqs=max_num_seqs, chunk_size=chunk_size,
        meta={"replicas": 1, "max_concurrency": max_concurrency, "scheduled_arrival_s": arrivals,
              "client_queue_s": sent - arrivals})


def _collect(timeline: Timeline, in_flight: set, returns: list) -> None:
    """Move the requests that finished from `in_flight` to the sorted slot-return times."""
    finished = [j for j in in_flight if not math.isnan(timeline.done[j])]
    for j in finished:
        insort(returns, float(timeline.done[j]))
    in_flight.difference_update(finished)
