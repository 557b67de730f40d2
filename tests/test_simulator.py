"""The event loop: conservation, hand-checked timelines, fast-forward against a step-by-step reference,
closed-form queueing, determinism."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import GROWING, fixed_cost, make_trace
from servingplan.simulate import workload
from servingplan.simulate import POLICIES, BlockManager, Scheduler, Seq, simulate
from servingplan.simulate import llamacpp_slots
from servingplan.simulate.simulator import steps_to_reach

# A per-batch decode table that rises and dips as on a CPU (interpolated at 4, extrapolated from 6 up),
# read padded: the fast-forward must stay exact for it too
GROWING_TABLED = dataclasses.replace(
    GROWING, ctx_mode="padded_max", name="growing-tabled",
    decode_batch_fixed_s=((1, 4 / 1024), (2, 12 / 1024), (3, 10 / 1024), (5, 11 / 1024)))


def reference_replay(trace, cost, policy, cap, chunk_size=512, kv_blocks=None, block_size=16):
    """Step-by-step replay with no fast-forward: the emission times of every request's tokens, and
    the peaks (running sequences, KV blocks, KV tokens) seen at the start of a step."""
    sched = Scheduler(policy, cap, chunk_size, BlockManager(kv_blocks, block_size))
    seqs = [Seq(i, int(p), int(o)) for i, (p, o) in enumerate(zip(trace.prompt_tokens, trace.output_tokens))]
    times = [[] for _ in seqs]
    peaks = {"running": 0, "blocks": 0, "tokens": 0}
    t, nxt = 0.0, 0
    while True:
        while nxt < len(seqs) and trace.arrival_s[nxt] <= t:
            sched.add(seqs[nxt])
            nxt += 1
        step = sched.schedule()
        if step.empty:
            if nxt == len(seqs):
                return times, peaks
            t = max(t, trace.arrival_s[nxt])
            continue
        for key, now in (("running", len(sched.running)), ("blocks", sched.kv.used),
                         ("tokens", sum(s.kv_tokens for s in sched.running))):
            peaks[key] = max(peaks[key], now)
        ctx = [s.decode_context for s in step.decodes]
        if step.slots:   # llama-server's micro-batches (tests/test_llamacpp_policy.py prices them by hand)
            decode_slots, prefill_slots = step.slots
            t += llamacpp_slots.step_time(cost, list(zip(decode_slots, ctx)),
                                          [(slot, n, seq.prefilled) for slot, (seq, n) in zip(prefill_slots, step.prefills)],
                                          min(llamacpp_slots.DEFAULT_N_UBATCH, chunk_size))
        else:
            t += cost.step_time(len(ctx), sum(ctx), step.prefill_calls(), max(ctx, default=0))
        emitted, _ = sched.complete(step)
        for seq in emitted:
            times[seq.id].append(t)


small_traces = st.integers(1, 12).flatmap(lambda n: st.tuples(
    st.lists(st.floats(0.0, 3.0), min_size=n, max_size=n).map(lambda gaps: np.cumsum(gaps) + 0.01),
    st.lists(st.integers(1, 300), min_size=n, max_size=n),
    st.lists(st.integers(1, 40), min_size=n, max_size=n),
)).map(lambda t: make_trace(*t))


@given(trace=small_traces, policy=st.sampled_from(POLICIES), cap=st.integers(1, 6),
       chunk=st.sampled_from([16, 64, 512]), kv_blocks=st.sampled_from([None, 30, 60]))
def test_every_request_finishes_once_and_tokens_add_up(trace, policy, cap, chunk, kv_blocks):
    r = simulate(trace, GROWING, policy, cap, chunk, kv_blocks=kv_blocks, block_size=16, record_tokens=True)
    fits = trace.prompt_tokens + trace.output_tokens - 1 <= 16 * kv_blocks if kv_blocks else np.ones(len(trace), bool)
    assert not r.truncated
    assert np.array_equal(r.rejected, ~fits)
    assert np.array_equal(r.finished, fits)
    assert np.array_equal(r.generated[fits], trace.output_tokens[fits])
    assert r.peak_running <= cap
    if kv_blocks:
        assert r.peak_kv_blocks <= kv_blocks
    for i in np.flatnonzero(fits):
        assert r.arrival_s[i] <= r.scheduled_s[i] < r.first_token_s[i] <= r.completion_s[i]
        times = r.token_times(i)
        assert len(times) == trace.output_tokens[i]
        assert np.all(np.diff(times) > 0)
        assert times[0] == pytest.approx(r.first_token_s[i], abs=1e-12)
        assert times[-1] == pytest.approx(r.completion_s[i], abs=1e-12)
    assert r.end_s == pytest.approx(np.max(r.completion_s[fits], initial=r.end_s), abs=1e-12)


@given(trace=small_traces, policy=st.sampled_from(POLICIES), cap=st.integers(1, 6),
       chunk=st.sampled_from([16, 512]), kv_blocks=st.sampled_from([None, 30, 60]),
       cost=st.sampled_from([GROWING, GROWING_TABLED]))
def test_fast_forward_matches_step_by_step(trace, policy, cap, chunk, kv_blocks, cost):
    r = simulate(trace, cost, policy, cap, chunk, kv_blocks=kv_blocks, record_tokens=True)
    expected, peaks = reference_replay(trace, cost, policy, cap, chunk, kv_blocks)
    for i in range(len(trace)):
        assert r.token_times(i) == pytest.approx(np.array(expected[i]), rel=1e-12, abs=1e-9)
    assert (r.peak_running, r.peak_kv_blocks, r.peak_kv_tokens) == (peaks["running"], peaks["blocks"], peaks["tokens"])


def test_llamacpp_fast_forward_stops_at_an_arrival_that_takes_an_idle_slot():
    """llama-server tries a new request before those it deferred: here request 1 (241 tokens) does not fit
    beside request 0 in 30 blocks, and defers the small ones behind it, while the one arriving at 0.26 s
    takes the idle slot at once. A decode run of request 0 must stop at that arrival (hypothesis found the
    fast-forward running past it: request 10 finished 0.15 s late and every token of request 0 after it early)."""
    trace = make_trace([0.01] * 10 + [0.26], [197, 241] + [1] * 9, [29] + [1] * 10)
    r = simulate(trace, GROWING, "llamacpp", 2, 16, kv_blocks=30, record_tokens=True)
    expected, peaks = reference_replay(trace, GROWING, "llamacpp", 2, 16, 30)
    assert r.completion_s[10] < r.completion_s[1]      # the late small request overtakes the deferred ones
    for i in range(len(trace)):
        assert r.token_times(i) == pytest.approx(np.array(expected[i]), rel=1e-12, abs=1e-9)
    assert (r.peak_running, r.peak_kv_blocks, r.peak_kv_tokens) == (peaks["running"], peaks["blocks"], peaks["tokens"])


def test_run_ends_at_the_last_completion():
    trace = make_trace([0.5, 0.6], [10, 10], [3, 4])
    r = simulate(trace, fixed_cost(decode_s=1.0, prefill_s=2.0), "continuous", 4)
    assert math.isfinite(r.end_s)
    assert r.end_s == np.max(r.completion_s)


def test_lone_request_takes_one_prefill_then_one_decode_step_per_token(growing_cost):
    prompt, output = 200, 6
    trace = make_trace([1.0], [prompt], [output])
    for policy in POLICIES:
        r = simulate(trace, growing_cost, policy, 8, record_tokens=True)
        prefill = growing_cost.prefill_time(prompt)
        # decode step j reads the prompt and the j tokens generated so far
        decodes = [growing_cost.decode_time(1, prompt + j, prompt + j) for j in range(1, output)]
        assert r.first_token_s[0] - r.arrival_s[0] == prefill
        assert np.array_equal(np.diff(r.token_times(0)), decodes)
        tpot = (r.completion_s[0] - r.first_token_s[0]) / (output - 1)
        assert tpot == pytest.approx(np.mean(decodes), rel=1e-12)


def test_requests_far_apart_do_not_interact(growing_cost):
    trace = make_trace([1.0, 100.0, 200.0], [100, 300, 50], [5, 9, 2])
    r = simulate(trace, growing_cost, "continuous_chunked", 4)
    for i, (p, o) in enumerate(zip(trace.prompt_tokens, trace.output_tokens)):
        service = growing_cost.prefill_time(p) + sum(growing_cost.decode_time(1, p + j, p + j) for j in range(1, o))
        assert r.scheduled_s[i] == r.arrival_s[i]
        assert r.completion_s[i] - r.arrival_s[i] == pytest.approx(service, rel=1e-12)


def test_static_batch_admits_nobody_until_it_drains():
    trace = make_trace([0.0, 0.0, 0.5, 0.6], [10, 10, 10, 10], [3, 6, 2, 2])
    r = simulate(trace, fixed_cost(decode_s=1.0, prefill_s=2.0), "static", 4)
    # batch {0, 1}: one prefill call each (4 s), then decodes until request 1's sixth token at 9 s
    assert list(r.first_token_s[:2]) == [4.0, 4.0]
    assert list(r.completion_s[:2]) == [6.0, 9.0]
    assert list(r.scheduled_s[2:]) == [9.0, 9.0]


def test_continuous_admits_into_a_running_batch_and_stalls_its_decodes():
    trace = make_trace([0.0, 2.5], [10, 10], [6, 2])
    r = simulate(trace, fixed_cost(decode_s=1.0, prefill_s=2.0), "continuous", 4, record_tokens=True)
    # request 0: prefill 0-2, decode 2-3; request 1 arrives during it, prefills 3-5 alone
    assert r.scheduled_s[1] == 3.0
    assert r.first_token_s[1] == 5.0
    assert list(r.token_times(0)) == [2.0, 3.0, 6.0, 7.0, 8.0, 9.0]
    assert list(r.token_times(1)) == [5.0, 6.0]


def test_chunked_prefill_rides_along_with_decodes():
    cost = fixed_cost(decode_s=1.0, prefill_s=0.0, prefill_per_token_s=1 / 512)
    trace = make_trace([0.0, 1.5], [512, 1000], [8, 2])
    r = simulate(trace, cost, "continuous_chunked", 4, chunk_size=512, record_tokens=True)
    # request 0 prefills 0-1; the 1000-token prompt goes 512 + 488 alongside request 0's decodes
    assert r.scheduled_s[1] == 2.0
    assert list(r.token_times(0)[:4]) == [1.0, 2.0, 4.0, 2.0 + 2.0 + 1.0 + 488 / 512]
    assert r.first_token_s[1] == r.token_times(0)[3]


def test_a_step_token_budget_gives_a_decoding_sequence_one_token_of_the_chunk():
    cost = fixed_cost(decode_s=1.0, prefill_s=0.0, prefill_per_token_s=1 / 512)
    trace = make_trace([0.0, 1.5], [512, 1000], [8, 2])
    r = simulate(trace, cost, "continuous_chunked", 4, chunk_size=512, record_tokens=True, record_steps=True,
                 chunk_budget="step_tokens")
    # the 1000-token prompt goes 511 + 489 beside request 0's decode (512 + 488 counting prompts only)
    assert list(r.step_table["prefill_tokens"][2:4]) == [511, 489]
    assert list(r.token_times(0)[:4]) == [1.0, 2.0, 2.0 + 1.0 + 511 / 512, 2.0 + 2.0 + 1000 / 512]
    assert r.first_token_s[1] == r.token_times(0)[3]


def test_the_default_chunk_budget_counts_prompt_tokens_only():
    trace = workload.generate({**workload.PRESETS["exercise2"], "num_requests": 200}, 3)
    default = simulate(trace, GROWING, "continuous_chunked", 8, chunk_size=64, record_tokens=True)
    prompts = simulate(trace, GROWING, "continuous_chunked", 8, chunk_size=64, record_tokens=True,
                       chunk_budget="prompt_tokens")
    steps = simulate(trace, GROWING, "continuous_chunked", 8, chunk_size=64, record_tokens=True,
                     chunk_budget="step_tokens")
    assert np.array_equal(default.completion_s, prompts.completion_s)
    assert np.array_equal(default.first_token_s, prompts.first_token_s)
    assert not np.array_equal(default.first_token_s, steps.first_token_s)


def test_cap_is_respected_under_load(growing_cost):
    trace = workload.generate({**workload.CAPSTONE, "num_requests": 300, "rate": 50.0}, seed=3)
    for policy in POLICIES:
        for cap in (1, 3, 8):
            r = simulate(trace, growing_cost, policy, cap, horizon_factor=1000.0)
            assert r.peak_running == cap
            assert r.finished.all()


def test_tiny_kv_cache_preempts_and_recomputes_yet_everything_finishes(growing_cost):
    trace = make_trace(np.arange(8) * 0.001, [40] * 8, [60] * 8)
    # llamacpp reserves each slot's KV and never preempts (tests/test_llamacpp_policy.py)
    for policy in (p for p in POLICIES if p != "llamacpp"):
        r = simulate(trace, growing_cost, policy, 8, kv_blocks=14, block_size=8)
        assert r.finished.all()
        assert np.array_equal(r.generated, trace.output_tokens)
        assert r.preemptions.sum() > 0
        assert r.peak_kv_blocks <= 14
        # every recompute covers the whole prompt and at least the first generated token
        preempted = r.preemptions > 0
        assert np.all(r.recomputed_tokens[preempted] >= r.preemptions[preempted] * 41)


def test_same_seed_same_result_and_different_seeds_differ(growing_cost):
    spec = {**workload.CAPSTONE, "num_requests": 200}
    a, b, c = (simulate(workload.generate(spec, seed), growing_cost, "continuous_chunked", 8)
               for seed in (4, 4, 5))
    for name in ("scheduled_s", "first_token_s", "completion_s", "generated", "preemptions"):
        assert np.array_equal(getattr(a, name), getattr(b, name), equal_nan=True)
    assert not np.array_equal(a.completion_s, c.completion_s)


@given(trace=small_traces, speedup=st.sampled_from([1.5, 2.0, 4.0]), policy=st.sampled_from(["static", "continuous"]))
def test_one_at_a_time_a_faster_machine_never_delays_a_request(trace, speedup, policy):
    # with cap 1 the replica is a FCFS single server, whose waiting times (Lindley's recursion) only
    # shrink when every service time does
    slow = simulate(trace, GROWING, policy, 1)
    fast = simulate(trace, GROWING.scaled(speedup), policy, 1)
    assert np.all(fast.first_token_s - fast.arrival_s <= slow.first_token_s - slow.arrival_s + 1e-12)
    assert np.all(fast.completion_s <= slow.completion_s + 1e-12)


def test_one_slot_with_fixed_service_is_an_md1_queue():
    # prefill 2 + 4 decodes of 0.5 = a deterministic 4 s service; rho = 0.5
    service_s, rho, n = 4.0, 0.5, 20_000
    spec = {"num_requests": n, "rate": rho / service_s,
            "prompt": {"dist": "constant", "value": 100}, "output": {"dist": "constant", "value": 5}}
    waits = []
    for seed in range(2):
        r = simulate(workload.generate(spec, seed), fixed_cost(decode_s=0.5, prefill_s=2.0), "continuous", 1)
        assert r.completion_s - r.scheduled_s == pytest.approx(np.full(n, service_s), abs=1e-6)
        waits.append(np.mean(r.scheduled_s - r.arrival_s))
    pollaczek_khinchine = rho * service_s / (2 * (1 - rho))
    assert np.mean(waits) == pytest.approx(pollaczek_khinchine, rel=0.05)


def test_an_overloaded_replica_is_truncated_and_unstable(growing_cost):
    spec = {**workload.CAPSTONE, "num_requests": 200, "rate": 200.0}
    r = simulate(workload.generate(spec, 0), growing_cost.scaled(0.05), "continuous", 2, horizon_factor=1.0)
    assert r.truncated
    assert not r.stable
    assert not r.finished.all()
    assert r.end_s >= r.arrival_s[-1] + 60.0


def test_a_request_too_long_for_the_cache_is_rejected_not_run(growing_cost):
    trace = make_trace([0.0, 1.0], [100, 10], [100, 10])
    r = simulate(trace, growing_cost, "continuous", 4, kv_blocks=10, block_size=16)
    assert list(r.rejected) == [True, False]
    assert list(r.finished) == [False, True]
    assert not r.stable


@given(gap=st.floats(1e-6, 1e3), d0=st.floats(1e-4, 1.0), dd=st.sampled_from([0.0, 1e-7, 1e-5, 1e-3]))
def test_steps_to_reach_is_the_smallest_count_that_covers_the_gap(gap, d0, dd):
    k = steps_to_reach(gap, d0, dd)

    def elapsed(m):
        return m * d0 + dd * m * (m - 1) / 2

    assert elapsed(k) >= gap * (1 - 1e-12)
    assert k == 1 or elapsed(k - 1) < gap * (1 + 1e-12)


@settings(max_examples=15)
@given(seed=st.integers(0, 2**16))
def test_token_spans_are_recorded_without_changing_the_run(seed):
    trace = workload.generate({**workload.CAPSTONE, "num_requests": 60}, seed)
    plain = simulate(trace, GROWING, "continuous_chunked", 4)
    recorded = simulate(trace, GROWING, "continuous_chunked", 4, record_tokens=True)
    assert plain.token_spans is None
    assert np.array_equal(plain.completion_s, recorded.completion_s)
    with pytest.raises(ValueError, match="record_tokens"):
        plain.token_times(0)
