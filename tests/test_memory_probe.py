"""The serving memory probe: the policy's own prefill calls, the worst case of a cap, a forked probe
reading what a fresh process reads, the line fitted to the caps measured and its check, the contract file."""
import json
import os
import subprocess
import sys

import psutil
import pytest

from servingplan.engine import memory_probe
from servingplan.engine.memory_probe import (fit_caps, fit_line, largest_calls, mapped_file_pages, measure,
                                             peak_rss_bytes, prefill_calls, probe_forked, resident_at,
                                             serve_worst_case, serving_memory_file)
from servingplan.profile.model import load_model

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


def row(policy, cap, peak):
    return {"policy": policy, "cap": cap, "peak_rss_bytes": peak, "sequences": cap, "context_tokens": 768}


def test_the_caps_fitted_are_both_ends_and_the_middle_and_the_check_lies_between_the_two_largest():
    assert fit_caps([1, 2, 4, 8, 16, 32]) == ([1, 8, 32], 16)
    assert fit_caps([32, 1, 8, 8]) == ([1, 32], 8)       # fewer than four caps: both ends, the rest checks
    assert fit_caps([1, 2, 4, 8]) == ([1, 4, 8], 2)      # 2 is the only cap left
    assert fit_caps([4, 16]) == ([4, 16], None)
    assert fit_caps([8]) == ([8], None)


def test_the_line_and_its_check_are_the_least_squares_arithmetic():
    # (1, 1.0e9), (8, 1.5e9), (32, 2.8e9): mean cap 41/3, mean bytes 1.7667e9;
    # slope = sum((c - 41/3)(b - 1.7667e9)) / sum((c - 41/3)^2) = 30.16667e9 / (4758 / 9) = 5.70618e7 (hand computed:
    # (-38/3)(-0.76667e9) + (-17/3)(-0.26667e9) + (55/3)(1.03333e9); (1444 + 289 + 3025) / 9)
    line = fit_line([(1, 1.0e9), (8, 1.5e9), (32, 2.8e9)])
    assert line["slope_bytes_per_cap"] == pytest.approx(30.166667e9 / (4758 / 9), rel=1e-6)
    assert line["intercept_bytes"] == pytest.approx(1.7666667e9 - line["slope_bytes_per_cap"] * 41 / 3, rel=1e-6)
    assert fit_line([(1, 1.0e9), (3, 2.0e9)]) == {"intercept_bytes": pytest.approx(0.5e9),
                                                   "slope_bytes_per_cap": pytest.approx(0.5e9)}
    assert fit_line([(4, 7.0)]) == {"intercept_bytes": 7.0, "slope_bytes_per_cap": 0.0}
    rows = [row("static", 1, 1.0e9), row("static", 3, 2.0e9), row("static", 2, 1.6e9),
            row("continuous", 3, 2.2e9), row("continuous", 1, 1.0e9), row("continuous", 2, 1.5e9)]
    out = serving_memory_file(rows, [1, 3], 2, {"memory": {"peak_rss_bytes": 4.68e9}})
    assert [(r["policy"], r["cap"], r["use"]) for r in out["rows"]] == [
        ("continuous", 1, "fit"), ("continuous", 2, "check"), ("continuous", 3, "fit"),
        ("static", 1, "fit"), ("static", 2, "check"), ("static", 3, "fit")]
    assert out["model"]["caps"] == [1, 3]
    assert out["model"]["policies"]["continuous"] == {"intercept_bytes": pytest.approx(0.4e9),
                                                      "slope_bytes_per_cap": pytest.approx(0.6e9)}
    # continuous predicts 0.4 + 0.6 x 2 = 1.6 GB at cap 2 against 1.5 measured: +6.67%;
    # static 0.5 + 0.5 x 2 = 1.5 against 1.6: -6.25%
    assert out["check"]["cap"] == 2
    assert [(c["policy"], c["predicted_bytes"], c["measured_bytes"]) for c in out["check"]["rows"]] == [
        ("continuous", pytest.approx(1.6e9), 1.5e9), ("static", pytest.approx(1.5e9), 1.6e9)]
    assert [c["error_pct"] for c in out["check"]["rows"]] == [pytest.approx(100 / 15), pytest.approx(-6.25)]
    assert out["check"]["max_abs_error_pct"] == pytest.approx(100 / 15)
    assert out["profiler_peak_rss_bytes"] == 4680000000
    assert serving_memory_file(rows[:2], [1, 3], None, None)["check"] is None
    assert serving_memory_file(rows[:2], [1, 3], None, None)["profiler_peak_rss_bytes"] is None


