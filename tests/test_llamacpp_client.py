"""The llama-server streaming client against a stub HTTP server on loopback (stdlib http.server)."""
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from servingplan.llamacpp.client import (RequestResult, random_prompts, run_trace, stream_completion,
                                         summarize)

TOKEN_GAP_S = 0.02


class Stub(BaseHTTPRequestHandler):
    """Streams like llama-server: one chunk per token with timings.predicted_n, except that tokens 2 and 3
    come in one chunk (held back), then a final chunk with finish_reason, then [DONE]. The prompt's first
    token id picks a failure: 1 -> HTTP 500, 2 -> stall past the client's timeout, 3 -> stream cut
    without [DONE], 4 -> an error event mid-stream, 5 -> one token too few."""
    protocol_version = "HTTP/1.1"
    bodies = []

    def log_message(self, *args):
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Stub.bodies.append((self.path, body))
        mode = body["prompt"][0] if body["prompt"] else 0
        if mode == 1:
            payload = json.dumps({"error": {"code": 500, "message": "boom"}}).encode()
            self.send_response(500)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")
        self.end_headers()
        n = body["max_tokens"] - (1 if mode == 5 else 0)
        sent = 0
        while sent < n:
            time.sleep(TOKEN_GAP_S)
            if mode == 2 and sent == 1:
                time.sleep(1.0)
            step = 2 if sent == 1 and n >= 3 else 1
            sent += step
            self._event({"choices": [{"text": "x" * step, "index": 0, "finish_reason": None}],
                         "timings": {"predicted_n": sent, "prompt_n": len(body["prompt"])}})
            if mode == 4 and sent == 3:
                self._event({"error": {"code": 500, "message": "slot failed"}})
                return
            if mode == 3 and sent == 3:
                return
        self._event({"choices": [{"text": "", "index": 0, "finish_reason": "length"}],
                     "timings": {"predicted_n": sent}, "usage": {"completion_tokens": sent}})
        self.wfile.write(b"data: [DONE]\n\n")

    def handle(self):
        try:
            super().handle()
        except (BrokenPipeError, ConnectionResetError):   # the client gave up (the timeout case)
            pass

    def _event(self, data):
        self.wfile.write(b"data: " + json.dumps(data).encode() + b"\n\n")
        self.wfile.flush()


@pytest.fixture
def stub():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    Stub.bodies = []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def one(url, prompt, max_tokens, timeout_s=5.0):
    t0 = time.perf_counter()
    res = RequestResult(0, 0.0, len(prompt), max_tokens)
    return stream_completion(url, prompt, max_tokens, t0=t0, result=res, timeout_s=timeout_s)


def test_a_streamed_request_counts_every_token_held_back_ones_included(stub):
    res = one(stub, [7, 8, 9], 5)
    assert res.error is None and res.ok and res.output_tokens == 5 and res.finish_reason == "length"
    path, body = Stub.bodies[0]
    assert path == "/v1/completions"
    assert body["prompt"] == [7, 8, 9] and body["max_tokens"] == 5
    assert body["ignore_eos"] is True and body["stream"] is True and body["timings_per_token"] is True
    assert body["cache_prompt"] is False
    t = res.token_times_s
    assert t == sorted(t) and t[1] == t[2]          # tokens 2 and 3 came in one chunk
    assert res.ttft_s == pytest.approx(t[0]) and res.ttft_s >= TOKEN_GAP_S
    assert res.tpot_s == pytest.approx((t[-1] - t[0]) / 4)
    assert res.e2e_s == pytest.approx(t[-1])
    assert len(res.itl_s) == 4 and res.itl_s[1] == 0.0
    assert res.server_timings["predicted_n"] == 5


@pytest.mark.parametrize("mode, message", [(1, "HTTP 500"), (2, "timeout"), (3, "incomplete"),
                                           (4, "server error"), (5, "expected 4 tokens, got 3")])
def test_failures_are_recorded_not_raised(stub, mode, message):
    res = one(stub, [mode, 1, 2], 4, timeout_s=0.5)
    assert res.error is not None and message in res.error
    assert not res.ok and res.ttft_s == float("inf") and res.itl_s == []


def test_a_refused_connection_is_an_error(stub):
    res = one("http://127.0.0.1:9", [7], 2, timeout_s=1.0)
    assert res.error is not None and not res.ok


def test_a_trace_is_replayed_open_loop_and_summarized(stub):
    prompts = random_prompts([4, 6, 5], seed=1)
    prompts = [[p[0] + 10] + p[1:] for p in prompts]    # keep clear of the stub's failure codes
    arrivals = [0.0, 0.05, 0.1]
    results = run_trace(stub, arrivals, prompts, [3, 4, 2], timeout_s=5.0)
    assert [r.output_tokens for r in results] == [3, 4, 2] and all(r.ok for r in results)
    for r, a in zip(results, arrivals):
        assert r.sent_s >= a - 1e-3 and r.arrival_s == a
    summary = summarize(results)
    assert summary["completed"] == 3 and summary["errors"] == []
    assert summary["ttft_ms_p50"] >= TOKEN_GAP_S * 1000 and summary["tpot_ms_mean"] > 0
    assert summary["itl_ms_p50"] is not None


