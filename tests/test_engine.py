"""The real engine on a tiny GPT-2: every request ends with its tokens or an error, and batching,
chunking and preemption leave the greedy tokens exactly those of a plain one-sequence loop."""
import numpy as np
import pandas as pd
import pytest
import torch

from servingplan.costmodel import EXERCISE2
from servingplan.engine import Engine
from servingplan.engine.engine import ENGINE_STEP_COLUMNS
from servingplan.engine.replay import compare, predict_steps, replay, request_pairs
from servingplan.profile import kvpool
from servingplan.profile.model import load_model
from servingplan.simulate import POLICIES, simulate
from servingplan.simulate.steps import STEP_COLUMNS
from servingplan.simulate.workload import Trace

TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 128, "vocab_size": 1000}
# One thread: the tests share two cores with whatever else runs, and idle OpenMP workers spinning
# against other processes make a tiny model's steps erratic.
THREADS = 1
WALL_S = 60.0


@pytest.fixture(scope="module")
def model():
    return load_model("random", 0, TINY)[0]


@pytest.fixture(scope="module")
def trace():
    rng = np.random.default_rng(1)
    n = 10
    return Trace(np.sort(rng.uniform(0.0, 0.1, n)), rng.integers(5, 60, n), rng.integers(1, 25, n))