def test_resident_memory_is_the_measurement_where_there_is_one_else_the_line():
    out = serving_memory_file([row("static", 1, 1.0e9), row("static", 3, 2.0e9), row("static", 2, 1.6e9)],
                              [1, 3], 2, None)
    assert resident_at(out, "static", 2) == {"bytes": 1.6e9, "basis": "measured"}
    assert resident_at(out, "static", 3) == {"bytes": 2.0e9, "basis": "measured"}
    assert resident_at(out, "static", 64) == {"bytes": pytest.approx(0.5e9 + 64 * 0.5e9), "basis": "model"}
    with pytest.raises(ValueError, match="at least 1"):
        resident_at(out, "static", 0)
    with pytest.raises(KeyError, match="continuous"):
        resident_at(out, "continuous", 4)


# a process that loads the tiny model and serves continuous at cap 4: itself (fresh) or in a forked child
# of it, with the parent's file pages mapped first (forked) or not (unmapped); prints its peak
SERVE = """import json, sys
from servingplan.profile.model import load_model
from servingplan.engine.memory_probe import mapped_file_pages, probe_forked, serve_worst_case
model = load_model("random", 0, {tiny!r})[0]
case = (model, "continuous", 4, 768, 32, "prompt_tokens", 16)
if sys.argv[1] == "fresh":
    print(json.dumps([serve_worst_case(*case)["peak_rss_bytes"]]))
elif sys.argv[1] == "after_parallel_work":
    import torch
    torch.set_num_threads(2)
    for _ in range(20):  # OpenMP parallel regions in this process before it forks
        torch.nn.functional.layer_norm(torch.randn(4096, 1024), (1024,))
    print(json.dumps([probe_forked(*case, [])["peak_rss_bytes"]]))
else:
    pages = mapped_file_pages()
    print(json.dumps([probe_forked(*case, pages)["peak_rss_bytes"], probe_forked(*case, [])["peak_rss_bytes"]]))
"""


def serve(mode):
    return json.loads(subprocess.run([sys.executable, "-c", SERVE.format(tiny=TINY), mode], check=True,
                                     capture_output=True, text=True, timeout=180).stdout)


def test_a_probe_forked_after_parallel_work_in_its_parent_finishes():
    # a child entering an OpenMP parallel region the parent's team left behind waits forever
    (peak,) = serve("after_parallel_work")
    assert peak > 0


def test_a_forked_probe_reads_what_a_fresh_process_reads():
    """The probe's child maps the parent's file pages before it serves: its peak is what the same
    process would read serving the case itself, not the lower count of the pages the child touched."""
    (fresh,), (forked, unmapped) = serve("fresh"), serve("fork")
    assert forked == pytest.approx(fresh, rel=0.03)
    assert unmapped < forked
    pages = mapped_file_pages()
    assert pages and all(length > 0 and length % 4096 == 0 for _, length in pages)


def test_a_failing_probe_raises_in_the_parent(model):
    with pytest.raises(RuntimeError, match="continuous cap 1: ValueError: memory.max_context=2"):
        probe_forked(model, "continuous", 1, 2, 32, "prompt_tokens", 16, [])


