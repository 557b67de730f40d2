"""The validation stage, in two jobs: replay Poisson traces on the real engine, then compare them with
the simulator.

- run_replay (rule validate_replay) serves the traces in real time. It depends on the engine, the step
  functions, the scheduler the engine drives and the cost model, and not on the simulator: its rates
  are fractions of the cost model's service rate at the cap (service_rate_rps, arithmetic on the step
  times), its result is written to one JSON file (replay_to_json) with every request's timeline,
  every engine step and every timing taken beside them.
- run_comparison (rule validate) simulates the same traces and sets them against the replay. Editing
  the simulator reruns only this job; the replay is not served again.

Rates run from well below the service rate to overload. Each trace holds at least `min_requests`
requests, enough for its p90 to mean something, and the serving time is bounded by `max_wall_s`
whatever the machine's speed. The simulator's stability capacity is computed beside the comparison, so
the report can say what share of it each trace offered.

The machine's speed moves by tens of percent within minutes. Two readings of it are taken:
- the profile's two reference shapes (servingplan.profiling.measure.reference_points) before every
  trace and after the last, with the profiler's own estimator (machine_drift: a record of the machine,
  not a correction);
- shape-matched evidence (ShapeRetimer): the profile's own grid points at the batch sizes and contexts
  the engine actually serves, re-timed while the engine waits for its next request (between engine
  steps, never delaying one) and after each trace, against their profiled values.
A speed correction uses only the shape-matched evidence, and is applied to a kind of step (the decode
steps of one batch size, or the prefill-only steps) of one trace only where it brings the engine's
own steps of that kind closer to the model: a correction the engine's steps contradict is recorded
with its reason and not applied. The cost model itself is fitted on the profile alone: the replays
judge it and never feed it.

Besides the replays the stage measures what the report needs:
- path check: engine decode steps and the profiler's point of the same shape (batch, ragged contexts,
  padding, KV pool layout), timed back to back in alternating rounds; their ratio shows the profile
  times what the engine runs;
- the engine's peak resident memory while it served the traces at the validated cap (the memory verdict
  of every policy and cap uses servingplan.serving.memory_probe instead).
"""
from __future__ import annotations

import time

import numpy as np
import pandas as pd
import psutil
import torch

from servingplan.capacity import Criterion, capacity
from servingplan.device import model_device
from servingplan.metrics import SLO
from servingplan.pipeline import terminal
from servingplan.memory import kv_blocks
from servingplan.profiling.machine import roofline_probes
from servingplan.profiling.measure import (GridPoint, build_grid, decode_lengths, point_call, pool_for,
                                           reference_points, time_call, time_references)
from servingplan.serving.engine import ENGINE_STEP_COLUMNS, Engine
from servingplan.serving.replay import compare, predict_steps, request_pairs
from servingplan.sim import simulate
from servingplan.sim.policies import chunk_budget
from servingplan.sim.simulator import SimResult
from servingplan.sim.steps import STEP_COLUMNS
from servingplan.workload import Trace, generate

# batch sizes x longest context of the path check; its decode steps per engine run; rounds
PATH_CHECK_SHAPES = ((1, 256), (4, 256), (8, 256))
PATH_CHECK_STEPS = 12
PATH_CHECK_ROUNDS = 3
# a batch size's steps are judged only when there are this many of them
MIN_STEPS_PER_BATCH = 20
STEP_GOAL_PCT = 10.0
# a re-timing of a profile point: warm-up calls and timed calls (their median is the reading)
RETIME_WARMUP = 1
RETIME_REPEATS = 3
# an idle gap is used for a re-timing only when it is this many times the point's expected time (its
# profiled time at the slowest speed seen so far), so a request never waits for a re-timing
IDLE_MARGIN = 2.0
# progress: a line per this many finished requests of a trace
PROGRESS_EVERY = 10
# the draws of the workload the service rate is averaged over
SERVICE_RATE_DRAWS = 3


def validation_traces(workload: dict, validation: dict, reference_rps: float, seed: int):
    """One trace per configured load fraction: ~trace_seconds of arrivals at that rate, and never fewer
    than min_requests requests. Poisson arrivals are drawn; a trace file gives its first requests."""
    for i, fraction in enumerate(validation["rates_fraction"]):
        rate = fraction * reference_rps
        n = max(validation["min_requests"], int(round(rate * validation["trace_seconds"])))
        spec = dict(workload, num_requests=n, rate=rate)
        # A file's trace is the whole log whatever num_requests says. The engine serves in real time, so
        # the whole of a real log (thousands of requests) would take hours and overrun max_wall_s; its
        # first n requests are bounded like a Poisson trace and keep the log's own arrival pattern.
        trace = generate(spec, seed + 101 * (i + 1))
        if workload.get("trace"):
            trace = Trace(trace.arrival_s[:n], trace.prompt_tokens[:n], trace.output_tokens[:n])
        yield fraction, rate, trace.with_rate(rate)


