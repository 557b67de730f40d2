"""The real-time replay's file (results/validation/replay.json): what the replay job writes and the
comparison job reads back. Its own module so that the replay and the comparison share the format and
nothing else.

    result_to_json(SimResult) -> dict      result_from_json(dict) -> SimResult
    trace_of(trace entry) -> Trace         step_frame(step rows) -> DataFrame (the engine's step columns)
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from servingplan.engine.engine import ENGINE_STEP_COLUMNS
from servingplan.simulate.simulator import SimResult
from servingplan.simulate.steps import STEP_COLUMNS
from servingplan.simulate.workload import Trace

TIMELINE_FIELDS = ("arrival_s", "prompt_tokens", "output_tokens", "scheduled_s", "first_token_s", "completion_s",
                   "generated", "preemptions", "recomputed_tokens", "rejected")


def result_to_json(result: SimResult) -> dict:
    """A replay's request timeline as plain lists (None where a time was never reached), and its facts."""
    out = {name: [None if isinstance(v, float) and np.isnan(v) else v for v in np.asarray(getattr(result, name)).tolist()]
           for name in TIMELINE_FIELDS}
    out.update({"end_s": float(result.end_s), "truncated": bool(result.truncated), "steps": int(result.steps),
                "events": int(result.events), "peak_running": int(result.peak_running),
                "peak_kv_blocks": int(result.peak_kv_blocks), "peak_kv_tokens": int(result.peak_kv_tokens),
                "backlog_growth_s": None if result.backlog_growth_s is None else float(result.backlog_growth_s),
                "policy": result.policy,
                "max_num_seqs": int(result.max_num_seqs), "chunk_size": int(result.chunk_size),
                "meta": {key: value for key, value in result.meta.items() if key != "errors"},
                "errors": {str(i): reason for i, reason in result.meta.get("errors", {}).items()}})
    return out


def result_from_json(data: dict) -> SimResult:
    float_array = lambda name: np.array([np.nan if v is None else v for v in data[name]], dtype=float)  # noqa: E731
    meta = dict(data["meta"], errors={int(i): reason for i, reason in data["errors"].items()})
    return SimResult(
        arrival_s=float_array("arrival_s"), prompt_tokens=np.array(data["prompt_tokens"], dtype=np.int64),
        output_tokens=np.array(data["output_tokens"], dtype=np.int64), scheduled_s=float_array("scheduled_s"),
        first_token_s=float_array("first_token_s"), completion_s=float_array("completion_s"),
        generated=np.array(data["generated"], dtype=np.int64), preemptions=np.array(data["preemptions"], dtype=np.int64),
        recomputed_tokens=np.array(data["recomputed_tokens"], dtype=np.int64),
        rejected=np.array(data["rejected"], dtype=bool), token_spans=None, end_s=data["end_s"],
        truncated=data["truncated"], steps=data["steps"], events=data["events"], peak_running=data["peak_running"],
        peak_kv_blocks=data["peak_kv_blocks"], peak_kv_tokens=data["peak_kv_tokens"],
        backlog_growth_s=data["backlog_growth_s"], policy=data["policy"], max_num_seqs=data["max_num_seqs"],
        chunk_size=data["chunk_size"], meta=meta)


def trace_of(entry: dict) -> Trace:
    data = entry["trace"]
    return Trace(np.array(data["arrival_s"], dtype=float), np.array(data["prompt_tokens"], dtype=np.int64),
                 np.array(data["output_tokens"], dtype=np.int64))


def step_frame(rows: list[dict]) -> pd.DataFrame:
    """The engine's step rows as written by the replay (an engine that ran no step gave none)."""
    frame = pd.DataFrame(rows, columns=list(STEP_COLUMNS + ENGINE_STEP_COLUMNS))
    if len(frame):
        frame["prefill_calls"] = [[tuple(call) for call in calls] for calls in frame["prefill_calls"]]
    return frame

