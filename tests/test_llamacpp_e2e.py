"""End to end: the tiny GGUF model served by the pinned llama-server, a few requests from the streaming
client, every token counted. Skipped only where the build folder is absent; where a run requires the build (SERVINGPLAN_REQUIRE_LLAMACPP=1) that fails."""
import sys
import textwrap

import pytest

from helpers import require_llamacpp
from servingplan.llamacpp import build
from servingplan.llamacpp.client import random_prompts, run_trace, summarize
from servingplan.llamacpp.server import LlamaServer


def need_build():
    require_llamacpp(build.built(), f"llama.cpp build absent ({build.build_dir()}): run `make llamacpp`")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    need_build()
    from servingplan.llamacpp.gguf_model import make_gguf
    tmp = tmp_path_factory.mktemp("gguf")
    return make_gguf(tmp / "tiny.gguf", seed=0, tiny=True, work_dir=tmp)


def test_llama_server_serves_exact_token_counts(tiny_gguf, tmp_path):
    log = tmp_path / "server.log"
    with LlamaServer(tiny_gguf, threads=1, n_parallel=2, ctx=256, n_batch=32, n_ubatch=32, verbosity=3,
                     log_file=log) as server:
        # 4 requests on 2 slots (two wait), prompts of 40-60 tokens split by n_batch 32
        prompts = random_prompts([40, 60, 45, 50], vocab_size=500, seed=0)
        outputs = [8, 5, 6, 3]
        results = run_trace(server.url, [0.0, 0.0, 0.05, 0.1], prompts, outputs, timeout_s=60.0)
    assert [r.error for r in results] == [None] * 4, log.read_text()[-3000:]
    assert [r.output_tokens for r in results] == outputs
    for r in results:
        assert r.server_timings["predicted_n"] == r.max_tokens
        assert r.ttft_s > 0 and r.tpot_s > 0
    assert summarize(results)["completed"] == 4