class SpeedProbe:
    """Re-times the profile's reference shapes with the profiler's estimator, on a KV pool of the
    profile's geometry, and compares them with the profile's median reference times. The roofline
    probes are re-run beside them: an independent reading of whether the machine itself is slower."""

    def __init__(self, model, profile_meta: dict, seed: int):
        settings = profile_meta["settings"]
        self.settings = settings
        self.baseline = {kind: values["median_s"] for kind, values in profile_meta["speed"]["by_kind"].items()}
        self.roofline = profile_meta["roofline"]
        points = reference_points(settings)
        generator = torch.Generator().manual_seed(seed)
        # slots for the reference batch only, but the profile's slot length, so every slot's view has the
        # profile's strides without holding the profile's whole pool (gigabytes) beside the engine
        longest = max(p.cached + p.prompt_len for p in build_grid(settings) + list(points.values()))
        self.device = model_device(model)
        pool = pool_for(model.config, list(points.values()) + [GridPoint("prefill", 1, longest, 0)], generator,
                        self.device)
        self.pool_bytes = int(pool.keys.nbytes + pool.values.nbytes)
        self.calls = {kind: point_call(model, pool, point, generator) for kind, point in points.items()}
        self.started = time.perf_counter()
        self.rows: list[dict] = []
        self.probes: list[dict] = []

    def measure(self, label: str) -> dict:
        """{kind: now / profiled} at this moment, recorded under `label`."""
        ratios = {}
        with torch.inference_mode():
            for row in time_references(self.calls, self.settings, self.started):
                ratios[row["kind"]] = row["seconds"] / self.baseline[row["kind"]]
                self.rows.append({"label": label, **row, "profiled_s": self.baseline[row["kind"]],
                                  "ratio": ratios[row["kind"]]})
        now = roofline_probes(self.roofline["probe_bytes"], self.roofline["gemm_size"], self.device)
        self.probes.append({"label": label, "bandwidth_gbs": now["bandwidth_gbs"], "gemm_gflops": now["gemm_gflops"],
                            "bandwidth_over_profile": now["bandwidth_gbs"] / self.roofline["bandwidth_gbs"],
                            "gemm_over_profile": now["gemm_gflops"] / self.roofline["gemm_gflops"]})
        return ratios


