"""One recorder of a run's engine steps, shared by the simulator, the real engine and Exercise 2.

Each row is one engine step: when it started and how long it took, the decode batch and the KV
context it read, the prefill calls it carried, what the scheduler admitted and preempted while planning
it, how many tokens it emitted, and its time split into prefill and decode. A caller may add its own
columns (the real engine adds overhead_s and kv_moved_tokens) after these.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

STEP_COLUMNS = ("step", "start_s", "duration_s", "batch", "ctx_sum", "ctx_max", "prefill_calls",
                "n_prefill_calls", "prefill_tokens", "admitted", "preempted", "emitted", "prefill_s", "decode_s")


class StepRecorder:
    def __init__(self, extra_columns: tuple[str, ...] = ()):
        self.extra_columns = tuple(extra_columns)
        self.rows: list[dict] = []

    def record(self, start_s: float, duration_s: float, batch: int, ctx_sum: int, ctx_max: int, prefill_calls,
               admitted: int, preempted: int, emitted: int, prefill_s: float, decode_s: float, **extra) -> None:
        """One step; `prefill_calls` is the scheduler's [(tokens, cached), ...] of the step."""
        if set(extra) != set(self.extra_columns):
            raise ValueError(f"step recorder: extra columns {sorted(extra)}, expected {sorted(self.extra_columns)}")
        calls = list(prefill_calls)
        self.rows.append({"step": len(self.rows), "start_s": start_s, "duration_s": duration_s, "batch": batch,
                          "ctx_sum": ctx_sum, "ctx_max": ctx_max, "prefill_calls": calls,
                          "n_prefill_calls": len(calls), "prefill_tokens": sum(n for n, _ in calls),
                          "admitted": admitted, "preempted": preempted, "emitted": emitted,
                          "prefill_s": prefill_s, "decode_s": decode_s, **extra})

    def frame(self) -> pd.DataFrame:
        # imported here: the simulator records no steps in a search, whose processes then never import pandas
        import pandas as pd

        return pd.DataFrame(self.rows, columns=list(STEP_COLUMNS + self.extra_columns))