def test_while_idle_is_called_only_when_nothing_is_in_flight_with_the_time_to_the_next_request(stub):
    prompts = [[11, 1], [12, 1], [13, 1]]
    calls = []

    def while_idle(seconds):
        calls.append((time.perf_counter(), seconds))

    t0 = time.perf_counter()
    # request 1 arrives while request 0 still streams (its 3 tokens take 60 ms); request 2 after both finished
    results = run_trace(stub, [0.0, 0.01, 0.5], prompts, [3, 3, 3], timeout_s=5.0, while_idle=while_idle)
    assert all(r.ok for r in results)
    assert len(calls) == 1
    called_at, seconds = calls[0]
    assert called_at - t0 >= results[1].token_times_s[-1] - 0.01
    assert 0 < seconds <= 0.5 - (called_at - t0) + 0.01


def test_a_request_goes_out_when_an_overrunning_while_idle_returns(stub):
    results = run_trace(stub, [0.0, 0.2], [[11, 1], [12, 1]], [2, 2], timeout_s=5.0,
                        while_idle=lambda seconds: time.sleep(seconds + 0.2))
    assert all(r.ok for r in results)
    assert results[1].sent_s >= 0.4 and results[1].arrival_s == 0.2


def test_a_failed_request_makes_high_percentiles_infinite(stub):
    results = run_trace(stub, [0.0, 0.0], [[20, 1], [1, 1]], [2, 2], timeout_s=5.0)
    summary = summarize(results)
    assert summary["completed"] == 1 and summary["errors"]
    assert summary["ttft_ms_p99"] is None and summary["ttft_ms_mean"] is None


def test_random_prompts_are_distinct_and_seeded():
    a, b = random_prompts([50, 50], seed=3), random_prompts([50, 50], seed=3)
    assert a == b and a[0] != a[1] and [len(p) for p in a] == [50, 50]
    assert all(0 <= t < 50257 for p in a for t in p)


def test_the_replay_script_writes_measured_rows_against_a_running_server(stub, tmp_path):
    replay = replay_script()
    out = replay.main(["--model", "unused.gguf", "--url", stub, "--rate", "50", "--requests", "4",
                       "--prompt-min", "5", "--prompt-max", "8", "--output-len", "3", "--vocab", "1000",
                       "--seed", "2", "--timeout", "10", "--out", str(tmp_path / "r.json")])
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["measured"]["requests"] == 4
    # a prompt starting with a stub failure code (1-5) fails there; every other request gets its 3 tokens
    for row in written["requests"]:
        assert row["error"] is not None or row["output_tokens"] == 3
    assert out["settings"]["rate"] == 50.0


def replay_script():
    """scripts/llamacpp_replay.py as a module."""
    import importlib.util
    from pathlib import Path
    spec = importlib.util.spec_from_file_location(
        "llamacpp_replay", Path(__file__).resolve().parents[1] / "scripts" / "llamacpp_replay.py")
    replay = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(replay)
    return replay


@pytest.mark.parametrize("flag, value", [("-b", "0"), ("-ub", "0"), ("-ub", "-4"), ("-ub", "nan"), ("-b", "1e9")])
def test_the_replay_script_refuses_a_batch_size_out_of_bounds(tmp_path, capsys, flag, value):
    replay = replay_script()
    with pytest.raises(SystemExit) as exit_:
        replay.main(["--model", str(tmp_path / "m.gguf"), "--rate", "1", "--out", str(tmp_path / "o.json"),
                     flag, value])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--n-batch" in error or "--n-ubatch" in error
    assert not (tmp_path / "o.json").exists()


def test_the_replay_script_simulates_the_same_trace_under_the_llamacpp_policy(tmp_path, growing_cost):
    import argparse
    replay = replay_script()
    (tmp_path / "cm.json").write_text(json.dumps(growing_cost.to_dict()))
    args = argparse.Namespace(requests=20, rate=2.0, seed=0, prompt_min=None, prompt_max=None, output_len=None,
                              costmodel=tmp_path / "cm.json", np=4, n_batch=64, n_ubatch=32)
    summary = replay.simulated(replay.make_trace(args), args)
    assert summary["num_requests"] == 20 and summary["finished"] == 20 and summary["ttft_ms_p50"] > 0
    # the server's -b and -ub: its batch and its micro-batches
    from servingplan.simulate import metrics
    from servingplan.simulate import simulate
    assert summary == metrics.summarize(simulate(replay.make_trace(args), growing_cost, "llamacpp", 4, chunk_size=64,
                                                 record_tokens=True, n_ubatch=32))
