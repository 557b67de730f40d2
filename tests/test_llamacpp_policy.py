"""The `llamacpp` policy against a slot schedule worked out by hand from llama-server's update_slots
(llama.cpp 0c1e570, tools/server/server-context.cpp)."""
from servingplan.simulate import BlockManager, Scheduler, Seq
import pytest

from servingplan.simulate.llamacpp_slots import micro_batches, slots_of, step_time
from servingplan.simulate.policies import POLICIES, label


def run(sched):
    """One iteration: (slot of each held request, generating slots' requests, prompt tokens per request)."""
    step = sched.schedule()
    table = slots_of(sched)
    held = {s.id: i for i, s in enumerate(table.seq) if s is not None}
    # the step names the slot of each decode and prompt chunk, which its micro-batches follow
    assert step.slots == ([held[s.id] for s in step.decodes], [held[s.id] for s, _ in step.prefills])
    out = (held, [s.id for s in step.decodes], [(s.id, n) for s, n in step.prefills])
    sched.complete(step)
    return out


def test_the_policy_is_registered():
    assert "llamacpp" in POLICIES and label("llamacpp") == "llama.cpp server slots"


def test_slots_lru_fifo_and_n_batch_filling_follow_the_hand_worked_schedule():
    # 3 slots (-np 3), n_batch 8. Requests (id: prompt, output), all queued before the first iteration.
    sched = Scheduler("llamacpp", 3, chunk_size=8)
    for seq in [Seq("A", 5, 3), Seq("B", 6, 2), Seq("C", 4, 2), Seq("D", 3, 2)]:
        sched.add(seq)
    # Worked by hand:
    # it 1: all slots unused (t_last_used -1, ties to the last scanned): A->slot 2, B->slot 1, C->slot 0;
    #       D waits. No decodes. Prompts in slot order: C 4 (done: first token), B 4 of 6; batch full (8).
    # it 2: decodes C (slot 0), 1 token. Prompts: B's last 2 (first token), A 5 (first token): 8 tokens.
    #       C has its 2 tokens: done, released.
    # it 3: D takes the only idle slot, 0. Decodes slot 1 (B), slot 2 (A); prompt D 3 (first token).
    #       B done (2 tokens).
    # it 4: decodes slot 0 (D), slot 2 (A): D done (2), A done (3).
    assert run(sched) == ({"C": 0, "B": 1, "A": 2}, [], [("C", 4), ("B", 4)])
    assert run(sched) == ({"C": 0, "B": 1, "A": 2}, ["C"], [("B", 2), ("A", 5)])
    assert run(sched) == ({"D": 0, "B": 1, "A": 2}, ["B", "A"], [("D", 3)])
    assert run(sched) == ({"D": 0, "A": 2}, ["D", "A"], [])
    assert sched.idle
    # LRU: slot 1 was released first (iteration 4); slots 0 and 2 in the same iteration (5), slot 0 first
    # in slot order, so E -> slot 1, F -> slot 0, G -> slot 2.
    for seq in [Seq("E", 2, 1), Seq("F", 2, 1), Seq("G", 2, 1)]:
        sched.add(seq)
    assert run(sched) == ({"F": 0, "E": 1, "G": 2}, [], [("F", 2), ("E", 2), ("G", 2)])
    assert sched.idle


def test_a_long_prompt_is_split_across_iterations_behind_the_decodes():
    # 2 slots, n_batch 4: one short request decodes while a 9-token prompt fills what is left
    sched = Scheduler("llamacpp", 2, chunk_size=4)
    sched.add(Seq("s", 1, 4))
    assert run(sched) == ({"s": 1}, [], [("s", 1)])
    sched.add(Seq("L", 9, 1))
    assert run(sched) == ({"L": 0, "s": 1}, ["s"], [("L", 3)])
    assert run(sched) == ({"L": 0, "s": 1}, ["s"], [("L", 3)])
    assert run(sched) == ({"L": 0, "s": 1}, ["s"], [("L", 3)])   # s done; L's last 3: its only token
    assert sched.idle


def test_no_preemption_the_context_is_reserved_when_a_slot_is_taken():
    # room for 2 blocks of 8: the first request reserves 12 - 1 entries, the second must wait for it
    sched = Scheduler("llamacpp", 2, chunk_size=16, kv=BlockManager(2, block_size=8))
    a, b = Seq("a", 4, 8), Seq("b", 4, 8)
    sched.add(a)
    sched.add(b)
    held, _, _ = run(sched)
    assert held == {"a": 1} and list(sched.waiting) == [b]
    while a in sched.running:
        step = sched.schedule()
        assert not step.preempted
        sched.complete(step)
    assert a.preemptions == 0 and a.generated == 8
    held, _, prefills = run(sched)
    assert held == {"b": 0} and prefills == [("b", 4)]


