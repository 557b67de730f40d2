"""Capacity: the highest Poisson arrival rate at which an SLO statistic still holds.

Each seed is one draw of the workload; its arrival gaps are rescaled to every candidate rate (common
random numbers), so the statistic is compared across rates on the same requests. The rate is found
by bisection on a log scale; an unstable queue counts as a failure. The result per seed is a
bracket [lower, upper]: the SLO held at `lower` and failed at `upper`.

Every criterion and every speed of the measured band is searched on the same draws, and the searches
share what is already known instead of each starting from [rate_min, rate_max]:
- one run per (speed, seed, rate), whatever the criterion: every criterion is judged on it;
- every criterion requires a stable queue, so a rate whose run was unstable fails them all, and with one
  slot so does every rate from the service-rate bound up (saturation_rate: the rate whose trace duration
  the engine time the trace needs at the least, busy_floor, already fills);
- a search starts at a guess (the same criterion's bracket on the previous seed, or at the fitted speed
  scaled by the service-rate bounds' ratio) and widens geometrically until the threshold is bracketed,
  then bisects as before;
- a run stops as soon as its queue is settled unstable (simulate.simulator's stop_when_unstable), or once
  every criterion that will read it (the one whose search runs it and those searched after) is settled
  failing by the requests already known to miss a bound (simulate.misses): bare stability is searched first,
  so the later criteria's runs stop that way.
Each bracket still has the SLO holding at `lower`, failing at `upper` and upper / lower - 1 <= tolerance,
so the capacity agrees with a search from [rate_min, rate_max] within the tolerance.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from servingplan.simulate import policies, simulate
from servingplan.simulate.metrics import SLO, miss_limit, slo_verdict
from servingplan.simulate.policies import DEFAULT_CHUNK_BUDGET
from servingplan.simulate.workload import Trace


@dataclass(frozen=True)
class Criterion:
    """What must hold at a rate: the SLO's aggregate percentiles, or joint attainment >= a goal."""
    slo: SLO
    attainment_goal: float | None = None

    def holds(self, summary: dict) -> bool:
        if not summary["stable"]:
            return False
        if self.attainment_goal is not None:
            return summary["attainment"] >= self.attainment_goal
        return bool(summary["slo_holds"])

    def miss_limit(self, trace: Trace):
        """What settles this criterion failing before a run of `trace` ends (metrics.miss_limit), or None
        for bare stability, which only a finished run shows."""
        if _stability_only(self):
            return None
        return miss_limit(self.slo, trace.output_tokens, self.attainment_goal)

    @property
    def label(self) -> str:
        if self.attainment_goal is not None:
            return f"attainment>={self.attainment_goal:g}"
        return "slo_percentiles"


# Halving the log-width of any finite positive bracket this many times reaches neighbouring floats.
MAX_BISECTIONS = 200


