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
    assert "-kvu" in server.args and server.args[server.args.index("--cache-ram") + 1] == "0"
    with server:
        assert server.healthy()
    assert server.proc.poll() is not None and not server.healthy()


def test_a_server_that_exits_while_starting_is_reported(tmp_path):
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\nexit 3\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match="exited with 3"):
        LlamaServer(tmp_path / "none.gguf", binary=fake, startup_timeout_s=10).start()
