"""Stage engine: reads the profiled model and a trace, served in real time; writes the replay's
measurements (results/validation/replay.json, through servingplan.validate.validation_replay) and
results/validation/serving_memory.json (memory_probe); run by rules/validate.smk.

A real continuous-batching GPT-2 engine driving the simulator's Scheduler with the wall clock.

Its names are loaded on first use (PEP 562), so that importing one module of the package (the KV pool,
the memory probe) does not load the engine and its dependencies; the replay-and-compare helpers live in
servingplan.engine.replay.
"""
from importlib import import_module

_EXPORTS = {"Engine": "servingplan.engine.engine", "EngineRun": "servingplan.engine.engine",
            "request_problem": "servingplan.engine.engine", "KVPool": "servingplan.profile.kvpool"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'servingplan.engine' has no attribute {name!r}")
    return getattr(import_module(_EXPORTS[name]), name)
