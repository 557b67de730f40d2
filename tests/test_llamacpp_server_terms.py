"""llama-server's own steps against the benchmark tool's (servingplan.llamacpp.server_terms): where the pairs are
measured, how a lone request's steps are read from the server's log, when a term is applied, and the model it
gives. The measurement itself runs in the end-to-end test on the tiny GGUF (test_llamacpp_e2e.py)."""
import numpy as np
import pandas as pd
import pytest

from servingplan.costmodel import CostModel
from servingplan.llamacpp.server_log import Step
from servingplan.llamacpp.server_terms import last_chunk, request_steps, server_cost_model, summarize, term_lengths

DEFAULT_LENGTHS = [16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512]


def test_pairs_are_measured_at_a_quarter_half_and_all_of_the_profiled_prompts():
    assert term_lengths(DEFAULT_LENGTHS, 768, 4) == [64, 192, 512]
    # a slot of 300 tokens holds prompts up to 295 with their 5 generated tokens
    assert term_lengths(DEFAULT_LENGTHS, 300, 4) == [32, 96, 256]
    assert term_lengths([16, 32], 768, 4) == [16, 32]
    with pytest.raises(ValueError, match="no profiled prompt length leaves room for 5 generated tokens"):
        term_lengths([512], 400, 4)


def lone_request(length: int, decode_s: list) -> list:
    steps = [Step(0.0, 2048, end_s=0.4, prefills=[(3, length, 0)])]
    t = 0.4
    for context, seconds in enumerate(decode_s, start=length):
        steps.append(Step(t, 2048, end_s=t + seconds, decodes=[(3, context)]))
        t += seconds
    return steps


def test_a_lone_requests_prompt_step_and_its_decode_steps_after_the_warm_up():
    prompt_s, decode_s = request_steps(lone_request(256, [0.05, 0.020, 0.022, 0.021]), 256, 4, 1)
    assert prompt_s == pytest.approx(0.4) and decode_s == pytest.approx(0.021)


@pytest.mark.parametrize("steps, why", [
    (lone_request(128, [0.02] * 4), "1 prompt steps and 4 decode steps"),            # another length
    (lone_request(256, [0.02] * 3), "1 prompt steps and 3 decode steps"),            # a step short
    (lone_request(256, [0.02] * 4) + [Step(2.0, 2048, end_s=2.1, prefills=[(1, 32, 0)])], "2 prompt steps"),
    ([Step(0.0, 2048, end_s=0.4, prefills=[(3, 256, 0)], decodes=[(1, 90)])] + lone_request(256, [0.02] * 4)[1:],
     "1 prompt steps"),                                                               # another request decoding
])
def test_a_request_that_did_not_run_alone_is_refused(steps, why):
    with pytest.raises(ValueError, match=why):
        request_steps(steps, 256, 4, 1)


def pairs(kind: str, extra_of, noise) -> list[dict]:
    """Pairs at 64, 192 and 512 tokens (a decode step's context: the same), the tool at 1 ms a token or 20 ms a
    step, the server `extra_of(L)` + noise slower."""
    rows = []
    for i, jitter in enumerate(noise):
        length = (64, 192, 512)[i % 3]
        tool = 1e-3 * length if kind == "prefill" else 0.02
        server = tool + extra_of(length) + jitter
        rows.append({"kind": kind, "prompt_len": length, "cached": 0, "feature": float(length), "round": i // 3,
                     "server_first": bool(i % 2), "tool_s": tool, "server_s": server, "ratio": server / tool})
    return rows


NOISE = [0.002, -0.001, 0.001, -0.002, 0.0, 0.0015, -0.0005, 0.001, -0.0015, 0.0005, -0.001, 0.0]


def chunk_pairs(extra_of, noise) -> list[dict]:
    """Chunks of 128 and 256 tokens after 256 and 512 cached, the tool at 1 ms a token plus 1 us per token
    cached, the server `extra_of(C, P)` + noise slower."""
    rows = []
    for i, jitter in enumerate(noise):
        chunk, cached = ((128, 256), (256, 256), (128, 512), (256, 512))[i % 4]
        tool = 1e-3 * chunk + 1e-6 * cached
        server = tool + extra_of(chunk, cached) + jitter
        rows.append({"kind": "prefill_cached", "prompt_len": chunk, "cached": cached, "feature": float(chunk * cached),
                     "round": i // 4, "server_first": bool(i % 2), "tool_s": tool, "server_s": server,
                     "ratio": server / tool})
    return rows


def terms_of(prefill_extra, decode_extra, noise=NOISE, chunk_extra=None) -> dict:
    frame = pd.DataFrame(pairs("prefill", prefill_extra, noise) + pairs("decode", decode_extra, [n / 20 for n in noise])
                         + (chunk_pairs(chunk_extra, noise) if chunk_extra else []))
    return summarize(frame, seed=0)["kinds"]