def test_the_server_runner_starts_and_stops_a_stand_in(tmp_path):
    """The runner's start, health wait and stop, on a stand-in binary (runs everywhere)."""
    fake = tmp_path / "llama-server"
    fake.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import sys
        from http.server import BaseHTTPRequestHandler, HTTPServer
        port = int(sys.argv[sys.argv.index("--port") + 1])
        assert sys.argv[sys.argv.index("--host") + 1] == "127.0.0.1"
        class H(BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == "/health" else 404)
                self.end_headers()
            def log_message(self, *a):
                pass
        HTTPServer(("127.0.0.1", port), H).serve_forever()
        """))
    fake.chmod(0o755)
    server = LlamaServer(tmp_path / "none.gguf", binary=fake, startup_timeout_s=30)
    assert "-no-kvu" in server.args and "-kvu" not in server.args and server.args[server.args.index("--cache-ram") + 1] == "0"
    with server:
        assert server.healthy()
    assert server.proc.poll() is not None and not server.healthy()


def test_a_server_that_exits_while_starting_is_reported(tmp_path):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match="exited with 3"):
        LlamaServer(tmp_path / "none.gguf", binary=fake, startup_timeout_s=10).start()


def test_a_tiny_gguf_is_profiled_fitted_and_validated_through_a_real_llama_server(tiny_gguf, tmp_path):
    """The whole llama.cpp chain on the tiny model: llama-batched-bench profile, the torch fit, the server's own
    terms against the tool's, a few Poisson
    requests served by llama-server (and once more at a batch that splits prompts), the server's step log read
    back, and the `llamacpp` policy's simulation compared with them. Asserts what was served and read, never
    how fast."""
    from servingplan.fit.step_model import fit_profile
    from servingplan.llamacpp.profile import run_llamacpp_profile
    from servingplan.llamacpp.validation import READINGS_PER_KIND, run_llamacpp_comparison, run_llamacpp_replay

    grid = {"warmup": 1, "rounds": 2, "repeats": 2, "reference_interval_s": 1.0, "reference_decode": [2, 32],
            "reference_prefill": 32, "prefill_lengths": [16, 32, 64], "prefill_batches": [1],
            "decode_batches": [1, 2], "decode_contexts": [16, 64], "probe_bytes": 1 << 20, "gemm_size": 64}
    engine = {"threads": 1, "n_batch": 128, "n_ubatch": 64, "split_n_batch": 24}
    profile = run_llamacpp_profile(tiny_gguf, grid, engine, seed=0, tiny=True, progress=False)
    # the tiny model's chunks after cached tokens are the quick profile's: 8 and 16 tokens after 16
    assert len(profile.points) == 3 + 2 + 2 * 2 and (profile.points["median_s"] > 0).all()
    assert profile.meta["settings"]["cached_prefill"] == [[8, 16], [16, 16]]
    fitted = fit_profile(profile.points, profile.samples, profile.meta, 0.25, 0.05, 0).cost_model
    assert fitted.ctx_mode == "padded_max"

    # llama-server's own prompt and decode steps against the tool's, pair by pair: a quarter, half and all of
    # the profiled prompts, and the profile's chunks after cached tokens (at -b of the chunk), `rounds` pairs
    # each; the model served is the fit with the terms that show a difference
    from servingplan.llamacpp.gguf_model import TINY_OVERRIDES
    from servingplan.llamacpp.server_terms import run_server_terms
    pairs, terms, cost = run_server_terms(tiny_gguf, fitted, profile.meta, 2, 128, 0, tmp_path / "terms.log",
                                          TINY_OVERRIDES["vocab_size"])
    assert sorted(pairs.groupby("kind").size().items()) == [("decode", 6), ("prefill", 6), ("prefill_cached", 4)]
    assert sorted(set(pairs.loc[pairs["kind"] == "prefill", "prompt_len"])) == [16, 32, 64] and (pairs["ratio"] > 0).all()
    chunks = pairs[pairs["kind"] == "prefill_cached"]
    assert sorted(zip(chunks["prompt_len"], chunks["cached"])) == [(8, 16), (8, 16), (16, 16), (16, 16)]
    assert pairs["server_first"].any() and not pairs["server_first"].all()
    for kind, term in terms["kinds"].items():
        assert term["pairs"] == (4 if kind == "prefill_cached" else 6) and term["applied"] == (term["interval_s"][0] > 0)
        assert all(value >= 0 for value in term["terms"].values())
    prefill = terms["kinds"]["prefill"]
    added = sum(prefill["terms"].values()) and prefill["applied"]
    assert (cost.prefill_time(64) > fitted.prefill_time(64)) == bool(added)

    workload = {"num_requests": 10, "rate": 1.0, "prompt": {"dist": "uniform", "min": 16, "max": 60},
                "output": {"dist": "uniform", "min": 3, "max": 6}}
    # the tiny model serves hundreds of requests a second: a short trace, never fewer than min_requests
    validation = {"rates_fraction": [0.5], "trace_seconds": 0.02, "min_requests": 6, "cap": 2, "max_wall_s": 120,
                  "goal_pct": 10}
    replayed = run_llamacpp_replay(tiny_gguf, cost, profile.points, profile.meta, workload, validation, engine,
                                   {"max_context": 128}, 0, tmp_path / "logs", tiny=True)
    runs = replayed["runs"]
    assert [run["n_batch"] for run in runs] == [128, 24]
    for run in runs:
        assert [r["error"] for r in run["requests"]] == [None] * len(run["requests"])
        assert [r["tokens"] for r in run["requests"]] == run["trace"]["output_tokens"]
        rule = run["batch_rule"]
        # llama-server batched as the `llamacpp` policy simulates: within n_batch, a split prompt only in a full batch
        assert rule["over_n_batch"] == rule["split_without_full_batch"] == 0 and rule["steps"] == len(run["steps"])
        # every prompt token was logged into some step, each prompt once from its start
        assert sum(tokens for step in run["steps"] for _, tokens, _ in step["prefills"]) == sum(run["trace"]["prompt_tokens"])
    assert not any(cached for step in runs[0]["steps"] for _, _, cached in step["prefills"])
    assert any(cached for step in runs[1]["steps"] for _, _, cached in step["prefills"])   # -b 24 splits prompts

    # each run's prompts were re-timed with the tool before it, and by its end every kind of step it served
    # (in its idle gaps, or right after it) at least READINGS_PER_KIND times
    for run in runs:
        readings = [row for row in replayed["retimed"] if row["label"] == f"run {run['number']}"]
        assert readings and all(row["seconds"] > 0 and row["profiled_s"] > 0 for row in readings)
        assert readings[0]["kind"] == "prefill"
        kinds = {(row["kind"], row["batch"]) for row in readings}
        assert ("decode", 1) in kinds and ("prefill", 1) in kinds
        for kind in kinds:
            assert sum((row["kind"], row["batch"]) == kind for row in readings) >= READINGS_PER_KIND

    out = run_llamacpp_comparison(replayed, cost, validation, {"block_size": 16}, {"horizon_factor": 20.0}, terms)
    assert out["meta"]["server_terms"] == terms["kinds"]
    headline = out["meta"]["headline"]
    assert headline["met"] == headline["corrected"]["met"]
    for model in ("as_fitted", "corrected"):
        judged = headline[model]["rows"]
        assert {(row["run"], row["metric"]) for row in judged} == {(run["name"], metric) for run in runs
                                                                   for metric in ("ttft", "tpot")}
        assert all(row["measured_lo_ms"] <= row["measured_ms"] <= row["measured_hi_ms"] for row in judged)
    # a correction applied only where the evidence and the server's own steps read the same way
    for row in out["meta"]["corrections"]:
        if row["status"] == "applied":
            assert (row["evidence_ratio"] - 1) * (row["engine_ratio"] - 1) > 0
    assert len(out["steps"]) == sum(len(run["steps"]) for run in runs)
    assert (out["steps"]["predicted_s"] > 0).all()