def greedy_reference(model, prompt: list, tokens: int) -> list:
    """The plainest greedy decoding: the whole sequence through the model for every token, no cache."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(tokens):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def serve(model, trace, policy, max_num_seqs=4, chunk_size=16, kv_blocks=None, block_size=16,
          max_wall_s=WALL_S):
    return Engine(model, policy, max_num_seqs, chunk_size, kv_blocks, block_size, THREADS).run(
        trace, max_wall_s, seed=0)


def assert_matches_reference(model, run, ids):
    for i in ids:
        assert run.tokens[i] == greedy_reference(model, run.prompts[i], len(run.tokens[i])), f"request {i}"


@pytest.mark.parametrize("policy", POLICIES)
def test_every_request_finishes_with_its_tokens_equal_to_plain_greedy(model, trace, policy):
    # chunk_size 16 under prompts of up to 59 tokens: chunked prefill spans up to 4 steps
    run = serve(model, trace, policy)
    result = run.result
    assert run.errors == {}
    assert result.finished.all() and not result.truncated
    assert np.array_equal(result.generated, trace.output_tokens)
    assert [len(t) for t in run.tokens] == list(trace.output_tokens)
    assert (run.steps["batch"] > 1).any(), "decodes were never batched"
    assert_matches_reference(model, run, range(len(trace)))


def test_preemption_recomputes_and_changes_no_token(model, trace):
    # 22 blocks of 4 tokens hold 88: the longest request (75 tokens) fits alone, four at once do not
    run = serve(model, trace, "continuous", kv_blocks=22, block_size=4)
    result = run.result
    assert result.preemptions.sum() > 0 and result.recomputed_tokens.sum() > 0
    assert run.errors == {} and result.finished.all()
    assert np.array_equal(result.generated, trace.output_tokens)
    assert_matches_reference(model, run, np.flatnonzero(result.preemptions))


def test_bad_requests_are_refused_and_the_rest_carry_on(model):
    prompts = np.array([20, 0, 30, 100, 10, 40])
    outputs = np.array([5, 5, 0, 40, 6, 3])  # request 3: 140 tokens > n_positions 128
    trace = Trace(np.linspace(0.0, 0.02, 6), prompts, outputs)
    run = serve(model, trace, "continuous")
    assert sorted(run.errors) == [1, 2, 3]
    assert "prompt" in run.errors[1] and "output" in run.errors[2] and "n_positions" in run.errors[3]
    assert run.result.meta["errors"] == run.errors
    assert list(run.result.rejected) == [False, True, True, True, False, False]
    assert list(run.result.finished) == [True, False, False, False, True, True]
    assert [len(t) for t in run.tokens] == [5, 0, 0, 0, 6, 3]


def test_a_request_too_big_for_the_kv_budget_is_refused_with_a_reason(model):
    trace = Trace(np.array([0.0, 0.01]), np.array([50, 10]), np.array([20, 5]))
    run = serve(model, trace, "continuous", kv_blocks=4, block_size=16)
    assert list(run.errors) == [0] and "KV blocks" in run.errors[0]
    assert list(run.result.finished) == [False, True]


def test_a_failing_model_call_errors_its_requests_only(model, monkeypatch):
    real_prefill = kvpool.prefill_call

    def prefill_failing_on_37_tokens(model, input_ids, cache=None):
        if input_ids.shape[1] == 37:
            raise RuntimeError("injected failure")
        return real_prefill(model, input_ids, cache)

    monkeypatch.setattr(kvpool, "prefill_call", prefill_failing_on_37_tokens)
    trace = Trace(np.array([0.0, 0.0, 0.01]), np.array([12, 37, 20]), np.array([4, 4, 4]))
    run = serve(model, trace, "continuous", max_num_seqs=1)
    assert list(run.errors) == [1] and "injected failure" in run.errors[1]
    assert list(run.result.finished) == [True, False, True]


def test_max_wall_s_stops_the_run_and_reports_the_rest_unfinished(model):
    # arrivals spread over 100 s; the bound stops the run long before
    trace = Trace(np.linspace(0.0, 100.0, 6), np.full(6, 20), np.full(6, 10))
    run = serve(model, trace, "continuous", max_wall_s=0.5)
    result = run.result
    assert result.truncated
    assert not result.finished.all() and result.finished[0]
    unfinished = list(np.flatnonzero(~result.finished))
    assert result.meta["unfinished"] == unfinished and run.errors == {}
    assert all(len(run.tokens[i]) == 10 for i in np.flatnonzero(result.finished))


def test_timestamps_are_ordered_within_each_request_and_across_steps(model, trace):
    run = serve(model, trace, "continuous_chunked", max_num_seqs=3)
    result = run.result
    for i in range(len(trace)):
        times = result.token_times(i)
        assert len(times) == trace.output_tokens[i]
        assert np.all(np.diff(times) > 0)
        assert result.arrival_s[i] <= result.scheduled_s[i] <= times[0]
        assert times[0] == result.first_token_s[i] and times[-1] == result.completion_s[i]
    steps = run.steps
    # the shared recorder's columns, then the engine's own
    assert list(steps.columns) == list(STEP_COLUMNS + ENGINE_STEP_COLUMNS)
    ends = (steps["start_s"] + steps["duration_s"]).to_numpy()
    assert np.all(steps["start_s"].to_numpy()[1:] >= ends[:-1])
    assert (steps["overhead_s"] >= 0).all() and steps["emitted"].sum() == trace.output_tokens.sum()


def test_replay_compares_with_a_simulation_of_the_same_trace(model, trace):
    measured, steps = replay(trace, model, "continuous_chunked", 4, 16, max_wall_s=WALL_S, threads=THREADS)
    simulated = simulate(trace, EXERCISE2, "continuous_chunked", 4, 16, record_tokens=True)
    table = compare(measured, simulated)
    assert list(table.columns) == ["metric", "stat", "n", "measured_ms", "measured_lo_ms", "measured_hi_ms",
                                   "simulated_ms", "diff_pct"]
    assert (table.measured_lo_ms <= table.measured_hi_ms).all()
    assert len(table) == 12 and (table["n"] > 0).all()
    assert table[["measured_ms", "simulated_ms"]].notna().all().all()
    same = compare(measured, measured)
    assert np.allclose(same["diff_pct"], 0.0)

    pairs = request_pairs(measured, simulated)
    assert len(pairs) == len(trace) and pairs["finished_both"].all()
    assert np.allclose(pairs["measured_ttft_ms"], (measured.first_token_s - measured.arrival_s) * 1e3)

    predicted = predict_steps(steps, EXERCISE2)
    assert len(predicted) == len(steps) and (predicted["predicted_s"] > 0).all()


def test_compare_refuses_runs_of_different_traces(model, trace):
    simulated = simulate(trace, EXERCISE2, "continuous", 4)
    other = Trace(trace.arrival_s, trace.prompt_tokens + 1, trace.output_tokens)
    with pytest.raises(ValueError, match="different traces"):
        compare(simulate(other, EXERCISE2, "continuous", 4), simulated)


def test_the_step_frame_is_empty_but_well_formed_when_nothing_runs(model):
    run = serve(model, Trace(np.array([0.0]), np.array([0]), np.array([3])), "continuous")
    assert isinstance(run.steps, pd.DataFrame) and run.steps.empty
    assert list(run.steps.columns) == list(STEP_COLUMNS + ENGINE_STEP_COLUMNS) and list(run.errors) == [0]


def test_slot_moves_keep_a_chunk_written_in_the_same_step(model):
    # chunk 16, three slots, all at t=0. Step 1 prefills A whole (slot 2) and 6 tokens of B (slot 1);
    # step 2 decodes A, which must move to slot 0, in the same step as B's last chunk and C's first
    # one are written: no move may lose or clobber a chunk.
    trace = Trace(np.zeros(3), np.array([10, 10, 40]), np.array([12, 12, 12]))
    run = serve(model, trace, "continuous_chunked", max_num_seqs=3, chunk_size=16)
    assert run.steps["kv_moved_tokens"].sum() > 0
    assert_matches_reference(model, run, range(3))


def test_a_step_token_budget_in_the_real_engine_keeps_every_step_within_it(model, trace):
    # four slots and an 8-token budget: a step of d decodes carries at most 8 - d prompt tokens
    run = Engine(model, "continuous_chunked", 4, 8, None, 16, THREADS, chunk_budget="step_tokens").run(
        trace, WALL_S, seed=0)
    assert run.errors == {} and run.result.finished.all()
    assert (run.steps["batch"] + run.steps["prefill_tokens"] <= 8).all()
    assert ((run.steps["batch"] > 0) & (run.steps["prefill_tokens"] == 8 - run.steps["batch"])).any()
    assert_matches_reference(model, run, range(len(trace)))


def test_idle_time_is_offered_between_steps_and_progress_counts_finished_requests(model):
    # three requests far apart: the engine idles between them
    trace = Trace(np.array([0.0, 0.3, 0.6]), np.array([5, 6, 7]), np.array([2, 2, 2]))
    gaps, finished = [], []

    def while_idle(gap_s, steps):
        gaps.append((gap_s, len(steps)))
    run = Engine(model, "continuous", 2, threads=THREADS).run(trace, WALL_S, seed=0, while_idle=while_idle,
                                                              on_finished=finished.append)
    assert run.result.finished.all()
    # offered only while nothing runs, before a later arrival, and never longer than the wait for it
    assert gaps and all(0 < gap <= 0.6 for gap, _ in gaps)
    assert any(done_steps > 0 for _, done_steps in gaps)
    assert finished[-1] == 3 and finished == sorted(finished)