def test_the_servers_extra_prompt_time_is_fitted_in_the_models_terms_and_added_when_shown():
    # the server's prompts cost 2.5e-7 s per token squared more than the tool's: 66 ms at 512 tokens
    terms = terms_of(lambda n: 2.5e-7 * n * n, lambda n: 0.0)
    prefill, decode = terms["prefill"], terms["decode"]
    assert prefill["pairs"] == 12 and prefill["longest"] == 512
    assert prefill["terms"]["prefill_per_token_sq_s"] == pytest.approx(2.5e-7, rel=0.1)
    assert prefill["terms"]["prefill_per_token_s"] >= 0
    low, high = prefill["interval_s"]
    assert 0 < low <= prefill["extra_at_longest_s"] <= high
    assert prefill["extra_at_longest_pct"] == pytest.approx(100 * prefill["extra_at_longest_s"] / 0.512)
    assert prefill["applied"] and [row["prompt_len"] for row in prefill["by_length"]] == [64, 192, 512]
    # decode steps on either side of the tool's: the interval holds zero
    assert decode["interval_s"][0] <= 0 and not decode["applied"] and "holds zero" in decode["reason"]


def test_a_server_that_reads_faster_than_the_tool_adds_nothing():
    terms = terms_of(lambda n: -1e-5 * n, lambda n: -0.001)
    for term in terms.values():
        assert all(value == 0 for value in term["terms"].values())     # never below the tool: non-negative
        assert not term["applied"]


def test_the_summary_is_the_same_for_the_same_pairs_and_seed():
    noise = list(np.random.default_rng(3).normal(0, 0.003, 12))
    assert terms_of(lambda n: 1e-4 * n, lambda n: 1e-6 * n, noise) == terms_of(lambda n: 1e-4 * n, lambda n: 1e-6 * n, noise)


def test_the_server_model_is_the_fit_with_the_applied_terms_added():
    fitted = CostModel(0.02, 0.005, 1.8e-5, 0.024, 1.4e-3, 2e-7, 2.7e-7, "padded_max", "fit", "test", {"goal_met": True},
                       ((1, 0.024), (2, 0.032)))
    terms = {"kinds": terms_of(lambda n: 2.5e-7 * n * n, lambda n: 0.004 + 2e-6 * n, [0.0] * 12)}
    model = server_cost_model(fitted, terms)
    sq = terms["kinds"]["prefill"]["terms"]["prefill_per_token_sq_s"]
    per_token = terms["kinds"]["prefill"]["terms"]["prefill_per_token_s"]
    assert model.prefill_time(256) == pytest.approx(fitted.prefill_time(256) + per_token * 256 + sq * 256 ** 2)
    assert model.prefill_time(64, cached=128) - fitted.prefill_time(64, cached=128) == pytest.approx(
        per_token * 64 + sq * 64 ** 2)                                   # the chunk-after-cache term as fitted
    decode = terms["kinds"]["decode"]["terms"]
    assert decode["decode_fixed_s"] == pytest.approx(0.004, rel=0.05)
    for batch in (1, 2, 3):
        assert model.decode_time(batch, 0, 300) == pytest.approx(
            fitted.decode_time(batch, 0, 300) + decode["decode_fixed_s"] + decode["decode_per_ctx_token_s"] * batch * 300)
    assert model.meta["goal_met"] and model.meta["server_terms"]["prefill"]["applied"]
    assert CostModel.from_dict(model.to_dict()).prefill_time(256) == pytest.approx(model.prefill_time(256))
    # a term not shown adds nothing
    shown_none = {"kinds": terms_of(lambda n: 0.0, lambda n: 0.0)}
    assert server_cost_model(fitted, shown_none).prefill_time(300) == pytest.approx(fitted.prefill_time(300))


def chunk_steps(chunk: int, cached: int, seconds=0.25) -> list:
    return [Step(i * seconds, chunk, end_s=(i + 1) * seconds, prefills=[(2, chunk, before)])
            for i, before in enumerate(range(0, cached + 1, chunk))]


def test_a_lone_prompt_at_a_small_batch_gives_its_chunk_after_the_cached_tokens():
    steps = chunk_steps(128, 256)
    steps[-1].end_s += 0.05
    assert last_chunk(steps, 128, 256) == pytest.approx(0.30)
    with pytest.raises(ValueError, match="not its chunks of 128 alone"):
        last_chunk(steps[:-1], 128, 256)                               # a chunk short
    mixed = chunk_steps(128, 256)
    mixed[1].decodes = [(5, 40)]
    with pytest.raises(ValueError, match="not its chunks of 128 alone"):
        last_chunk(mixed, 128, 256)                                    # another request decoding beside it