def test_micro_batches_follow_llama_cpp_sequential_split_of_a_batch():
    # decodes in slots 0, 1 and 5 (contexts 10, 20, 30): two passes over the weights, {0, 1} and {5}
    assert micro_batches([(0, 10), (1, 20), (5, 30)], [], 512) == [(1, [(0, 9), (1, 19)]), (1, [(5, 29)])]
    # decodes in slots 0, 1, 2 and 5, then a 10-token prompt in slot 3: its first token follows slot 2, so it
    # joins the first pass; slot 5 is the second; the prompt's other 9 tokens the third
    assert micro_batches([(0, 10), (1, 20), (2, 30), (5, 40)], [(3, 10, 0)], 512) == [
        (1, [(0, 9), (1, 19), (2, 29), (3, 0)]), (1, [(5, 39)]), (9, [(3, 1)])]
    # a prompt longer than n_ubatch: 512, 512, then 76 tokens, each after what the earlier ones cached
    assert micro_batches([], [(4, 1100, 0)], 512) == [(512, [(4, 0)]), (512, [(4, 512)]), (76, [(4, 1024)])]
    # prompts in consecutive slots take equal shares while both last, at most n_ubatch in all
    assert micro_batches([], [(3, 400, 0), (4, 300, 0)], 512) == [
        (256, [(3, 0), (4, 0)]), (44, [(3, 256), (4, 256)]), (100, [(3, 300)])]
    assert micro_batches([], [], 512) == []


def test_an_iteration_is_priced_over_its_micro_batches(growing_cost):
    cost = growing_cost
    # a pass of one token per sequence is a decode step; a longer one a prefill call per sequence
    assert step_time(cost, [(0, 10), (1, 20), (5, 30)], [], 512) == pytest.approx(
        cost.decode_time(2, 30, 20) + cost.decode_time(1, 30, 30), rel=1e-12)
    assert step_time(cost, [(0, 10)], [(1, 5, 0)], 512) == pytest.approx(
        cost.decode_time(2, 11, 10) + cost.prefill_time(4, 1), rel=1e-12)
    assert step_time(cost, [], [(4, 1100, 0)], 512) == pytest.approx(
        cost.prefill_time(512, 0) + cost.prefill_time(512, 512) + cost.prefill_time(76, 1024), rel=1e-12)
    # slots running together cost less than the same decodes split across passes
    assert step_time(cost, [(0, 10), (1, 10)], [], 512) < step_time(cost, [(0, 10), (2, 10)], [], 512)


@pytest.mark.parametrize("n_ubatch", [0, -1])
def test_a_micro_batch_size_below_one_is_refused(growing_cost, n_ubatch):
    import numpy as np
    from conftest import make_trace
    from servingplan.simulate import simulate
    with pytest.raises(ValueError, match=f"^n_ubatch={n_ubatch}: must be >= 1$"):
        simulate(make_trace(np.zeros(1), [8], [2]), growing_cost, "llamacpp", 2, n_ubatch=n_ubatch)


def test_the_simulator_prices_decodes_in_slots_apart_as_separate_passes(growing_cost):
    import numpy as np
    from conftest import make_trace
    from servingplan.simulate import simulate
    # A (id 0) takes slot 2, B slot 1, C slot 0. Once B is done, A and C decode in slots 2 and 0: two
    # passes of one sequence each, every step until they finish (same prompts, so the same contexts)
    trace = make_trace([0.0, 0.0, 0.0], [8, 8, 8], [30, 2, 30])
    steps = simulate(trace, growing_cost, "llamacpp", 3, record_steps=True).step_table
    apart = steps[(steps["batch"] == 2) & (steps["n_prefill_calls"] == 0)]
    assert len(apart) == 28
    for row in apart.itertuples():
        context = row.ctx_sum / 2
        assert row.ctx_max == context
        assert row.duration_s == pytest.approx(2 * growing_cost.decode_time(1, context, context), rel=1e-12)
        assert row.decode_s == pytest.approx(row.duration_s, rel=1e-12)
    together = steps[steps["batch"] == 3]
    assert len(together) == 1 and together["duration_s"].iloc[0] == pytest.approx(
        growing_cost.decode_time(3, together["ctx_sum"].iloc[0], together["ctx_max"].iloc[0]), rel=1e-12)


def test_the_simulator_runs_the_policy_without_preemption_on_a_tiny_cache(growing_cost):
    import numpy as np
    from conftest import make_trace
    from servingplan.simulate import simulate
    trace = make_trace(np.arange(8) * 0.001, [40] * 8, [60] * 8)
    r = simulate(trace, growing_cost, "llamacpp", 8, kv_blocks=14, block_size=8)
    assert r.finished.all() and r.preemptions.sum() == 0 and r.peak_kv_blocks <= 14
    assert np.array_equal(r.generated, trace.output_tokens)


def test_slots_released_together_take_the_deferred_requests_in_reverse_order():
    # 2 slots, n_batch 16; C, D, E find no idle slot at iteration 1 and are deferred.
    # it 1: A -> slot 1 (highest unused), B -> slot 0; prompts B 2, A 2 (both first tokens).
    # it 2: decodes slot 0 (B), slot 1 (A): both done, released in slot order (slot 0 first).
    # it 3: each release pushed the deferred head to the front of the task queue: C then D, so D is
    #       processed first and takes the least recently used slot, 0; C takes slot 1; E stays deferred.
    #       Prompts in slot order: D 3, C 4.
    sched = Scheduler("llamacpp", 2, chunk_size=16)
    for seq in [Seq("A", 2, 2), Seq("B", 2, 2), Seq("C", 4, 1), Seq("D", 3, 1), Seq("E", 2, 1)]:
        sched.add(seq)
    assert run(sched) == ({"B": 0, "A": 1}, [], [("B", 2), ("A", 2)])
    assert run(sched) == ({"B": 0, "A": 1}, ["B", "A"], [])
    assert run(sched) == ({"D": 0, "C": 1}, [], [("D", 3), ("C", 4)])
    assert [s.id for s in sched.waiting] == ["E"]
    assert run(sched) == ({"E": 0}, [], [("E", 2)])
    assert sched.idle
