"""The serving memory probe: the policy's own prefill calls, the worst case of a cap, the contract file."""
import psutil
import pytest

from servingplan.profiling.model import load_model
from servingplan.serving.memory_probe import collect, largest_calls, peak_rss_bytes, prefill_calls, serve_worst_case

TINY = {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 128, "vocab_size": 1000}


@pytest.fixture(scope="module")
def model():
    return load_model("random", 0, TINY)[0]


def test_prefill_calls_are_the_schedulers_own():
    assert prefill_calls("continuous", 3, 40, 16, "prompt_tokens", 16) == [(40, 0)]
    assert prefill_calls("static", 2, 40, 16, "prompt_tokens", 16) == [(40, 0)]
    # chunked prefill splits the prompt under the per-step budget
    assert prefill_calls("continuous_chunked", 1, 40, 16, "prompt_tokens", 16) == [(16, 0), (16, 16), (8, 32)]


def test_only_the_calls_no_other_exceeds_are_run():
    # (tokens, cached): (16, 0) needs no more than (16, 16) in both new tokens and entries attended;
    # (8, 32) attends over more entries (40 > 32) than (16, 16), so it stays
    assert largest_calls([(16, 0), (16, 16), (8, 32)]) == [(16, 16), (8, 32)]
    assert largest_calls([(40, 0)]) == [(40, 0)]
    # a call repeated is kept once, in its first place
    assert largest_calls([(5, 0), (5, 0)]) == [(5, 0)]
    calls = prefill_calls("continuous_chunked", 8, 766, 512, "prompt_tokens", 16)
    kept = largest_calls(calls)
    assert set(kept) <= set(calls) and len(kept) < len(calls)
    for call in calls:
        assert any(k[0] >= call[0] and sum(k) >= sum(call) for k in kept)


def test_the_worst_case_row_holds_the_cap_at_the_longest_context_the_model_allows(model):
    row = serve_worst_case(model, "continuous_chunked", 4, 768, 32, "prompt_tokens", 16)
    assert {k: row[k] for k in ("policy", "cap", "sequences", "context_tokens")} == {
        "policy": "continuous_chunked", "cap": 4, "sequences": 4, "context_tokens": 128}
    assert row["peak_rss_bytes"] >= psutil.Process().memory_info().rss * 0.9 and row["peak_rss_bytes"] <= peak_rss_bytes()
    with pytest.raises(ValueError, match="max_context"):
        serve_worst_case(model, "continuous", 1, 2, 32, "prompt_tokens", 16)


def test_the_collected_file_is_the_contract():
    rows = [{"policy": "static", "cap": 8, "peak_rss_bytes": 3, "sequences": 8, "context_tokens": 768},
            {"policy": "continuous", "cap": 16, "peak_rss_bytes": 5, "sequences": 16, "context_tokens": 768},
            {"policy": "continuous", "cap": 2, "peak_rss_bytes": 4, "sequences": 2, "context_tokens": 768}]
    out = collect(rows, {"memory": {"peak_rss_bytes": 4.68e9}})
    assert out == {"rows": [rows[2], rows[1], rows[0]], "profiler_peak_rss_bytes": 4680000000}
    assert collect(rows[:1], None)["profiler_peak_rss_bytes"] is None