def test_a_chunks_extra_is_fitted_beyond_what_the_prompt_terms_give_it():
    # prompts 2.5e-7 s per token squared over the tool's; a chunk that and 4e-7 s per token x cached token more
    terms = terms_of(lambda n: 2.5e-7 * n * n, lambda n: 0.0, NOISE,
                     lambda c, p: 2.5e-7 * c * c + 4e-7 * c * p)
    chunk = terms["prefill_cached"]
    assert chunk["pairs"] == 12 and chunk["largest"] == {"prompt_len": 256, "cached": 512}
    assert chunk["terms"]["prefill_per_token_ctx_s"] == pytest.approx(4e-7, rel=0.1)
    assert chunk["applied"] and chunk["interval_s"][0] > 0
    # a chunk that costs the server only what the prompt terms give it shows nothing more
    same = terms_of(lambda n: 2.5e-7 * n * n, lambda n: 0.0, NOISE, lambda c, p: 2.5e-7 * c * c)["prefill_cached"]
    assert not same["applied"]


def test_the_server_model_adds_an_applied_chunk_term():
    fitted = CostModel(0.02, 0.005, 1.8e-5, 0.024, 1.4e-3, 2e-7, 2.7e-7, "padded_max", "fit", "test", {})
    terms = {"kinds": terms_of(lambda n: 0.0, lambda n: 0.0, [0.0] * 12, lambda c, p: 4e-7 * c * p)}
    model = server_cost_model(fitted, terms)
    ctx = terms["kinds"]["prefill_cached"]["terms"]["prefill_per_token_ctx_s"]
    assert model.prefill_time(128, cached=256) == pytest.approx(fitted.prefill_time(128, cached=256) + ctx * 128 * 256)
    assert model.prefill_time(300) == pytest.approx(fitted.prefill_time(300))


LONE_PROMPT = """\
0.00.100.000 I slot   operator(): id  0 | task 0 | new prompt, n_ctx_slot = 1024, n_keep = 0, task.n_tokens = 40
0.00.100.100 I slot   operator(): id  0 | task 0 | cached n_tokens = 0, memory_seq_rm [0, end)
0.00.100.200 D srv        decode: n_batch (effective) = 2048, off = 0
0.00.100.210 D que  yield_to_que: yielding to queue
0.00.180.200 D que  yield_to_que: done yielding to queue
"""
LONE_DECODES = """\
0.00.181.000 D slot handle_last_: id  0 | task 0 | slot decode token, id=7, n_ctx = 1024, n_tokens = 40, truncated = 0
0.00.181.100 D srv        decode: n_batch (effective) = 2048, off = 0
0.00.181.110 D que  yield_to_que: yielding to queue
0.00.201.100 D que  yield_to_que: done yielding to queue
0.00.202.000 D slot handle_last_: id  0 | task 0 | slot decode token, id=9, n_ctx = 1024, n_tokens = 41, truncated = 0
0.00.202.100 D srv        decode: n_batch (effective) = 2048, off = 0
0.00.202.110 D que  yield_to_que: yielding to queue
0.00.224.100 D que  yield_to_que: done yielding to queue
"""


def answered_while_the_log_lags(monkeypatch, log, lag_s, rest=LONE_DECODES):
    """run_trace stand-in: the request is answered at once, its prompt step is in the log, its decode steps
    reach the log `lag_s` later (as the server's log thread can lag its responses)."""
    import threading
    from servingplan.llamacpp import server_terms
    from servingplan.llamacpp.client import RequestResult

    def answered(url, arrivals, prompts, max_tokens, timeout_s):
        log.write_text(LONE_PROMPT)
        threading.Timer(lag_s, lambda: log.write_text(LONE_PROMPT + rest)).start()
        return [RequestResult(0, 0.0, len(prompts[0]), max_tokens[0], token_times_s=[0.1] * max_tokens[0])]

    monkeypatch.setattr(server_terms, "run_trace", answered)
    return server_terms.LoneRequests("http://127.0.0.1:1", log)


def test_a_lone_requests_steps_are_read_once_the_servers_log_has_them_all(monkeypatch, tmp_path):
    lone = answered_while_the_log_lags(monkeypatch, tmp_path / "server.log", 0.3)
    prompt_s, decode_s = lone.read(list(range(40)), 3, lambda steps: request_steps(steps, 40, 2, 0))
    assert prompt_s == pytest.approx(0.080) and decode_s == pytest.approx(0.021)
    assert lone.logged == 3


def test_a_lone_request_whose_steps_never_reach_the_log_is_refused(monkeypatch, tmp_path):
    from servingplan.llamacpp import server_terms
    monkeypatch.setattr(server_terms, "LOG_WAIT_S", 0.3)
    lone = answered_while_the_log_lags(monkeypatch, tmp_path / "server.log", 0.05, rest="")
    with pytest.raises(ValueError, match="logged 1 prompt steps and 0 decode steps"):
        lone.read(list(range(40)), 3, lambda steps: request_steps(steps, 40, 2, 0))
