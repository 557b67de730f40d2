"""Start and stop a llama-server on loopback for a replay or a test.

    with LlamaServer(model_gguf, threads=2, n_parallel=8, ctx=6144, n_batch=2048, n_ubatch=512) as srv:
        run_trace(srv.url, ...)

`--cache-ram 0`: no prompt cache across requests. `-no-kvu`: each slot gets its own KV cache of ctx / n_parallel
cells, as the profile's decode points hold their sequences' cells apart (servingplan.llamacpp.profile). With
one unified buffer (`-kvu`) a released slot keeps its cells until it takes its next request, and every step's
attention spans every cell in use: a lone request decoded at 53-58 ms a step after seven 500-token requests
had finished on the other slots, against 20-22 ms on a fresh server; with a cache per slot, 19-25 ms. The server listens on 127.0.0.1 only, on a free port; its
log goes to `log_file` (`verbosity` is `-lv`: 3 info, the per-slot prompt progress and stops; 5 debug,
the per-batch lines a step comparison needs).
"""
from __future__ import annotations

import http.client
import socket
import subprocess
import time
from pathlib import Path

from servingplan.llamacpp import build

# the KV cache in float32, as the model is and as the profile (servingplan.llamacpp.profile) measured it
FLOAT32_KV = ("-ctk", "f32", "-ctv", "f32")
# at verbosity 5: each log line stamped with its time since start, which the step log needs
# (servingplan.llamacpp.server_log)
STEP_LOG_ARGS = ("--log-timestamps",)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    def __init__(self, model: Path, *, threads: int = 2, n_parallel: int = 1, ctx: int = 2048,
                 n_batch: int = 2048, n_ubatch: int = 512, verbosity: int | None = None,
                 log_file: Path | None = None, binary: Path | None = None, startup_timeout_s: float = 120.0,
                 extra_args: tuple = ()):
        self.binary = Path(binary or build.binary("llama-server"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [str(self.binary), "-m", str(model), "-t", str(threads), "-np", str(n_parallel),
                     "-c", str(ctx), "-b", str(n_batch), "-ub", str(n_ubatch), "--cache-ram", "0", "-no-kvu",
                     "--host", "127.0.0.1", "--port", str(self.port), *map(str, extra_args)]
        if verbosity is not None:
            self.args += ["-lv", str(verbosity)]
        self.log_file = Path(log_file) if log_file else None
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None

    def start(self) -> "LlamaServer":
        log = open(self.log_file, "wb") if self.log_file else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         env=build.env())
        finally:
            if self.log_file:
                log.close()
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode} while starting"
                                   + (f" (log: {self.log_file})" if self.log_file else ""))
            if self.healthy():
                return self
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"llama-server not healthy within {self.startup_timeout_s:g} s")

    def healthy(self) -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except OSError:
            return False
        finally:
            conn.close()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def __enter__(self) -> "LlamaServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
