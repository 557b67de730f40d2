"""Stopping a run once every SLO verdict that reads it is settled failing.

A search that reads only verdicts (the capacity bisections, the fleet and speed-up searches) does not need
the rest of a run once enough requests are already known to miss a latency bound: a percentile fails when
its sorted position holds a miss, whatever the requests still running do, and attainment fails when the
requests that can still be good are too few. A request is known to miss the TTFT bound once its first
token came late, and the TPOT bound once it finished with too slow a reply; nothing else is counted, so a
run stops only when the verdict the full run would give is already a failure. The limits (how many misses
settle each verdict) come from servingplan.simulate.metrics, which defines the verdicts.

A run is stopped only when every verdict reading it is settled (`MissWatch.settled`); such a run has no
latency figure to report (metrics.summarize refuses it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class MissLimit:
    """One verdict's failure, settled when any of its counts is reached (inf: not counted): `ttft_misses`
    requests over `ttft_ms` (a TTFT percentile), `tpot_misses` multi-token requests over `tpot_ms` (a TPOT
    percentile), or `bad` requests over either bound (attainment)."""
    ttft_ms: float | None
    tpot_ms: float | None
    ttft_misses: float = math.inf
    tpot_misses: float = math.inf
    bad: float = math.inf


class MissWatch:
    """Counts each MissLimit's misses as a run emits first tokens and completes requests, and says when
    every limit is reached (`settled`). The lateness tests are metrics' own float expressions."""

    def __init__(self, limits: list[MissLimit], arrival_s, output_tokens):
        if not limits:
            raise ValueError("MissWatch needs at least one limit")
        self.limits = list(limits)
        self.arrival = [float(a) for a in arrival_s]
        self.output = [int(o) for o in output_tokens]
        self.first = [math.nan] * len(self.arrival)
        self.ttft_misses = [0] * len(self.limits)
        self.tpot_misses = [0] * len(self.limits)
        self.bad = [0] * len(self.limits)
        self.is_bad = [bytearray(len(self.arrival)) for _ in self.limits]
        self.settled = False

    def first_token(self, i: int, t: float) -> None:
        self.first[i] = t
        ttft = t - self.arrival[i]
        for k, limit in enumerate(self.limits):
            if limit.ttft_ms is not None and not ttft * 1e3 <= limit.ttft_ms:
                self.ttft_misses[k] += 1
                self._mark_bad(k, i)
        self._check()

    def finished(self, i: int, t: float) -> None:
        n_out = self.output[i]
        if n_out < 2:
            return
        tpot = (t - self.first[i]) / (n_out - 1)
        missed = False
        for k, limit in enumerate(self.limits):
            if limit.tpot_ms is not None and not tpot * 1e3 <= limit.tpot_ms:
                self.tpot_misses[k] += 1
                self._mark_bad(k, i)
                missed = True
        if missed:
            self._check()

    def _mark_bad(self, k: int, i: int) -> None:
        if not self.is_bad[k][i]:
            self.is_bad[k][i] = 1
            self.bad[k] += 1

    def _check(self) -> None:
        self.settled = all(self.ttft_misses[k] >= limit.ttft_misses or self.tpot_misses[k] >= limit.tpot_misses
                           or self.bad[k] >= limit.bad for k, limit in enumerate(self.limits))