def path_check(model, profile_meta: dict, seed: int, shapes=PATH_CHECK_SHAPES, steps: int = PATH_CHECK_STEPS,
               rounds: int = PATH_CHECK_ROUNDS, threads: int | None = None) -> dict:
    """Engine decode steps against the profiler's point of the same shape, timed back to back.

    An engine run serves B requests whose prompts are decode_lengths(B, T) tokens, all arriving at
    once, under continuous batching with cap B: after one prefill step every later step decodes all B,
    as the profiler's point does. The point is timed at the contexts the engine's steps have halfway
    through its run. Engine and profiler alternate, `rounds` times, so both see the same machine."""
    settings = profile_meta["settings"]
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for batch, context in shapes:
        prompts = decode_lengths(batch, context).numpy()
        trace = Trace(np.zeros(batch), prompts.astype(np.int64), np.full(batch, steps + 1, dtype=np.int64))
        engine = Engine(model, "continuous", batch, threads=threads)
        middle = GridPoint("decode", batch, 1, context + steps // 2)
        pool = pool_for(model.config, [middle], generator, model_device(model))
        call = point_call(model, pool, middle, generator)
        engine_times, profile_times = [], []
        for _ in range(rounds):
            run = engine.run(trace, seed=seed)
            decoding = run.steps[(run.steps["batch"] == batch) & (run.steps["n_prefill_calls"] == 0)]
            engine_times.append(float(decoding["duration_s"].median()))
            with torch.inference_mode():
                timed = time_call(call, settings["warmup"], settings["repeats"], 0.0)
            profile_times.append(float(np.median([s for _, s, _ in timed])))
        engine_s, profile_s = float(np.median(engine_times)), float(np.median(profile_times))
        rows.append({"batch": batch, "context": context, "engine_step_s": engine_s, "profile_point_s": profile_s,
                     "engine_over_profile": engine_s / profile_s,
                     "engine_rounds_s": engine_times, "profile_rounds_s": profile_times})
    ratios = [row["engine_over_profile"] for row in rows]
    return {"shapes": rows, "median_ratio": float(np.median(ratios)),
            "max_abs_diff_pct": float(100 * max(abs(r - 1) for r in ratios))}


def expected_max(values: np.ndarray, k: int) -> float:
    """The expected largest of k draws with replacement from `values` (exact over their empirical
    distribution): a padded decode batch of k sequences reads k times its longest context."""
    ordered = np.sort(np.asarray(values, dtype=float))
    n = ordered.size
    share = np.arange(n + 1) / n
    return float(np.sum(ordered * (share[1:] ** k - share[:-1] ** k)))


def service_rate_rps(cost, traces: list[Trace], cap: int) -> float:
    """Requests per second the cost model serves with `cap` sequences decoding together: each request
    costs its prompt's prefill and, per output token, its share (1/cap) of a decode step of cap
    sequences at the workload's mean context halfway through a reply (padded to the expected longest
    of cap such contexts). Arithmetic on the step times, no simulation: the replay's load reference."""
    prompts = np.concatenate([t.prompt_tokens for t in traces]).astype(float)
    outputs = np.concatenate([t.output_tokens for t in traces]).astype(float)
    contexts = prompts + outputs / 2
    step = cost.decode_time(cap, cap * float(contexts.mean()), expected_max(contexts, cap))
    work = np.mean([cost.prefill_time(int(p)) for p in prompts]) + outputs.mean() * step / cap
    return float(1.0 / work)


def nearest(values, target: float) -> int:
    """The value of `values` nearest `target` on a log scale (sizes grow geometrically)."""
    return int(min(values, key=lambda v: (abs(np.log(v / max(target, 1))), v)))


class ShapeRetimer:
    """Re-times the profile's own grid points at the shapes the engine serves: a decode step of batch B
    whose longest sequence holds c entries is matched by the profile's decode point of batch B (when the
    profile has that batch) at the profiled context nearest c; a fresh prefill call of n tokens by the
    prefill point of the nearest profiled length. Each reading (median of RETIME_REPEATS calls after
    RETIME_WARMUP) is set against the point's profiled time: ratio above one, the point runs slower now."""

    def __init__(self, model, profile_meta: dict, profile_points: pd.DataFrame, cap: int, seed: int):
        points = profile_points[((profile_points["kind"] == "decode") & (profile_points["batch"] <= cap))
                                | (profile_points["kind"] == "prefill")]
        self.profiled = {GridPoint(row.kind, int(row.batch), int(row.prompt_len), int(row.cached)): float(row.median_s)
                         for row in points.itertuples()}
        self.decode_batches = sorted({p.batch for p in self.profiled if p.kind == "decode"})
        self.decode_contexts = sorted({p.cached for p in self.profiled if p.kind == "decode"})
        self.prefill_lengths = sorted({p.prompt_len for p in self.profiled if p.kind == "prefill"})
        generator = torch.Generator().manual_seed(seed + 17)
        pool = pool_for(model.config, list(self.profiled), generator, model_device(model)) if self.profiled else None
        self.calls = {point: point_call(model, pool, point, generator) for point in self.profiled}
        self.started = time.perf_counter()
        self.slowest = 1.0
        self.rows: list[dict] = []

    def matches(self, steps) -> dict[GridPoint, int]:
        """{matched profile point: how many of `steps` (step rows) it matches}."""
        counts: dict[GridPoint, int] = {}
        for step in steps:
            if step["batch"] in self.decode_batches and self.decode_contexts:
                point = GridPoint("decode", int(step["batch"]), 1, nearest(self.decode_contexts, step["ctx_max"]))
                counts[point] = counts.get(point, 0) + 1
            for tokens, cached in step["prefill_calls"]:
                if cached == 0 and self.prefill_lengths:
                    point = GridPoint("prefill", 1, nearest(self.prefill_lengths, tokens), 0)
                    counts[point] = counts.get(point, 0) + 1
        return counts

    def expected_s(self, point: GridPoint) -> float:
        return self.profiled[point] * self.slowest * (RETIME_WARMUP + RETIME_REPEATS)

    def retime(self, point: GridPoint, label: str) -> None:
        with torch.inference_mode():
            timed = time_call(self.calls[point], RETIME_WARMUP, RETIME_REPEATS, self.started)
        seconds = float(np.median([s for _, s, _ in timed]))
        ratio = seconds / self.profiled[point]
        self.slowest = max(self.slowest, ratio)
        self.rows.append({"label": label, "t_s": float(timed[-1][0]), "kind": point.kind, "batch": point.batch,
                          "prompt_len": point.prompt_len, "cached": point.cached, "seconds": seconds,
                          "profiled_s": self.profiled[point], "ratio": ratio})

    def _timed_under(self, label: str) -> dict:
        counts: dict = {}
        for row in self.rows:
            if row["label"] == label:
                point = GridPoint(row["kind"], row["batch"], row["prompt_len"], row["cached"])
                counts[point] = counts.get(point, 0) + 1
        return counts

    def while_idle(self, label: str):
        """The engine's while_idle callback for one trace: in each idle gap, re-time the served shapes
        least re-timed so far in this trace (most served first) that fit the gap with IDLE_MARGIN."""
        def use_gap(gap_s: float, steps) -> None:
            deadline = time.perf_counter() + gap_s
            served = self.matches(steps)
            timed = self._timed_under(label)
            for point in sorted(served, key=lambda p: (timed.get(p, 0), -served[p], p.kind, p.batch, p.cached)):
                if IDLE_MARGIN * self.expected_s(point) > deadline - time.perf_counter():
                    continue
                self.retime(point, label)
        return use_gap

    def catch_up(self, steps, label: str) -> None:
        """After a trace (the engine idle): re-time every shape it served that the idle gaps missed."""
        timed = self._timed_under(label)
        for point in sorted(self.matches(steps), key=lambda p: (p.kind, p.batch, p.prompt_len, p.cached)):
            if point not in timed:
                self.retime(point, label)


def say(message: str) -> None:
    print(f"validate: {message}", file=terminal(), flush=True)


class Progress:
    """The engine's on_finished callback for one trace: a terminal line every PROGRESS_EVERY finished
    requests and at the last one."""

    def __init__(self, number: int, total: int):
        self.number, self.total, self.shown = number, total, 0

    def __call__(self, finished: int) -> None:
        if finished >= self.shown + PROGRESS_EVERY or (finished == self.total and finished > self.shown):
            self.shown = finished
            say(f"trace {self.number}: {finished} of {self.total} requests finished")


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


def run_replay(model, cost, machine: dict, profile_points: pd.DataFrame, workload: dict, validation: dict,
               sweep: dict, memory: dict, seed: int, threads: int | None = None) -> dict:
    """Serve every validation trace in real time on the engine, with the speed readings around them.
    Returns a JSON-able dict: settings, service_rate_rps, traces (each with its Trace, the engine's
    request timeline and step rows, or skipped: true), machine_drift, retimed (shape-matched readings),
    path_check and serving_memory. It reads no simulation."""
    policy, cap, chunk = validation["policy"], validation["cap"], sweep["chunk_size"]
    blocks = kv_blocks(machine, memory)
    draws = [generate(workload, seed + i) for i in range(SERVICE_RATE_DRAWS)]
    reference_rps = service_rate_rps(cost, draws, cap)
    say(f"load reference: the cost model serves {reference_rps:.3g} req/s at {policy} cap {cap}")

    probe = SpeedProbe(model, machine, seed)
    retimer = ShapeRetimer(model, machine, profile_points, cap, seed)
    engine = Engine(model, policy, cap, chunk, blocks, memory["block_size"], threads, chunk_budget(sweep))
    traces = []
    rss_before = psutil.Process().memory_info().rss
    peak_rss, pool_bytes = rss_before, 0
    started = time.monotonic()
    probe.measure("before trace 1")
    fractions = validation["rates_fraction"]
    for number, (fraction, rate, trace) in enumerate(validation_traces(workload, validation, reference_rps, seed), 1):
        remaining = validation["max_wall_s"] - (time.monotonic() - started)
        entry = {"number": number, "load_fraction": fraction, "rate": rate,
                 "trace": {"arrival_s": trace.arrival_s.tolist(), "prompt_tokens": trace.prompt_tokens.tolist(),
                           "output_tokens": trace.output_tokens.tolist()}}
        if remaining <= 0:
            say(f"trace {number} of {len(fractions)} ({fraction:g} x the service rate) skipped: the stage's "
                f"serving time (validation.max_wall_s = {validation['max_wall_s']:g} s) is used up")
            traces.append({**entry, "skipped": True})
            continue
        say(f"trace {number} of {len(fractions)}: {len(trace)} requests at {rate:.3g} req/s ({fraction:g} x the "
            f"service rate), served in real time (at most {remaining:.0f} s)")
        label = f"trace {number}"
        run = engine.run(trace, remaining, seed, while_idle=retimer.while_idle(label),
                         on_finished=Progress(number, len(trace)))
        rows = run.steps.to_dict("records")
        retimer.catch_up(rows, label)
        probe.measure(f"after trace {number}")
        measured = run.result
        if measured.truncated:
            say(f"trace {number} truncated at {measured.end_s:.0f} s: {int(measured.finished.sum())} of {len(trace)} "
                f"requests finished; the comparison uses those")
        peak_rss = max(peak_rss, measured.meta["peak_rss_bytes"])
        pool_bytes = max(pool_bytes, measured.meta["kv_pool_bytes"])
        traces.append({**entry, "skipped": False, "result": result_to_json(measured),
                       "steps": [{key: (list(map(list, value)) if key == "prefill_calls" else value)
                                  for key, value in row.items()} for row in rows]})

    # after the replays, so that its engines and pools are not part of the serving memory measured above
    say("timing engine steps against profile points of the same shape")
    checked = path_check(model, machine, seed, threads=threads)
    return {
        "settings": {"policy": policy, "max_num_seqs": cap, "chunk_size": chunk, "kv_blocks": blocks,
                     "block_size": memory["block_size"]},
        "service_rate_rps": reference_rps,
        "traces": traces,
        "machine_drift": {"trace": probe.rows, "roofline": probe.probes},
        "retimed": retimer.rows,
        "path_check": checked,
        "serving_memory": {"peak_rss_bytes": int(peak_rss), "rss_before_replays_bytes": int(rss_before),
                           "kv_pool_bytes": int(pool_bytes), "speed_probe_pool_bytes": probe.pool_bytes,
                           "max_num_seqs": cap, "policy": policy},
    }


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


def median_ratio(values) -> float | None:
    values = [v for v in values if np.isfinite(v)]
    return float(np.median(values)) if values else None


def corrections(steps: pd.DataFrame, retimed: pd.DataFrame, label: str) -> list[dict]:
    """The speed corrections of one trace, one per kind of step: the decode-only steps of each batch size,
    and the prefill-only steps. A kind's evidence is the median ratio (now / profiled) of the profile's
    points matching it, re-timed during and right after this trace; the engine's reading is the median
    measured / predicted time of its own steps of that kind. The correction is applied only when both
    say the same thing (both above one, or both below) and it brings those steps closer to the model;
    otherwise the factor is one and `status` says why."""
    out = []
    readings = retimed[retimed["label"] == label] if len(retimed) else retimed
    if steps.empty:
        return out
    decoding = steps[(steps["n_prefill_calls"] == 0) & (steps["batch"] > 0)]
    prefilling = steps[(steps["batch"] == 0) & (steps["n_prefill_calls"] > 0)]
    kinds = [("decode", int(b), decoding[decoding["batch"] == b]) for b in sorted(decoding["batch"].unique())]
    kinds.append(("prefill", 0, prefilling))
    for kind, batch, own in kinds:
        if kind == "decode":
            evidence = readings[(readings["kind"] == "decode") & (readings["batch"] == batch)] if len(readings) else readings
        else:
            evidence = readings[readings["kind"] == "prefill"] if len(readings) else readings
        factor = median_ratio(evidence["ratio"]) if len(evidence) else None
        engine = median_ratio(own["duration_s"] / own["predicted_s"]) if len(own) else None
        row = {"label": label, "kind": kind, "batch": batch, "steps": int(len(own)), "readings": int(len(evidence)),
               "evidence_ratio": factor, "engine_ratio": engine, "applied_factor": 1.0}
        if factor is None or engine is None:
            row["status"] = "no evidence" if factor is None else "no steps"
        elif (factor - 1) * (engine - 1) <= 0:
            row["status"] = "contradicted"   # the re-timed points and the engine's steps disagree in direction
        elif abs(median_ratio(own["duration_s"] / (own["predicted_s"] * factor)) - 1) >= abs(engine - 1):
            row["status"] = "no closer"      # same direction, but it overshoots the engine's own steps
        else:
            row.update(status="applied", applied_factor=factor)
        out.append(row)
    return out


def corrected_times(steps: pd.DataFrame, cost, applied: list[dict]) -> pd.Series:
    """Each step's predicted time with its kind's applied factor: decode part x the factor of its batch,
    prefill part x the prefill factor."""
    decode = {row["batch"]: row["applied_factor"] for row in applied if row["kind"] == "decode"}
    prefill = next((row["applied_factor"] for row in applied if row["kind"] == "prefill"), 1.0)
    return pd.Series([cost.decode_time(row.batch, row.ctx_sum, row.ctx_max) * decode.get(row.batch, 1.0)
                      + sum(cost.prefill_time(n, c) for n, c in row.prefill_calls) * prefill
                      for row in steps.itertuples()], index=steps.index, dtype=float)


def corrected_cost(cost, applied: list[dict]):
    """The cost model the corrected simulation runs on: decode terms x the step-weighted mean of the
    decode factors applied, prefill terms x the prefill factor (one when not applied)."""
    decode = [(row["applied_factor"], row["steps"]) for row in applied if row["kind"] == "decode" and row["steps"]]
    weight = sum(n for _, n in decode)
    decode_factor = sum(f * n for f, n in decode) / weight if weight else 1.0
    prefill = next((row["applied_factor"] for row in applied if row["kind"] == "prefill"), 1.0)
    return cost.slowed(decode_factor, prefill), decode_factor, prefill


def run_comparison(replayed: dict, cost, machine: dict, workload: dict, validation: dict, sweep: dict,
                   memory: dict, seed: int) -> dict:
    """Simulate every served trace, on the cost model as fitted and as corrected by the shape-matched
    evidence, and set them against the replay (see the module docstring)."""
    settings = replayed["settings"]
    policy, cap, chunk, blocks = settings["policy"], settings["max_num_seqs"], settings["chunk_size"], settings["kv_blocks"]
    draws = [generate(workload, seed + i) for i in range(3)]
    found = capacity(draws, [seed + i for i in range(3)], cost, policy, cap, chunk,
                     Criterion(SLO(), attainment_goal=0.0), 0.01, 64.0, 0.02, blocks, memory["block_size"],
                     sweep["horizon_factor"], chunk_budget(sweep))
    stable_rps = found["capacity_rps"]
    retimed = pd.DataFrame(replayed["retimed"])
    tables, pairs, steps, traces, applied_all = [], [], [], [], []
    for entry in replayed["traces"]:
        fraction, rate, number = entry["load_fraction"], entry["rate"], entry["number"]
        trace = trace_of(entry)
        label = {"load_fraction": fraction, "rate": rate}
        if entry["skipped"]:
            traces.append({**label, "requests": len(trace), "skipped": True, "simulated_load": rate / stable_rps})
            continue
        say(f"comparing trace {number} ({len(trace)} requests) with the simulator")
        measured = result_from_json(entry["result"])
        frame = predict_steps(step_frame(entry["steps"]), cost)
        applied = corrections(frame, retimed, f"trace {number}") if len(frame) else []
        applied_all += [{**row, **label} for row in applied]
        model_cost, decode_factor, prefill_factor = corrected_cost(cost, applied)
        for name, used in (("as_fitted", cost), ("drift_corrected", model_cost)):
            simulated = simulate(trace, used, policy, cap, chunk, blocks, memory["block_size"],
                                 sweep["horizon_factor"], chunk_budget=chunk_budget(sweep))
            tables.append(compare(measured, simulated).assign(**label, cost_model=name))
            if name == "as_fitted":
                pairs.append(request_pairs(measured, simulated).assign(**label))
                traces.append({**label, "requests": len(trace), "skipped": False, "simulated_load": rate / stable_rps,
                               "measured_finished": int(measured.finished.sum()),
                               "measured_truncated": bool(measured.truncated),
                               "simulated_stable": bool(simulated.stable),
                               "measured_wall_s": float(measured.end_s), "errors": len(measured.meta.get("errors", {})),
                               "speed_ratio": {"decode": decode_factor, "prefill": prefill_factor}})
        if len(frame):
            corrected = corrected_times(frame, cost, applied)
            steps.append(frame.assign(corrected_s=corrected,
                                      corrected_error_pct=100.0 * (corrected - frame["duration_s"]) / frame["duration_s"],
                                      **label))

    comparison = pd.concat(tables, ignore_index=True) if tables else pd.DataFrame()
    if len(comparison):
        comparison["agrees"] = agreement(comparison, validation["goal_pct"])
    all_steps = pd.concat(steps, ignore_index=True) if steps else pd.DataFrame()
    by_batch = steps_by_batch(all_steps)
    speed_trace = pd.DataFrame(replayed["machine_drift"]["trace"])
    drift = {kind: float(group["ratio"].median()) for kind, group in speed_trace.groupby("kind")} if len(speed_trace) else {}
    drift_ratio = float(np.mean(list(drift.values()))) if drift else 1.0
    top = headline(comparison, by_batch, validation, all_steps, drift_ratio)
    return {
        "comparison": comparison,
        "requests": pd.concat(pairs, ignore_index=True) if pairs else pd.DataFrame(),
        "steps": all_steps.drop(columns=["prefill_calls"], errors="ignore"),
        "steps_by_batch": by_batch,
        "meta": {
            "policy": policy, "max_num_seqs": cap, "chunk_size": chunk, "kv_blocks": blocks,
            "service_rate_rps": replayed["service_rate_rps"],
            "stable_capacity_rps": stable_rps, "stable_capacity_interval": [found["capacity_min_rps"],
                                                                            found["capacity_max_rps"]],
            "traces": traces,
            "machine_drift": {"by_kind": drift, "ratio": drift_ratio, **replayed["machine_drift"]},
            "retimed": replayed["retimed"],
            "corrections": applied_all,
            "path_check": replayed["path_check"],
            "serving_memory": replayed["serving_memory"],
            "steps_by_batch": by_batch.to_dict("records"),
            "headline": top,
            "findings": findings(comparison, by_batch, traces, applied_all, validation),
        },
    }


def steps_by_batch(steps: pd.DataFrame) -> pd.DataFrame:
    """Engine steps grouped by decode batch size (0: steps that only prefill): how many, and the
    median step time measured and predicted as fitted and as corrected (see corrections)."""
    if steps.empty:
        return pd.DataFrame()
    grouped = steps.groupby("batch")
    table = pd.DataFrame({
        "steps": grouped.size(),
        "with_prefill": grouped["n_prefill_calls"].apply(lambda calls: int((calls > 0).sum())),
        "measured_ms": grouped["duration_s"].median() * 1e3,
        "predicted_ms": grouped["predicted_s"].median() * 1e3,
        "corrected_ms": grouped["corrected_s"].median() * 1e3,
        "median_error_pct": grouped["error_pct"].median(),
        "median_corrected_error_pct": grouped["corrected_error_pct"].median(),
    }).reset_index()
    table["judged"] = table["steps"] >= MIN_STEPS_PER_BATCH
    table["within_goal"] = table["median_corrected_error_pct"].abs() <= STEP_GOAL_PCT
    return table


def agreement(rows: pd.DataFrame, goal_pct: float) -> pd.Series:
    """A simulated statistic agrees when it lies inside the measured bootstrap 90% interval or within
    goal_pct of the measured value."""
    inside = (rows["simulated_ms"] >= rows["measured_lo_ms"]) & (rows["simulated_ms"] <= rows["measured_hi_ms"])
    return inside | (rows["diff_pct"].abs() <= goal_pct)


def headline(comparison: pd.DataFrame, by_batch: pd.DataFrame, validation: dict,
             steps: pd.DataFrame | None = None, drift: float = 1.0) -> dict:
    """The agreement figures the report leads with: p90 TTFT and mean TPOT at every load up to 0.85
    of the service rate, for the cost model as fitted and as corrected by the shape-matched evidence (where the
    engine's own steps agree with it; the key keeps its older name drift_corrected),
    and the step error (per batch size, and over all steps)."""
    if comparison.empty:
        return {"evaluated": False}
    goal = validation["goal_pct"]
    out = {"evaluated": True, "goal_pct": goal, "machine_drift_ratio": drift}
    # a run whose engine finished no timed step has no per-step error: the figures are None, not absent
    timed = steps is not None and len(steps) > 0
    out.update({"step_mape_pct": float(steps["error_pct"].abs().mean()) if timed else None,
                "step_bias_pct": float(steps["error_pct"].median()) if timed else None,
                "step_mape_drift_corrected_pct": float(steps["corrected_error_pct"].abs().mean()) if timed else None,
                "step_bias_drift_corrected_pct": float(steps["corrected_error_pct"].median()) if timed else None})
    for name in ("as_fitted", "drift_corrected"):
        below = comparison[(comparison["load_fraction"] <= 0.85 + 1e-9) & (comparison["cost_model"] == name)]
        judged = below[((below["metric"] == "ttft") & (below["stat"] == "p90"))
                       | ((below["metric"] == "tpot") & (below["stat"] == "mean"))].dropna(subset=["diff_pct"])

        def worst(metric):
            rows = judged[judged["metric"] == metric]["diff_pct"]
            return float(rows.abs().max()) if len(rows) else None

        out[name] = {"worst_abs_ttft_p90_diff_pct": worst("ttft"), "worst_abs_tpot_mean_diff_pct": worst("tpot"),
                     "agree": int(agreement(judged, goal).sum()), "judged": int(len(judged)),
                     "met": bool(len(judged)) and bool(agreement(judged, goal).all())}
    judged_batches = by_batch[by_batch["judged"]] if len(by_batch) else by_batch
    out["steps"] = {"min_steps": MIN_STEPS_PER_BATCH, "goal_pct": STEP_GOAL_PCT,
                    "judged_batches": [int(b) for b in judged_batches.get("batch", [])],
                    "met": bool(len(judged_batches)) and bool(judged_batches["within_goal"].all())}
    out["met"] = out["drift_corrected"]["met"]
    return out


def direction(values) -> str:
    """How the model's signed errors (model - measured) read: optimistic (the model is faster than the
    engine: every error below zero), pessimistic (every error above zero), or mixed."""
    values = [v for v in values if v is not None and np.isfinite(v)]
    if not values:
        return "not measured"
    if all(v < 0 for v in values):
        return "optimistic"
    if all(v > 0 for v in values):
        return "pessimistic"
    return "mixed"


def findings(comparison: pd.DataFrame, by_batch: pd.DataFrame, traces: list[dict], applied: list[dict],
             validation: dict) -> dict:
    """The measured gaps as data, for the report's first screen: for p90 TTFT and mean TPOT, per cost
    model, the signed gaps (simulated - measured, % of measured) at every judged load with the range and
    its direction word; the per-batch step errors likewise; which corrections were applied and which
    refused, each with its evidence (re-timed points / profiled) and the engine's own steps (measured /
    model); and the traces skipped or truncated (a skipped trace has no figure, never a made-up one)."""
    gaps = []
    judged_loads = comparison[comparison["load_fraction"] <= 0.85 + 1e-9] if len(comparison) else comparison
    for metric, stat in (("ttft", "p90"), ("tpot", "mean")):
        for name in ("as_fitted", "drift_corrected"):
            rows = (judged_loads[(judged_loads["metric"] == metric) & (judged_loads["stat"] == stat)
                                 & (judged_loads["cost_model"] == name)].dropna(subset=["diff_pct"])
                    if len(judged_loads) else judged_loads)
            signed = [float(v) for v in rows["diff_pct"]] if len(rows) else []
            gaps.append({"metric": metric, "stat": stat, "cost_model": name,
                         "loads": [float(v) for v in rows["load_fraction"]] if len(rows) else [],
                         "diff_pct": signed,
                         "min_abs_pct": float(min(map(abs, signed))) if signed else None,
                         "max_abs_pct": float(max(map(abs, signed))) if signed else None,
                         "direction": direction(signed),
                         "agree": int(rows["agrees"].sum()) if len(rows) and "agrees" in rows else 0,
                         "judged": int(len(rows))})
    steps = []
    for row in (by_batch.to_dict("records") if len(by_batch) else []):
        steps.append({"batch": int(row["batch"]), "steps": int(row["steps"]), "judged": bool(row["judged"]),
                      "error_pct": float(row["median_error_pct"]), "direction": direction([row["median_error_pct"]]),
                      "corrected_error_pct": float(row["median_corrected_error_pct"]),
                      "corrected_direction": direction([row["median_corrected_error_pct"]]),
                      "within_goal": bool(row["within_goal"])})
    return {"goal_pct": validation["goal_pct"], "step_goal_pct": STEP_GOAL_PCT, "requests": gaps, "steps": steps,
            "corrections_applied": [{key: row[key] for key in ("load_fraction", "kind", "batch", "steps", "applied_factor",
                                                                  "evidence_ratio", "engine_ratio")}
                                    for row in applied if row["status"] == "applied"],
            "corrections_refused": [{key: row[key] for key in ("load_fraction", "kind", "batch", "steps", "status",
                                                                  "evidence_ratio", "engine_ratio")}
                                    for row in applied if row["status"] in ("contradicted", "no closer")],
            "skipped_traces": [t["load_fraction"] for t in traces if t["skipped"]],
            "truncated_traces": [t["load_fraction"] for t in traces if not t["skipped"] and t["measured_truncated"]]}
