"""A real continuous-batching GPT-2 engine driving the simulator's Scheduler with the wall clock.

Its names are loaded on first use (PEP 562), so that importing one module of the package (the KV pool,
the memory probe) does not load the engine and its dependencies; the replay-and-compare helpers live in
servingplan.serving.replay.
"""
from importlib import import_module

_EXPORTS = {"Engine": "engine", "EngineRun": "engine", "request_problem": "engine", "KVPool": "kvpool"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'servingplan.serving' has no attribute {name!r}")
    return getattr(import_module(f"servingplan.serving.{_EXPORTS[name]}"), name)
