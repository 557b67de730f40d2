"""The validation stage's first job (rule validate_replay): serve Poisson traces on the real engine in real
time, with the speed readings around them; servingplan.validate.validation compares them with the simulator in the
second job, reading the file this one writes (servingplan.validate.replay_file).

run_replay depends on the engine, the step functions, the scheduler the engine drives and the cost model,
never on the simulator: its rates are fractions of the cost model's service rate at the cap
(service_rate_rps, arithmetic on the step times).

Each trace holds at least `min_requests` requests, enough for its p90 to mean something, so its arrivals
span at least min_requests / rate seconds: at the low load that span, not trace_seconds, sets the
stage's length (the replay says both spans up front). Everything the stage times after the model is
loaded (speed probes, traces, re-timings, path check) runs inside validation.max_wall_s (Budget), and
the measurements run in the traces' idle gaps wherever a gap is long enough.

The machine's speed moves by tens of percent within minutes. Two readings of it are taken:
- the profile's two reference shapes (servingplan.profile.measure.reference_points) before the first
  trace and after each, with the profiler's own estimator, and the bandwidth and the GEMM rate of the
  product that gave the profile's peak (machine_drift: a record of the machine, not a correction);
- shape-matched evidence (ShapeRetimer): the profile's own grid points at the batch sizes and contexts
  the engine actually serves, re-timed while the engine waits for its next request (between engine
  steps, never delaying one), and after each trace for any kind of step still without a reading.
The comparison job applies a correction only from the shape-matched evidence.

Besides the replays the stage measures the path check (PathCheck): engine decode steps and the profiler's
point of the same shape (batch, ragged contexts, padding, KV pool layout), timed back to back; their
ratio shows the profile times what the engine runs. The memory verdict of every policy and cap uses
servingplan.engine.memory_probe; the peak recorded here is the replay process's, measurements included.
"""
from __future__ import annotations

import math
import time

import numpy as np
import pandas as pd
import psutil
import torch

from servingplan.device import model_device
from servingplan.engine.engine import Engine
from servingplan.memory import kv_blocks
from servingplan.pipeline import terminal
from servingplan.profile.machine import memory_bandwidth_gbs, product_gflops, shape_name
from servingplan.profile.measure import (GridPoint, build_grid, decode_lengths, point_call, pool_for,
                                         reference_points, time_call, time_references)
from servingplan.simulate.policies import chunk_budget
from servingplan.simulate.workload import Trace, generate
from servingplan.validate.replay_file import result_to_json

PATH_CHECK_SHAPES = ((1, 256), (4, 256), (8, 256))
PATH_CHECK_STEPS = 12
PATH_CHECK_ROUNDS = 3
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
        # the product that gave the profile's peak rate, so the ratio compares one product with itself
        shape = self.roofline.get("peak", {}).get("gemm_shape") or shape_name([self.roofline["gemm_size"]] * 3)
        bandwidth = memory_bandwidth_gbs(self.roofline["probe_bytes"], device=self.device)
        gemm = product_gflops(tuple(int(n) for n in shape.split("x")), device=self.device)
        self.probes.append({"label": label, "bandwidth_gbs": bandwidth, "gemm_gflops": gemm, "gemm_shape": shape,
                            "bandwidth_over_profile": bandwidth / self.roofline["bandwidth_gbs"],
                            "gemm_over_profile": gemm / self.roofline["gemm_gflops"]})
        return ratios