def log_bisect(true_below, lo: float, hi: float, tolerance: float) -> tuple[float, float]:
    """Narrow [lo, hi] on a log scale around where `true_below` turns from true (at lo) to false (at hi),
    until the relative width is within `tolerance`, the bounds are neighbouring floats (no midpoint
    lies between them), or MAX_BISECTIONS evaluations."""
    if not (0.0 < lo < hi and math.isfinite(hi)):
        raise ValueError(f"log_bisect bracket [{lo}, {hi}]: needs finite bounds 0 < lo < hi")
    for _ in range(MAX_BISECTIONS):
        if hi / lo - 1.0 <= tolerance:
            break
        mid = math.sqrt(lo * hi)
        if not lo < mid < hi:
            break
        if true_below(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


def int_bisect(true_below, lo: int, hi: int) -> tuple[int, int]:
    """Narrow the integers [lo, hi] around where `true_below` turns from true (at lo, known) to false (at hi,
    known) until they are neighbours; log_bisect's counterpart for counts (users, replicas)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if true_below(mid):
            lo = mid
        else:
            hi = mid
    return lo, hi


def search_rate(holds_at: Callable[[float], bool], rate_min: float, rate_max: float, tolerance: float,
                fails_from: float = math.inf, known_to_hold: float | None = None, guess: float | None = None) -> dict:
    """Largest rate in [rate_min, rate_max] where `holds_at` is true, assuming it fails above some rate.
    What is known without a run: it fails at every rate >= `fails_from`, and it holds at `known_to_hold`.
    With nothing known and no `guess`, this is a plain log bisection of [rate_min, rate_max] after
    checking both ends. With a guess, the first run is there, and the bracket widens from it by factors
    (1 + tolerance), ^2, ^4, ... until the threshold is inside; then log bisection."""
    evaluations = 0

    def check(rate):
        nonlocal evaluations
        evaluations += 1
        return holds_at(rate)

    top_fails = fails_from <= rate_max
    top = fails_from if top_fails else rate_max
    if top <= rate_min:
        return {"lower": 0.0, "upper": rate_min, "evaluations": 0, "censored": "below_min"}
    lo = known_to_hold if known_to_hold is not None and rate_min <= known_to_hold < top else None
    hi = top if top_fails else None
    if guess is None and lo is None:
        if not check(rate_min):
            return {"lower": 0.0, "upper": rate_min, "evaluations": evaluations, "censored": "below_min"}
        lo = rate_min
    if guess is None and hi is None:
        if check(top):
            return {"lower": rate_max, "upper": None, "evaluations": evaluations, "censored": "above_max"}
        hi = top
    if guess is not None:
        at = min(max(guess, lo if lo is not None else rate_min), top)
        if not (at == top and top_fails) and at != lo:
            if check(at):
                lo = at
            else:
                hi = at
    factor = 1.0 + tolerance             # a good guess is bracketed by one more run
    while hi is None:                      # widen upwards from a rate that holds
        at = min(lo * factor, top)
        if at == top and top_fails:
            hi = top
        elif check(at):
            if at == top:
                return {"lower": rate_max, "upper": None, "evaluations": evaluations, "censored": "above_max"}
            lo = at
        else:
            hi = at
        factor *= factor
    while lo is None:                      # widen downwards from a rate that fails
        if hi <= rate_min:
            return {"lower": 0.0, "upper": rate_min, "evaluations": evaluations, "censored": "below_min"}
        at = max(hi / factor, rate_min)
        if check(at):
            lo = at
        elif at == rate_min:
            return {"lower": 0.0, "upper": rate_min, "evaluations": evaluations, "censored": "below_min"}
        else:
            hi = at
        factor *= factor
    lo, hi = log_bisect(check, lo, hi, tolerance)
    return {"lower": lo, "upper": hi, "evaluations": evaluations, "censored": ""}


def busy_floor(trace: Trace, cost, policy: str, cap: int) -> float:
    """Engine time that serving `trace` takes at the least, on any number of replicas and at any rate.
    Every prompt is prefilled once: whole (prefill_time) or, by a chunking policy, in chunks whose calls
    cost at least the fixed and per-token terms once. Every other reply token is decoded in a batch of at
    most `cap`, costing at least the cheapest per-sequence share of a decode step, f(B)/B for B <= cap,
    plus reading its prompt and one token; or, after a preemption, comes from a re-prefill of at least
    the shortest prompt and one token, when that is cheaper. Cost-model coefficients are >= 0."""
    prompts = np.asarray(trace.prompt_tokens, dtype=float)
    decodes = float(np.sum(np.asarray(trace.output_tokens, dtype=float) - 1.0))
    whole = not policies.chunks(policy)
    prefill = len(prompts) * cost.prefill_fixed_s + cost.prefill_per_token_s * prompts.sum()
    if whole:
        prefill += cost.prefill_per_token_sq_s * np.square(prompts).sum()
    shortest = float(prompts.min()) + 1.0
    decode_share = (min(cost.decode_batch_time(b) / b for b in range(1, cap + 1))
                    + cost.decode_per_ctx_token_s * shortest)
    reprefill = (cost.prefill_fixed_s + cost.prefill_per_token_s * shortest
                 + (cost.prefill_per_token_sq_s * shortest ** 2 if whole else 0.0))
    return float(prefill + decodes * min(decode_share, reprefill))


def ttft_floor_s(trace: Trace, cost, policy: str) -> np.ndarray:
    """Each request's least TTFT (s): the engine time of its own prefill, whole (prefill_time) or, by a
    chunking policy, in chunks costing at least the fixed and per-token terms once; queueing and the
    rest of the steps it rides in only add to it."""
    prompts = np.asarray(trace.prompt_tokens, dtype=float)
    floor = cost.prefill_fixed_s + cost.prefill_per_token_s * prompts
    if not policies.chunks(policy):
        floor = floor + cost.prefill_per_token_sq_s * np.square(prompts)
    return floor


def saturation_rate(trace: Trace, cost, policy: str, cap: int) -> float:
    """The rate at which busy_floor fills the trace's duration (len / rate). With one slot a replica's
    backlog growth is its busy time minus the duration (simulate.simulator), so from this rate on it is
    unstable; with more slots it is where full batches would saturate, a starting guess."""
    return len(trace) / busy_floor(trace, cost, policy, cap)


def _stability_only(criterion: Criterion) -> bool:
    return criterion.slo == SLO() and not criterion.attainment_goal


def capacity_searches(traces: list[Trace], seeds: list[int], cost, policy: str, cap: int, chunk_size: int,
                      criteria: dict, rate_min: float, rate_max: float, tolerance: float,
                      kv_blocks: int | None = None, block_size: int = 16, horizon_factor: float = 20.0,
                      chunk_budget: str = DEFAULT_CHUNK_BUDGET, speed_band: bool = True) -> dict:
    """capacity_in_band for every named Criterion of `criteria` at once, sharing runs and brackets (see
    the module's note). Returns {name: capacity_in_band's result}."""
    models = {"fitted": cost, **(speed_band_models(cost) if speed_band else {})}
    # the bare stability criterion first: its failures bound every other criterion's search
    order = sorted(criteria, key=lambda name: not _stability_only(criteria[name]))
    per_seed = {(model, name): [] for model in models for name in criteria}
    # what settles each criterion failing on each trace (metrics.miss_limit): fixed by the trace's replies
    limits = [{name: criteria[name].miss_limit(trace) for name in order} for trace in traces]
    for model_name, model in models.items():
        for index, (seed, trace) in enumerate(zip(seeds, traces)):
            runs, verdicts = {}, {}     # rate -> SimResult (stopped once settled); (rate, name) -> bool

            def judged(rate, name):
                if rate not in runs:
                    # the criteria that will read this run: this one and those searched after it; it stops
                    # once each of them is settled failing (none can be for bare stability)
                    watched = [limits[index][reader] for reader in order[order.index(name):]]
                    runs[rate] = simulate(trace.with_rate(rate), model, policy, cap, chunk_size, kv_blocks,
                                          block_size, horizon_factor, chunk_budget=chunk_budget,
                                          stop_when_unstable=True,
                                          stop_when_missed=watched if None not in watched else None)
                if (rate, name) not in verdicts:
                    result = runs[rate]
                    verdicts[(rate, name)] = not result.misses_settled and result.stable and criteria[name].holds(
                        slo_verdict(result, criteria[name].slo))
                return verdicts[(rate, name)]

            bound = saturation_rate(trace, model, policy, cap)
            for name in order:
                known = {rate: judged(rate, name) for rate in list(runs)}
                fails_from = min([bound if cap == 1 else math.inf, *(rate for rate, ok in known.items() if not ok)])
                held = [rate for rate, ok in known.items() if ok and rate < fails_from]
                guess = _guess(per_seed, model_name, name, index, bound, saturation_rate(
                    trace, cost, policy, cap), tolerance)
                found = search_rate(lambda rate: judged(rate, name), rate_min, rate_max, tolerance,
                                    fails_from, max(held) if held else None, guess)
                per_seed[(model_name, name)].append({"seed": seed, **found})
    results = {}
    for name, criterion in criteria.items():
        found = {model: _summary(policy, cap, chunk_size, criterion, per_seed[(model, name)]) for model in models}
        fitted, band = found.pop("fitted"), found
        searched = [fitted, *band.values()]
        results[name] = {**fitted, "speed_band": band,
                         "interval_rps": [min(f["capacity_min_rps"] for f in searched),
                                          max(f["capacity_max_rps"] for f in searched)]}
    return results


def _guess(per_seed: dict, model: str, name: str, index: int, bound: float, fitted_bound: float,
           tolerance: float) -> float:
    """Where a search starts: the same criterion's last bracket at this speed; else, at another speed,
    the fitted speed's bracket on this seed scaled by the ratio of their service-rate bounds; else just
    below the service-rate bound (where a queue saturates when its batches are full)."""
    def middle(found):
        if found["censored"] == "below_min":
            return found["upper"]
        if found["censored"] == "above_max":
            return found["lower"]
        return math.sqrt(found["lower"] * found["upper"])

    same_speed = per_seed[(model, name)]
    if same_speed:
        return middle(same_speed[-1])
    if model != "fitted" and len(per_seed[("fitted", name)]) > index:
        return middle(per_seed[("fitted", name)][index]) * bound / fitted_bound
    return bound / (1.0 + tolerance)


def _summary(policy: str, cap: int, chunk_size: int, criterion: Criterion, per_seed: list) -> dict:
    """Per-seed brackets and their spread. `capacity` is the median of the per-seed lower bounds."""
    lowers = np.array([s["lower"] for s in per_seed])
    return {
        "policy": policy, "max_num_seqs": cap, "chunk_size": chunk_size, "criterion": criterion.label,
        "capacity_rps": float(np.median(lowers)), "capacity_min_rps": float(lowers.min()),
        "capacity_max_rps": float(lowers.max()),
        "never_met": bool((lowers == 0).all()), "per_seed": per_seed,
    }


def capacity(traces: list[Trace], seeds: list[int], cost, policy: str, cap: int, chunk_size: int,
             criterion: Criterion, rate_min: float, rate_max: float, tolerance: float,
             kv_blocks: int | None = None, block_size: int = 16, horizon_factor: float = 20.0,
             chunk_budget: str = DEFAULT_CHUNK_BUDGET) -> dict:
    """Per-seed brackets and their spread at the cost model as given. `capacity` is the median of the
    per-seed lower bounds."""
    found = capacity_searches(traces, seeds, cost, policy, cap, chunk_size, {"criterion": criterion}, rate_min,
                              rate_max, tolerance, kv_blocks, block_size, horizon_factor, chunk_budget,
                              speed_band=False)["criterion"]
    return {k: v for k, v in found.items() if k not in ("speed_band", "interval_rps")}


def speed_band_models(cost) -> dict:
    """The cost model at the slowest and the fastest speed its profile measured (cost.meta's
    speed_band: each reference's relative speed range), or nothing for a model without one."""
    band = cost.meta.get("speed_band") or {}
    if not {"decode", "prefill"} <= set(band):
        return {}
    return {"slow": cost.slowed(band["decode"][1], band["prefill"][1], f"{cost.name} at its slowest"),
            "fast": cost.slowed(band["decode"][0], band["prefill"][0], f"{cost.name} at its fastest")}


def capacity_in_band(traces: list[Trace], seeds: list[int], cost, policy: str, cap: int, chunk_size: int,
                     criterion: Criterion, *args, **kwargs) -> dict:
    """capacity() on the cost model as fitted, plus `speed_band` (the same search on the cost model at
    the slowest and fastest measured speed) and `interval_rps`, which covers the seeds' spread at
    every one of those speeds."""
    return capacity_searches(traces, seeds, cost, policy, cap, chunk_size, {"criterion": criterion}, *args,
                             **kwargs)["criterion"]