def test_the_measured_file_is_the_contract(model):
    out = measure(model, ["static", "continuous_chunked"], [1, 2, 4, 8], 768, 32, "prompt_tokens", 16,
                  {"memory": {"peak_rss_bytes": 4.68e9}})
    assert set(out) == {"rows", "model", "check", "method", "profiler_peak_rss_bytes"}
    assert [(r["policy"], r["cap"], r["use"]) for r in out["rows"]] == [
        (policy, cap, "check" if cap == 2 else "fit") for policy in ("continuous_chunked", "static") for cap in (1, 2, 4, 8)]
    for r in out["rows"]:
        assert set(r) == {"policy", "cap", "peak_rss_bytes", "sequences", "context_tokens", "use", "probe_policy"}
        assert r["probe_policy"] == r["policy"]     # static and chunked prefill issue different calls
        assert r["sequences"] == r["cap"] and r["context_tokens"] == 128 and r["peak_rss_bytes"] > 0
    assert out["model"]["caps"] == [1, 4, 8] and set(out["model"]["policies"]) == {"static", "continuous_chunked"}
    # the tiny model's KV (2 layers x 2 x 127 entries x 64 floats = 130 kB per sequence) is within the noise:
    # the line only has to hold its own measurements to within a few percent
    assert out["check"]["cap"] == 2 and len(out["check"]["rows"]) == 2
    assert out["check"]["max_abs_error_pct"] < 5.0
    assert out["profiler_peak_rss_bytes"] == 4680000000


def test_policies_issuing_the_same_calls_share_one_probe_and_every_row_names_it(model, monkeypatch):
    """static and continuous prefill one whole prompt at every cap: the same pool, calls and decode step,
    so one probe serves both; chunked prefill's calls differ and it gets its own."""
    served = []
    real_start = memory_probe.start_probe

    def counting_start(model, policy, cap, *rest):
        served.append((policy, cap))
        return real_start(model, policy, cap, *rest)
    monkeypatch.setattr(memory_probe, "start_probe", counting_start)
    out = memory_probe.measure(model, ["static", "continuous", "continuous_chunked"], [1, 8], 768, 32,
                               "prompt_tokens", 16, None, workers=2)
    assert served == [("static", 1), ("static", 8), ("continuous_chunked", 1), ("continuous_chunked", 8)]
    rows = {(r["policy"], r["cap"]): r for r in out["rows"]}
    assert len(rows) == 6
    for cap in (1, 8):
        assert rows[("continuous", cap)]["probe_policy"] == "static"
        assert rows[("continuous", cap)]["peak_rss_bytes"] == rows[("static", cap)]["peak_rss_bytes"]
        assert rows[("continuous_chunked", cap)]["probe_policy"] == "continuous_chunked"


def test_probes_side_by_side_read_what_one_at_a_time_reads(model):
    """Each child's reading is its own high-water mark: running two at once changes no reading beyond
    the noise of reading the same case twice."""
    cases = [("continuous", 1), ("continuous", 8), ("continuous_chunked", 4)]
    pages = memory_probe.mapped_file_pages()
    alone = memory_probe.probe_all(model, cases, 768, 32, "prompt_tokens", 16, pages, workers=1)
    paired = memory_probe.probe_all(model, cases, 768, 32, "prompt_tokens", 16, pages, workers=2)
    assert [(r["policy"], r["cap"]) for r in paired] == cases
    for one, two in zip(alone, paired):
        assert two["peak_rss_bytes"] == pytest.approx(one["peak_rss_bytes"], rel=0.03)


def test_a_failing_probe_among_several_raises_after_every_child_is_waited_for(model):
    cases = [("continuous", 1), ("continuous", 2), ("continuous", 3)]
    with pytest.raises(RuntimeError, match="continuous cap 1: ValueError: memory.max_context=2"):
        memory_probe.probe_all(model, cases, 2, 32, "prompt_tokens", 16, [], workers=2)
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)      # no child of this process is left behind
