"""What the input tests and the probe runner (benchmarks/input_probes.py) share: setting a key deep in a
config or cost-model document, a guard that turns a hang into a failure, and the check that a config
is refused in one line or passes. Imported as `helpers`: pytest puts tests/ on the path, the probe
runner puts it there itself."""
from __future__ import annotations

import contextlib
import signal


def set_path(document, path, value):
    """Set `path` (keys, and list indexes) in `document`, creating the objects (or the lists, padded
    with empty objects) it passes through; return `document`."""
    node = document
    for key, following in zip(path[:-1], path[1:]):
        if isinstance(node, list):
            while len(node) <= key:
                node.append({})
        # a container of the kind the next key indexes: an earlier draw may have left the other kind here
        kind = list if isinstance(following, int) else dict
        current = node[key] if isinstance(node, list) else node.get(key)
        if not isinstance(current, kind):
            node[key] = kind()
        node = node[key]
    if isinstance(node, list):
        while len(node) <= path[-1]:
            node.append({})
    node[path[-1]] = value
    return document


@contextlib.contextmanager
def hang_guard(seconds: int):
    """A block still running after `seconds` raises TimeoutError (a FIFO or an endless loop would block
    the suite instead)."""
    def stop(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: a hang")
    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def one_line(message: str) -> str:
    """`message` when it is one line without a traceback; AssertionError otherwise."""
    assert message.strip() and len(message.strip().splitlines()) == 1, message
    assert "Traceback" not in message, message
    return message


def config_refused(config) -> str | None:
    """The one-line refusal servingplan.config.check gives `config` (starting "config error: "), or None
    when it passes; AssertionError for any other outcome (several lines, another exception)."""
    from servingplan import config as config_module
    try:
        config_module.check(config)
    except config_module.ConfigError as exc:
        message = one_line(str(exc))
        assert message.startswith("config error: "), message
        return message
    return None


def require_llamacpp(present: bool, message: str) -> None:
    """Skip a llama.cpp test whose build or sources are absent, unless the run says it built them
    (SERVINGPLAN_REQUIRE_LLAMACPP=1, set by a CI that runs `make llamacpp` first): then absence fails.
    CI does not build llama.cpp yet (about 40 minutes on a fresh 2-core machine: issue 22 is open)."""
    import os

    import pytest

    if present:
        return
    if os.environ.get("SERVINGPLAN_REQUIRE_LLAMACPP") == "1":
        pytest.fail(message + " (this run requires the llama.cpp build)")
    pytest.skip(message)