class PathCheck:
    """Engine decode steps against the profiler's point of the same shape, timed back to back.

    An engine run serves B requests whose prompts are decode_lengths(B, T) tokens, all arriving at
    once, under continuous batching with cap B: after one prefill step every later step decodes all B,
    as the profiler's point does. The point is timed at the contexts the engine's steps have halfway
    through its run. A unit is one engine run and one timing of its point, back to back, so both see the
    same machine; each shape gets `rounds` units, taken round by round. Units run in the replay's idle
    gaps when one is long enough (run_units), the rest after the last trace, all inside the stage's
    serving time: a unit that does not fit is left out and the shape reports the rounds it has."""

    def __init__(self, model, profile_meta: dict, profile_points: pd.DataFrame, seed: int,
                 shapes=PATH_CHECK_SHAPES, steps: int = PATH_CHECK_STEPS, rounds: int = PATH_CHECK_ROUNDS,
                 threads: int | None = None):
        self.model, self.settings, self.seed, self.threads = model, profile_meta["settings"], seed, threads
        self.steps, self.rounds = steps, rounds
        self.generator = torch.Generator().manual_seed(seed)
        self.pending = [shape for _ in range(rounds) for shape in shapes]
        self.engine_times = {shape: [] for shape in shapes}
        self.profile_times = {shape: [] for shape in shapes}
        self.prepared: dict = {}
        # a unit's expected time: its prefills, its decode steps and its point's timed calls at their
        # profiled times; scaled by the slowest actual / expected seen so far
        self.estimate = {shape: self._profiled_unit_s(profile_points, *shape) for shape in shapes}
        self.slowest = 1.0

    def _profiled_unit_s(self, points: pd.DataFrame, batch: int, context: int) -> float:
        prefill = points[points["kind"] == "prefill"]
        decode = points[points["kind"] == "decode"]
        if prefill.empty or decode.empty:
            return math.inf   # nothing to plan by: no unit is ever expected to fit, so none runs

        def closest(frame, column, value, **equal):
            for key, wanted in equal.items():
                near = frame[key].iloc[(frame[key] - wanted).abs().argsort()].iloc[0]
                frame = frame[frame[key] == near]
            return float(frame.iloc[(frame[column] - value).abs().argsort()].iloc[0]["median_s"])

        prefill_s = sum(closest(prefill, "prompt_len", int(n)) for n in decode_lengths(batch, context))
        step_s = closest(decode, "cached", context + self.steps // 2, batch=batch)
        return prefill_s + (self.steps + self.settings["warmup"] + self.settings["repeats"]) * step_s

    def expected_s(self) -> float:
        return self.estimate[self.pending[0]] * self.slowest if self.pending else 0.0

    def _parts(self, shape):
        if shape not in self.prepared:
            batch, context = shape
            prompts = decode_lengths(batch, context).numpy()
            trace = Trace(np.zeros(batch), prompts.astype(np.int64), np.full(batch, self.steps + 1, dtype=np.int64))
            middle = GridPoint("decode", batch, 1, context + self.steps // 2)
            pool = pool_for(self.model.config, [middle], self.generator, model_device(self.model))
            self.prepared[shape] = (Engine(self.model, "continuous", batch, threads=self.threads), trace,
                                    point_call(self.model, pool, middle, self.generator))
        return self.prepared[shape]

    def run_unit(self) -> None:
        shape = self.pending.pop(0)
        started = time.perf_counter()
        engine, trace, call = self._parts(shape)
        run = engine.run(trace, seed=self.seed)
        decoding = run.steps[(run.steps["batch"] == shape[0]) & (run.steps["n_prefill_calls"] == 0)]
        self.engine_times[shape].append(float(decoding["duration_s"].median()))
        with torch.inference_mode():
            timed = time_call(call, self.settings["warmup"], self.settings["repeats"], 0.0)
        self.profile_times[shape].append(float(np.median([s for _, s, _ in timed])))
        if 0 < self.estimate[shape] < math.inf:
            self.slowest = max(self.slowest, (time.perf_counter() - started) / self.estimate[shape])

    def run_units(self, seconds: float, margin: float = 1.0) -> None:
        """Run the next units while the next one's expected time x `margin` fits in `seconds`."""
        deadline = time.perf_counter() + seconds
        while self.pending and margin * self.expected_s() <= deadline - time.perf_counter():
            self.run_unit()

    def result(self) -> dict:
        rows = []
        for shape, engine_times in self.engine_times.items():
            if not engine_times:
                continue
            engine_s, profile_s = float(np.median(engine_times)), float(np.median(self.profile_times[shape]))
            rows.append({"batch": shape[0], "context": shape[1], "engine_step_s": engine_s,
                         "profile_point_s": profile_s, "engine_over_profile": engine_s / profile_s,
                         "engine_rounds_s": engine_times, "profile_rounds_s": self.profile_times[shape]})
        ratios = [row["engine_over_profile"] for row in rows]
        return {"shapes": rows, "median_ratio": float(np.median(ratios)) if ratios else None,
                "max_abs_diff_pct": float(100 * max(abs(r - 1) for r in ratios)) if ratios else None,
                "rounds": self.rounds, "units_left_out": len(self.pending)}


def expected_max(values: np.ndarray, k: int) -> float:
    """The expected largest of k draws with replacement from `values` (exact over their empirical
    distribution): a padded decode batch of k sequences reads k times its longest context."""
    ordered = np.sort(np.asarray(values, dtype=float))
    n = ordered.size
    share = np.arange(n + 1) / n
    return float(np.sum(ordered * (share[1:] ** k - share[:-1] ** k)))


def reference_rps(cost, workload: dict, cap: int, seed: int) -> float:
    """The replay's load reference: service_rate_rps over SERVICE_RATE_DRAWS draws of the workload."""
    return service_rate_rps(cost, [generate(workload, seed + i) for i in range(SERVICE_RATE_DRAWS)], cap)


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
    """Re-times the profile's own grid points at the shapes an engine serves: a decode step of batch B
    whose longest sequence holds c entries is matched by the profile's decode point of batch B (when the
    profile has that batch) at the profiled context nearest c; a fresh prefill call of n tokens by the
    prefill point of the nearest profiled length. Each reading (`time_point`: the project's engine times
    the point's call, TorchRetimer; llama.cpp's replay runs the tool that profiled it) is set against the
    point's profiled time: ratio above one, the point runs slower now.

    A kind of step (decode at one batch size, prefill) is read first at its point that took the most of
    the served time (steps matched x the point's profiled time), not the most steps: a kind's correction
    scales all its steps' time, so it is read where that time is. A trace's prefill time sits in its
    long prompts, its most frequent prompts can be its short ones."""

    def __init__(self, profile_points: pd.DataFrame, cap: int):
        points = profile_points[((profile_points["kind"] == "decode") & (profile_points["batch"] <= cap))
                                | (profile_points["kind"] == "prefill")]
        self.profiled = {GridPoint(row.kind, int(row.batch), int(row.prompt_len), int(row.cached)): float(row.median_s)
                         for row in points.itertuples()}
        self.decode_batches = sorted({p.batch for p in self.profiled if p.kind == "decode"})
        self.decode_contexts = sorted({p.cached for p in self.profiled if p.kind == "decode"})
        self.prefill_lengths = sorted({p.prompt_len for p in self.profiled if p.kind == "prefill"})
        self.started = time.perf_counter()
        self.slowest = 1.0
        self.rows: list[dict] = []

    def time_point(self, point: GridPoint) -> tuple[float, float]:
        """(seconds since the re-timer started when the reading ended, the reading in seconds)."""
        raise NotImplementedError

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

    def served_s(self, steps) -> dict[GridPoint, float]:
        """{matched profile point: the profiled seconds of the `steps` it matches}."""
        return {point: count * self.profiled[point] for point, count in self.matches(steps).items()}

    def expected_s(self, point: GridPoint) -> float:
        return self.profiled[point] * self.slowest * (RETIME_WARMUP + RETIME_REPEATS)

    def retime(self, point: GridPoint, label: str) -> None:
        t_s, seconds = self.time_point(point)
        ratio = seconds / self.profiled[point]
        self.slowest = max(self.slowest, ratio)
        self.rows.append({"label": label, "t_s": t_s, "kind": point.kind, "batch": point.batch,
                          "prompt_len": point.prompt_len, "cached": point.cached, "seconds": seconds,
                          "profiled_s": self.profiled[point], "ratio": ratio})

    def _timed_under(self, label: str) -> dict:
        counts: dict = {}
        for row in self.rows:
            if row["label"] == label:
                point = GridPoint(row["kind"], row["batch"], row["prompt_len"], row["cached"])
                counts[point] = counts.get(point, 0) + 1
        return counts

    def unmatched(self, steps, label: str) -> list[GridPoint]:
        """The served points of this trace not yet re-timed in it, most served time first."""
        served, timed = self.served_s(steps), self._timed_under(label)
        return sorted((p for p in served if p not in timed), key=lambda p: (-served[p], p.kind, p.batch, p.cached))

    def retime_within(self, points, label: str, seconds: float, margin: float = 1.0) -> None:
        """Re-time `points` in order, each only if its expected time x `margin` fits in what is left of
        `seconds`."""
        deadline = time.perf_counter() + seconds
        for point in points:
            if margin * self.expected_s(point) <= deadline - time.perf_counter():
                self.retime(point, label)

    def least_timed(self, steps, label: str) -> list[GridPoint]:
        """Every served point of this trace, least re-timed in it first, then most served time."""
        served, timed = self.served_s(steps), self._timed_under(label)
        return sorted(served, key=lambda p: (timed.get(p, 0), -served[p], p.kind, p.batch, p.cached))

    def uncovered_kinds(self, steps, label: str, readings: int = 1) -> list[GridPoint]:
        """After a trace: for each kind of step it served (decode at one batch size, prefill) with fewer
        than `readings` re-timings in it, its point of most served time, once per reading it lacks, so
        that every kind has evidence."""
        served = self.served_s(steps)
        counts: dict = {}
        for point, n in self._timed_under(label).items():
            counts[(point.kind, point.batch)] = counts.get((point.kind, point.batch), 0) + n
        best: dict = {}
        for point in sorted(served, key=lambda p: (-served[p], p.kind, p.batch, p.cached)):
            best.setdefault((point.kind, point.batch), point)
        return [point for kind, point in sorted(best.items()) for _ in range(readings - counts.get(kind, 0))]


class TorchRetimer(ShapeRetimer):
    """ShapeRetimer on the project's engine: each point's call on a KV pool of the profile's geometry, timed
    with the profiler's estimator (the median of RETIME_REPEATS calls after RETIME_WARMUP)."""

    def __init__(self, model, profile_points: pd.DataFrame, cap: int, seed: int):
        super().__init__(profile_points, cap)
        generator = torch.Generator().manual_seed(seed + 17)
        pool = pool_for(model.config, list(self.profiled), generator, model_device(model)) if self.profiled else None
        self.calls = {point: point_call(model, pool, point, generator) for point in self.profiled}
        self.started = time.perf_counter()   # its readings' clock starts once the calls are built

    def time_point(self, point: GridPoint) -> tuple[float, float]:
        with torch.inference_mode():
            timed = time_call(self.calls[point], RETIME_WARMUP, RETIME_REPEATS, self.started)
        return float(timed[-1][0]), float(np.median([s for _, s, _ in timed]))


class Budget:
    """The stage's serving time, validation.max_wall_s, counted from the start of run_replay: the speed
    probes, the traces, the re-timings and the path check all run inside it. A trace is served for what
    is left (its step running at the deadline completes); anything else runs only when its expected time
    fits in what is left."""

    def __init__(self, seconds: float):
        self.seconds = float(seconds)
        self.started = time.monotonic()

    def remaining(self) -> float:
        return self.seconds - (time.monotonic() - self.started)

    def used(self) -> float:
        return time.monotonic() - self.started


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


def run_replay(model, cost, machine: dict, profile_points: pd.DataFrame, workload: dict, validation: dict,
               sweep: dict, memory: dict, seed: int, threads: int | None = None) -> dict:
    """Serve every validation trace in real time on the engine, with the speed readings around them, all
    inside validation.max_wall_s (Budget). Returns a JSON-able dict: settings, service_rate_rps,
    expected_arrival_s, traces (each with its Trace, the engine's request timeline and step rows, or
    skipped: true), machine_drift, retimed (shape-matched readings), path_check, serving_memory and
    stage_s (where the stage's time went). It reads no simulation."""
    budget = Budget(validation["max_wall_s"])
    policy, cap, chunk = validation["policy"], validation["cap"], sweep["chunk_size"]
    # the engine admits as the decision's KV model of this machine does (a paged pool here would sit beside a
    # runtime that serving_memory measures after the replay, so it is sized by the budget alone)
    blocks = kv_blocks(machine, memory, cap)
    reference = reference_rps(cost, workload, cap, seed)
    say(f"load reference: the cost model serves {reference:.3g} req/s at {policy} cap {cap}")
    planned = list(validation_traces(workload, validation, reference, seed))
    # the serving time no engine can shorten: each trace lasts at least until its last arrival
    arrival_s = [float(trace.arrival_s[-1]) for _, _, trace in planned]
    say(f"the traces' arrivals span {' + '.join(f'{s:.0f}' for s in arrival_s)} s of the stage's "
        f"{validation['max_wall_s']:g} s (validation.max_wall_s)")

    stage = {"setup_s": 0.0, "probes_s": 0.0, "traces_s": 0.0, "catch_up_s": 0.0, "path_check_after_s": 0.0}
    started = time.monotonic()
    probe = SpeedProbe(model, machine, seed)
    retimer = TorchRetimer(model, profile_points, cap, seed)
    checker = PathCheck(model, machine, profile_points, seed, threads=threads)
    engine = Engine(model, policy, cap, chunk, blocks, memory["block_size"], threads, chunk_budget(sweep))
    stage["setup_s"] = time.monotonic() - started
    traces = []
    rss_before = psutil.Process().memory_info().rss
    peak_rss, pool_bytes = rss_before, 0

    def timed(key, work, *args):
        begun = time.monotonic()
        work(*args)
        stage[key] += time.monotonic() - begun

    timed("probes_s", probe.measure, "before trace 1")
    probe_s = stage["probes_s"]
    fractions = validation["rates_fraction"]
    for number, (fraction, rate, trace) in enumerate(planned, 1):
        remaining = budget.remaining()
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

        def use_gap(gap_s: float, steps, label=label) -> None:
            # first every served shape's first reading in this trace (its correction's evidence), then
            # the path check, then further readings; all with the margin that keeps requests from waiting
            deadline = time.perf_counter() + gap_s
            retimer.retime_within(retimer.unmatched(steps, label), label, gap_s, IDLE_MARGIN)
            checker.run_units(deadline - time.perf_counter(), IDLE_MARGIN)
            retimer.retime_within(retimer.least_timed(steps, label), label, deadline - time.perf_counter(), IDLE_MARGIN)

        begun = time.monotonic()
        run = engine.run(trace, remaining, seed, while_idle=use_gap, on_finished=Progress(number, len(trace)))
        stage["traces_s"] += time.monotonic() - begun
        rows = run.steps.to_dict("records")
        timed("catch_up_s", lambda: retimer.retime_within(retimer.uncovered_kinds(rows, label), label,
                                                          budget.remaining()))
        if budget.remaining() > probe_s:
            timed("probes_s", probe.measure, f"after trace {number}")
        measured = run.result
        if measured.truncated:
            say(f"trace {number} truncated at {measured.end_s:.0f} s: {int(measured.finished.sum())} of {len(trace)} "
                f"requests finished; the comparison uses those")
        peak_rss = max(peak_rss, measured.meta["peak_rss_bytes"])
        pool_bytes = max(pool_bytes, measured.meta["kv_pool_bytes"])
        traces.append({**entry, "skipped": False, "result": result_to_json(measured),
                       "steps": [{key: (list(map(list, value)) if key == "prefill_calls" else value)
                                  for key, value in row.items()} for row in rows]})

    if checker.pending:
        say(f"timing engine steps against profile points of the same shape ({len(checker.pending)} units left)")
        timed("path_check_after_s", lambda: checker.run_units(max(0.0, budget.remaining())))
    if checker.pending:
        say(f"path check: {len(checker.pending)} units left out, the stage's serving time is used up")
    stage["total_s"] = budget.used()
    return {
        "settings": {"policy": policy, "max_num_seqs": cap, "chunk_size": chunk, "kv_blocks": blocks,
                     "block_size": memory["block_size"]},
        "service_rate_rps": reference,
        "expected_arrival_s": arrival_s,
        "max_wall_s": float(validation["max_wall_s"]),
        "stage_s": stage,
        "traces": traces,
        "machine_drift": {"trace": probe.rows, "roofline": probe.probes},
        "retimed": retimer.rows,
        "path_check": checker.result(),
        # the process's peak while it served: the engine's, with the probe's, re-timer's and path check's
        # pools beside it (the memory verdict uses servingplan.engine.memory_probe, not this)
        "serving_memory": {"peak_rss_bytes": int(peak_rss), "rss_before_replays_bytes": int(rss_before),
                           "kv_pool_bytes": int(pool_bytes), "speed_probe_pool_bytes": probe.pool_bytes,
                           "max_num_seqs": cap, "policy": policy},
    }
