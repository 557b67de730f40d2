"""The pure scheduler, driven by hand with schedule()/complete() as the real engine drives it."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from servingplan.simulate import POLICIES, BlockManager, Scheduler, Seq
import servingplan.simulate.scheduler as scheduler_module


def run_step(sched: Scheduler):
    step = sched.schedule()
    emitted, finished = sched.complete(step)
    return step, emitted, finished


def test_scheduler_reads_no_clock():
    tree = ast.parse(Path(scheduler_module.__file__).read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in node.names} | {node.module.split(".")[0] for node in ast.walk(tree)
                                            if isinstance(node, ast.ImportFrom) and node.module}
    assert not imported & {"time", "datetime", "asyncio", "threading", "random"}


def test_static_forms_a_batch_and_admits_nobody_until_it_drains():
    sched = Scheduler("static", 4)
    a, b, late = Seq(0, 10, 2), Seq(1, 10, 4), Seq(2, 10, 2)
    sched.add(a)
    sched.add(b)
    step, emitted, _ = run_step(sched)
    assert [s for s, _ in step.prefills] == [a, b] and not step.decodes
    assert emitted == [a, b]
    sched.add(late)
    step, _, finished = run_step(sched)
    assert step.decodes == [a, b] and not step.prefills and finished == [a]
    for _ in range(2):
        step, _, _ = run_step(sched)
        assert step.decodes == [b] and list(sched.waiting) == [late]
    step, _, _ = run_step(sched)
    assert step.admitted == [late]


def test_continuous_prefills_a_newcomer_alone_while_decodes_wait():
    sched = Scheduler("continuous", 4)
    old, new = Seq(0, 10, 5), Seq(1, 300, 5)
    sched.add(old)
    run_step(sched)
    sched.add(new)
    step, emitted, _ = run_step(sched)
    assert step.prefills == [(new, 300)] and step.decodes == []
    assert emitted == [new] and old.generated == 1
    step, _, _ = run_step(sched)
    assert step.decodes == [old, new]


def test_chunked_splits_a_long_prompt_over_steps_alongside_decodes():
    sched = Scheduler("continuous_chunked", 4, chunk_size=512)
    old, long = Seq(0, 10, 10), Seq(1, 1000, 3)
    sched.add(old)
    run_step(sched)
    sched.add(long)
    step, emitted, _ = run_step(sched)
    assert step.decodes == [old] and step.prefills == [(long, 512)] and emitted == [old]
    step = sched.schedule()
    assert step.decodes == [old] and step.prefills == [(long, 488)]
    assert step.prefill_calls() == [(488, 512)]    # the second chunk attends to the first
    emitted, _ = sched.complete(step)
    assert emitted == [long, old]
    step, _, _ = run_step(sched)
    assert step.decodes == [old, long] and not step.prefills


def test_chunk_budget_is_shared_in_admission_order():
    sched = Scheduler("continuous_chunked", 8, chunk_size=100)
    seqs = [Seq(i, 70, 2) for i in range(3)]
    for s in seqs:
        sched.add(s)
    step = sched.schedule()
    assert step.prefills == [(seqs[0], 70), (seqs[1], 30)]
    assert list(sched.waiting) == [seqs[2]]


def test_a_step_token_budget_counts_each_decode_against_the_chunk():
    def schedule_long_prompt(**budget):
        sched = Scheduler("continuous_chunked", 4, chunk_size=100, **budget)
        a, b, long = Seq(0, 10, 10), Seq(1, 10, 10), Seq(2, 250, 3)
        sched.add(a)
        sched.add(b)
        step, _, _ = run_step(sched)
        assert step.prefills == [(a, 10), (b, 10)] and not step.decodes
        sched.add(long)
        steps = [run_step(sched)[0] for _ in range(4)]
        assert all(s.decodes[:2] == [a, b] for s in steps)
        return [[n for _, n in s.prefills] for s in steps]

    # the source's chunk: 100 prompt tokens beside the two decodes; vLLM's budget: 100 - 2 of them
    assert schedule_long_prompt() == [[100], [100], [50], []]
    assert schedule_long_prompt(chunk_budget="prompt_tokens") == [[100], [100], [50], []]
    assert schedule_long_prompt(chunk_budget="step_tokens") == [[98], [98], [54], []]


@pytest.mark.parametrize("policy", POLICIES)
def test_cap_bounds_the_running_set(policy):
    sched = Scheduler(policy, 3)
    for i in range(10):
        sched.add(Seq(i, 20, 4))
    while not sched.idle:
        run_step(sched)
        assert len(sched.running) <= 3


def test_a_full_cache_preempts_the_newest_which_recomputes_prompt_and_generated_tokens():
    # 4 blocks of 4 tokens; two sequences of prompt 6 hold 2 blocks each after prefill
    sched = Scheduler("continuous", 4, kv=BlockManager(4, block_size=4))
    old, new = Seq(0, 6, 6), Seq(1, 6, 6)
    sched.add(old)
    sched.add(new)
    run_step(sched)                       # both prefill: 2 + 2 blocks, one token each
    run_step(sched)                       # context 7 and 7: still two blocks each
    assert sched.kv.used == 4
    step = sched.schedule()               # context 8 fits; 9 will not
    assert step.decodes == [old, new] and not step.preempted
    sched.complete(step)
    step = sched.schedule()               # old needs a third block: new is evicted
    assert step.preempted == [new] and step.decodes == [old]
    assert new.preemptions == 1 and new.recomputed_tokens == 6 + 3
    assert new.prefill_target == 9 and new.prefilled == 0 and new.blocks == 0
    assert list(sched.waiting) == [new]
    sched.complete(step)
    while old in sched.running:
        run_step(sched)
    step, emitted, _ = run_step(sched)    # readmitted: one prefill of all 9 tokens emits token 4
    assert step.prefills == [(new, 9)] and emitted == [new] and new.generated == 4


def test_block_manager_counts_blocks():
    kv = BlockManager(5, block_size=4)
    s = Seq(0, 9, 1)
    assert kv.blocks_for(9) == 3 and kv.blocks_for(8) == 2 and kv.blocks_for(0) == 0
    assert kv.grow(s, 9) and (s.blocks, kv.used, kv.free) == (3, 3, 2)
    assert kv.grow(s, 12) and kv.used == 3
    assert not kv.grow(s, 21) and kv.used == 3
    kv.release(s)
    assert (s.blocks, kv.used) == (0, 0)
    assert kv.fits(20) and not kv.fits(21)
    assert BlockManager(None).fits(10 ** 9)


def test_a_request_that_can_never_fit_is_refused():
    sched = Scheduler("continuous", 4, kv=BlockManager(2, block_size=4))
    assert not sched.add(Seq(0, 6, 4))      # 9 KV entries > 2 blocks of 4
    assert sched.rejected and sched.idle


@pytest.mark.parametrize("kwargs, match", [
    ({"policy": "fifo"}, "policy"), ({"max_num_seqs": 0}, "max_num_seqs"), ({"chunk_size": 0}, "chunk_size"),
    ({"chunk_budget": "all"}, "chunk_budget"),
    # 4 decodes would fill a 3-token step and leave a prefilling sequence no token
    ({"policy": "continuous_chunked", "max_num_seqs": 4, "chunk_size": 3, "chunk_budget": "step_tokens"},
     "chunk_size=3: .* >= max_num_seqs")])
def test_bad_settings_are_refused(kwargs, match):
    args = {"policy": "continuous", "max_num_seqs": 4, "chunk_size": 512, "chunk_budget": "prompt_tokens", **kwargs}
    with pytest.raises(ValueError, match=match):
        Scheduler(args["policy"], args["max_num_seqs"], args["chunk_size"], chunk_budget=args["chunk_budget"])


def serve_arrivals(sched: Scheduler, jobs, check) -> tuple[list[int], set[int]]:
    """Feed `jobs` (prompt, reply, steps to wait after the previous arrival) to `sched` as they
    arrive and step it until all are served, calling check(step, busy) after each step completes
    (busy: the scheduler had work before it); (ids finished, ids accepted). Bounded, so a stall fails
    instead of hanging."""
    pending = [Seq(i, p, o) for i, (p, o, _) in enumerate(jobs)]
    delays = [d for _, _, d in jobs]
    finished_ids, accepted = [], set()
    for _ in range(10_000):
        while pending and delays[0] == 0:
            seq = pending.pop(0)
            delays.pop(0)
            if sched.add(seq):
                accepted.add(seq.id)
        if delays:
            delays[0] -= 1
        if sched.idle and not pending:
            break
        busy = not sched.idle
        step = sched.schedule()
        _, finished = sched.complete(step)
        finished_ids += [s.id for s in finished]
        check(step, busy)
    assert not pending
    return finished_ids, accepted


@given(policy=st.sampled_from(POLICIES), cap=st.integers(1, 5), kv_blocks=st.sampled_from([None, 12, 25]),
       chunk=st.sampled_from([8, 64]),
       jobs=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 30), st.integers(0, 3)), min_size=1, max_size=15))
def test_invariants_hold_at_every_step(policy, cap, kv_blocks, chunk, jobs):
    """Requests join between steps; the cache stays consistent and every request finishes once."""
    sched = Scheduler(policy, cap, chunk, BlockManager(kv_blocks, block_size=8))

    def check(step, busy):
        assert len(sched.running) <= cap
        assert sched.kv.used == sum(s.blocks for s in sched.running)
        assert kv_blocks is None or sched.kv.used <= kv_blocks
        for s in sched.running:
            assert s.blocks >= sched.kv.blocks_for(s.kv_tokens)

    finished_ids, accepted = serve_arrivals(sched, jobs, check)
    assert sched.idle
    assert sorted(finished_ids) == sorted(accepted)


def test_a_request_that_exactly_fills_the_cache_is_served():
    # the last token's KV entry is never written, so prompt 8 + 9 replies needs 16 entries: one block
    sched = Scheduler("continuous", 1, kv=BlockManager(1, block_size=16))
    seq = Seq(0, 8, 9)
    assert sched.add(seq)
    while not sched.idle:
        run_step(sched)
        assert sched.kv.used <= 1
    assert seq.generated == 9 and seq.preemptions == 0


@given(cap=st.integers(1, 6), spare=st.sampled_from([0, 0, 1, 7, 200]), kv_blocks=st.sampled_from([None, 12, 25]),
       jobs=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 30), st.integers(0, 3)), min_size=1, max_size=15))
def test_a_step_token_budget_holds_in_every_step_and_never_stalls(cap, spare, kv_blocks, jobs):
    """Down to the smallest budget allowed (the cap), every step carries work within the budget and
    every request finishes."""
    budget = cap + spare
    sched = Scheduler("continuous_chunked", cap, budget, BlockManager(kv_blocks, block_size=8), "step_tokens")

    def check(step, busy):
        assert len(step.decodes) + sum(n for _, n in step.prefills) <= budget
        assert not (busy and step.empty)

    finished_ids, accepted = serve_arrivals(sched, jobs, check)
    assert sched.idle and sorted(finished_ids) == sorted(accepted)
