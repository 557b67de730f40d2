"""Measure how long GPT-2's serving calls take on this machine, over a grid of shapes, in rounds
spread over the whole run, against a speed trace of the machine taken alongside.

The profiled calls are the engine's own step functions on the engine's own KV layout
(servingplan.profile.kvpool): a profiled point and an engine step of the same shape run the same code.

    run_profile(profile_cfg, model_cfg, seed, quick=False, threads=None, progress=True) -> Profile
    Profile.write(points_csv, samples_csv, meta_json)      atomic writes
    point_call(model, pool, point, generator)             the timed call of one grid point
    time_call(call, warmup, repeats)                      seconds and CPU share of each timed call

run_profile calls configure_allocator() first: the engine does too. `profile_cfg` and `model_cfg` are
the `profile` and `model` sections of config.yaml. `quick` swaps in a 2-layer random model
(QUICK_CONFIG_OVERRIDES) and a tiny grid (QUICK_PROFILE) that run in seconds; model_cfg["tiny"]
(config/quick.yaml) swaps in the 2-layer model alone and keeps profile_cfg's grid.

Grid points, in kinds:

    prefill         batch 1, prompt_len in profile.prefill_lengths, nothing cached: prefill_step into a slot
    prefill_batch   batch in profile.prefill_batches, prompt_len BATCHED_PREFILL_LEN (informative only:
                    the engine prefills one sequence per call)
    prefill_cached  batch 1, a chunk of prompt_len tokens after `cached` tokens of the same prompt in
                    the slot (profile_cfg["cached_prefill"] if given, else CACHED_PREFILL_POINTS)
    decode          batch in profile.decode_batches, one token each, the longest sequence holding
                    `cached` tokens and the others fewer (decode_lengths), padded and masked as the
                    engine's ragged batches are

Rounds and the speed trace. This machine's speed moves by tens of percent within minutes, both ways.
The grid is measured in `rounds` passes, each in its own shuffled order, so every point is measured
at several times spread over the run. Every `reference_interval_s` the run re-times two fixed
reference shapes (one decode, one prefill), which gives the machine's speed over time. A call's
normalised time is its time divided by the reference's relative speed at that moment (the reference
trace interpolated, over its median): what the call would have taken at the run's typical speed.
A point's time is the median over rounds of its per-round medians of normalised calls: a typical time
under the conditions the engine runs in, not a best case. The spread of those per-round medians is the
point's uncertainty; the raw (not normalised) spread is kept beside it to show what normalising buys.

Re-measuring (plan_remeasure, remeasure_until_settled). After the planned rounds, a reading whose
reference departs from its median by more than the noise floor (NOISE_FLOOR_SIGMAS robust standard
deviations of the references' own readings) marks the machine as disturbed then: the measurements
between it and its neighbouring readings are measured again, and their old calls kept in the samples
but `superseded`. Then a point whose rounds still disagree (fewer than `rounds` of them within the
floor of their median) gets an extra round. Passes repeat until nothing is left, at most
MAX_REMEASURE_ROUNDS grid-sizes of measurements in all (the settings' remeasure_rounds where given: the
carry-over check's), so a disturbed minute costs about a minute's measurements and the profile always
ends. The speed band (speed summary) leaves out disturbed readings that no kept measurement sits next to.

points CSV, one row per grid point:
    point_id, kind, batch, prompt_len (new tokens per sequence), cached (tokens of the longest sequence
    already in the KV cache), median_s (see above), round_min_s, round_max_s, spread_pct (100 x
    (max - min) / median of the per-round medians), raw_median_s, raw_spread_pct (the same without
    normalising), p10_s, p90_s, mean_s, min_s (over every normalised call), n_repeats (timed calls),
    n_rounds, flops, bytes (the work the call cannot avoid, servingplan.roofline.call_work), floor_mem_s
    (bytes / peak bandwidth), floor_compute_s (flops / peak GEMM rate), floor_s (the larger), bound,
    efficiency (floor_s / median_s), cpu_share
    (median over its calls of the CPU time the process got over threads x wall time: well below 1 means
    other load competed for the cores), n_remeasured (rounds measured again after a disturbance),
    n_extra_rounds (rounds beyond `rounds`, given because its rounds disagreed); every value over the
    calls not superseded
samples CSV, one row per timed call: point_id, kind, batch, prompt_len, cached, round, repeat, t_s
    (seconds since the profile started, at the call's middle), seconds, speed (the reference's relative
    speed then), normalized_s (seconds / speed), cpu_share, remeasure_pass (0 for the planned rounds),
    superseded (a later pass measured this point's round again: left out of every value)
meta JSON: machine, roofline (the peak bandwidth and GEMM rate over every reading of the probes: at the
    start, before each later round and at the end, the GEMM on the model's own products; see
    machine.peak_roofline), model, memory (param bytes,
    KV bytes per token measured and expected, peak RSS), the settings used, the speed trace and its
    summary (`speed`; the trace's readings carry `reading`, `departure`, `disturbed`, `in_band`), what
    was measured again (`remeasure`, see remeasure_summary), the rounds' spread before and after
    normalising, load averages, and wall_time_s.
"""
from __future__ import annotations

import gc
import os
import random
import resource
import sys
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
import psutil
import torch
from tqdm import tqdm

from servingplan import roofline as work_model
from servingplan.device import model_device, wait_for
from servingplan.io import write_csv, write_json
from servingplan.pipeline import terminal
from servingplan.profile import machine
from servingplan.profile.grid import CACHED_PREFILL_POINTS, ragged_contexts
from servingplan.profile.kvpool import KVPool, configure_allocator, decode_step, prefill_call, prefill_step
from servingplan.profile.model import QUICK_CONFIG_OVERRIDES, RANDOM_SOURCE, load_model

BATCHED_PREFILL_LEN = 128
KV_PROBE_TOKENS = 16
FLOAT32_BYTES = 4
# A speed trace that moved more than this (max - min over median, either reference) is flagged.
SPEED_MOVED_WARNING = 0.10
REFERENCE_KINDS = {"prefill": "prefill", "prefill_batch": "prefill", "prefill_cached": "prefill",
                   "decode": "decode"}
# Re-measurement. The noise floor of a reference is NOISE_FLOOR_SIGMAS robust standard deviations of
# its readings' log time around their median (1.4826 x the median absolute deviation: the references'
# own quiet spread, which a disturbance of less than half the run cannot move), and never below
# MIN_NOISE_FLOOR (a few readings can agree by chance). A reading further from the median than that
# is disturbed; so is every measurement between it and its neighbouring readings.
NOISE_FLOOR_SIGMAS = 3.0
MAD_TO_SIGMA = 1.4826
MIN_NOISE_FLOOR = 0.05
# The extra work is bounded so the profile always ends: at most this many grid-sizes of point
# measurements re-measured or added, and at most this many extra rounds for any one point.
MAX_REMEASURE_ROUNDS = 2
MAX_EXTRA_ROUNDS_PER_POINT = 2

QUICK_PROFILE = {
    "warmup": 1, "rounds": 2, "repeats": 2, "reference_interval_s": 0.2,
    "reference_decode": [2, 16], "reference_prefill": 16,
    "prefill_lengths": [8, 16, 32, 64], "prefill_batches": [1, 2],
    "decode_batches": [1, 2, 4], "decode_contexts": [8, 32], "cached_prefill": [(8, 16), (16, 16)],
    "probe_bytes": 8 * 2**20, "gemm_size": 128,
}


def cache_bytes(cache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


@dataclass(frozen=True)
class GridPoint:
    kind: str
    batch: int
    prompt_len: int
    cached: int


def build_grid(settings: dict) -> list[GridPoint]:
    grid = [GridPoint("prefill", 1, length, 0) for length in settings["prefill_lengths"]]
    grid += [GridPoint("prefill_batch", batch, BATCHED_PREFILL_LEN, 0) for batch in settings["prefill_batches"]]
    grid += [GridPoint("prefill_cached", 1, chunk, cached)
             for chunk, cached in settings.get("cached_prefill", CACHED_PREFILL_POINTS)]
    grid += [GridPoint("decode", batch, 1, context)
             for batch in settings["decode_batches"] for context in settings["decode_contexts"]]
    return grid


def reference_points(settings: dict) -> dict[str, GridPoint]:
    """The two shapes re-timed throughout the run to trace the machine's speed."""
    batch, context = settings["reference_decode"]
    return {"decode": GridPoint("decode", int(batch), 1, int(context)),
            "prefill": GridPoint("prefill", 1, int(settings["reference_prefill"]), 0)}


def decode_lengths(batch: int, context: int) -> torch.Tensor:
    """servingplan.profile.grid.ragged_contexts as a tensor."""
    return torch.tensor(ragged_contexts(batch, context))


def pool_for(config, points: list[GridPoint], generator: torch.Generator,
             device: torch.device | str = "cpu") -> KVPool:
    """One engine KV pool on `device` large enough for every point, holding random entries (their
    values do not change the cost); built once, since filling gigabytes per point would take longer
    than timing it."""
    slots = max([p.batch for p in points if p.kind == "decode"], default=1)
    capacity = max(p.cached + p.prompt_len for p in points)
    pool = KVPool(config, slots, capacity, device)
    head_dim = config.n_embd // config.n_head
    block = torch.randn(config.n_head, capacity, head_dim, generator=generator)
    for tensor in (pool.keys, pool.values):
        tensor.copy_(block.expand_as(tensor))
    return pool


def point_call(model, pool: KVPool, point: GridPoint, generator: torch.Generator):
    """The timed call of one grid point; every call sees the same shapes (the step functions write
    each call's new entries at the same positions, so nothing needs resetting). Like the step functions
    it returns once the device has done the work."""
    input_ids = torch.randint(model.config.vocab_size, (point.batch, point.prompt_len),
                              generator=generator).to(pool.device)
    if point.kind == "decode":
        lengths = decode_lengths(point.batch, point.cached)
        return lambda: decode_step(model, pool, lengths, input_ids)
    if point.kind == "prefill_batch":
        def batched_prefill():
            prefill_call(model, input_ids)
            wait_for(pool.device)
        return batched_prefill
    return lambda: prefill_step(model, pool, 0, input_ids, point.cached)


def time_call(call, warmup: int, repeats: int, clock_zero: float) -> list[tuple[float, float, float]]:
    """(t_s at the call's middle since clock_zero, seconds, CPU share) of each timed call; the CPU
    share is the CPU time the process got over threads x wall time, well below one when other load
    competed for the cores."""
    for _ in range(warmup):
        call()
    threads = torch.get_num_threads()
    timed = []
    for _ in range(repeats):
        cpu_start = time.process_time()
        start = time.perf_counter()
        call()
        elapsed = time.perf_counter() - start
        timed.append((start + elapsed / 2 - clock_zero, elapsed,
                      (time.process_time() - cpu_start) / (elapsed * threads)))
    return timed


def relative_speed(trace: pd.DataFrame, kind: str, times) -> np.ndarray:
    """The reference's time at `times` (interpolated along the trace, held at its ends) over the
    reference's median time in the run (over its quiet readings when the trace marks `disturbed` ones):
    1.2 means calls then took 20% longer than typical."""
    rows = trace[trace["kind"] == kind].sort_values("t_s")
    if rows.empty:
        return np.ones(len(np.atleast_1d(times)))
    seconds = rows["seconds"].to_numpy(float)
    quiet = seconds[~rows["disturbed"].to_numpy(bool)] if "disturbed" in rows else seconds
    typical = np.median(quiet if len(quiet) else seconds)
    return np.interp(np.asarray(times, float), rows["t_s"].to_numpy(float), seconds) / typical


def normalise(samples: pd.DataFrame, trace: pd.DataFrame) -> pd.DataFrame:
    """samples with `speed` and `normalized_s` (seconds over the speed of its reference kind then)."""
    speed = np.ones(len(samples))
    for kind, reference in REFERENCE_KINDS.items():
        rows = (samples["kind"] == kind).to_numpy()
        if rows.any():
            speed[rows] = relative_speed(trace, reference, samples.loc[rows, "t_s"])
    return samples.assign(speed=speed, normalized_s=samples["seconds"].to_numpy(float) / speed)


def noise_floors(trace: pd.DataFrame) -> dict[str, float]:
    """Each reference's noise floor, as a departure of log time from its median (see
    NOISE_FLOOR_SIGMAS): 0.3 lets a quiet reading take up to e^0.3 = 1.35 times the median."""
    return {str(kind): float(max(MIN_NOISE_FLOOR, NOISE_FLOOR_SIGMAS * log_sigma(rows["seconds"])))
            for kind, rows in trace.groupby("kind")}


def log_sigma(seconds) -> float:
    """The robust standard deviation of log time: MAD_TO_SIGMA x the median absolute deviation."""
    logs = np.log(np.asarray(seconds, float))
    return float(MAD_TO_SIGMA * np.median(np.abs(logs - np.median(logs))))


def mark_disturbed(trace: pd.DataFrame) -> pd.DataFrame:
    """The trace with `departure` (log of each reading's time over its reference's median) and
    `disturbed`: every row of a reading (one `reading` index: both references timed back to back) in
    which either reference departs by more than its noise floor."""
    floors = noise_floors(trace)
    departure = np.log(trace["seconds"] / trace.groupby("kind")["seconds"].transform("median"))
    beyond = departure.abs() > trace["kind"].map(floors)
    disturbed = beyond.groupby(trace["reading"]).transform("any")
    return trace.assign(departure=departure, disturbed=disturbed.astype(bool))


def measurement_brackets(samples: pd.DataFrame, trace: pd.DataFrame) -> pd.DataFrame:
    """One row per (point_id, round) of `samples`: its kind, the readings just before and just after its
    calls (`before`, `after`: reading indexes, -1 where there is none) and `disturbed`, whether either
    of them is. `trace` is mark_disturbed's."""
    readings = trace.groupby("reading").agg(t_s=("t_s", "mean"), disturbed=("disturbed", "any")).sort_values("t_s")
    spans = samples.groupby(["point_id", "round"]).agg(kind=("kind", "first"), start=("t_s", "min"),
                                                      end=("t_s", "max")).reset_index()
    times = readings["t_s"].to_numpy(float)
    flags = readings["disturbed"].to_numpy(bool)
    index = readings.index.to_numpy(int)
    before = np.searchsorted(times, spans["start"].to_numpy(float), side="right") - 1
    after = np.searchsorted(times, spans["end"].to_numpy(float), side="left")

    def at(positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(reading index, disturbed) at each position of the sorted readings; (-1, False) off its ends."""
        valid = (positions >= 0) & (positions < len(times))
        clipped = np.clip(positions, 0, max(len(times) - 1, 0))
        if not len(times):
            return np.full(len(positions), -1), np.zeros(len(positions), dtype=bool)
        return np.where(valid, index[clipped], -1), valid & flags[clipped]

    (before_reading, before_disturbed), (after_reading, after_disturbed) = at(before), at(after)
    return spans.assign(before=before_reading, after=after_reading, disturbed=before_disturbed | after_disturbed)


def unsettled_points(samples: pd.DataFrame, floors: dict, planned_rounds: int) -> list[int]:
    """Points whose rounds disagree: fewer than `planned_rounds` of their rounds' medians (of
    normalised calls) lie within their reference's noise floor of the median over rounds, and fewer than
    MAX_EXTRA_ROUNDS_PER_POINT extra rounds given already."""
    per_round = samples.groupby(["point_id", "round"]).agg(kind=("kind", "first"), value=("normalized_s", "median"))
    unsettled = []
    for point_id, rows in per_round.groupby(level="point_id"):
        values = rows["value"].to_numpy(float)
        floor = floors.get(REFERENCE_KINDS[rows["kind"].iloc[0]], MIN_NOISE_FLOOR)
        agreeing = int((np.abs(np.log(values / np.median(values))) <= floor).sum())
        if agreeing < planned_rounds and len(values) - planned_rounds < MAX_EXTRA_ROUNDS_PER_POINT:
            unsettled.append(int(point_id))
    return unsettled


@dataclass
class RemeasurePlan:
    """What the next re-measure pass measures: `replace`, (point_id, round) measurements next to a
    disturbed reading, measured again in place of the old calls; `extra`, a new round for each unsettled
    point; and what the budget leaves undone."""
    replace: list
    extra: list
    disturbed_left: list
    unsettled_left: list
    floors: dict

    @property
    def tasks(self) -> list:
        return self.replace + self.extra


def plan_remeasure(samples: pd.DataFrame, trace: pd.DataFrame, planned_rounds: int, budget: int) -> RemeasurePlan:
    """The next re-measure pass from what has been measured so far: `samples` (point_id, kind, round,
    t_s, seconds and `superseded`, true for calls a later pass replaced) and the speed trace (t_s, kind,
    seconds, reading). Disturbed measurements come first, in time order; then one extra round for each
    point whose rounds disagree (among points with no disturbed measurement left: its rounds are
    judged once they are all quiet); at most `budget` in all."""
    trace = mark_disturbed(trace)
    floors = noise_floors(trace)
    kept = normalise(samples[~samples["superseded"].to_numpy(bool)], trace)
    brackets = measurement_brackets(kept, trace)
    disturbed = brackets[brackets["disturbed"]].sort_values("start")
    pending = [(int(p), int(r)) for p, r in zip(disturbed["point_id"], disturbed["round"])]
    replace = pending[:max(budget, 0)]
    judged = kept[~kept["point_id"].isin(disturbed["point_id"])]
    unsettled = unsettled_points(judged, floors, planned_rounds)
    next_round = kept.groupby("point_id")["round"].max()
    extras = [(point_id, int(next_round[point_id]) + 1) for point_id in unsettled]
    room = max(budget - len(replace), 0)
    return RemeasurePlan(replace, extras[:room], pending[len(replace):], extras[room:], floors)


def remeasure_until_settled(sample_rows: list[dict], trace, record, planned_rounds: int, budget: int,
                            measure_pass, order, clock) -> tuple[RemeasurePlan, list[dict]]:
    """Re-measure passes after the planned rounds, until a plan is empty: each pass marks the calls it
    replaces `superseded` in `sample_rows`, measures its tasks (`measure_pass(tasks in order(tasks),
    pass number)` appends their calls to sample_rows) and re-times the references (`record()`), so the
    last measurements are bracketed. `trace()` gives the speed trace so far. Each pass spends its tasks
    from `budget`, so the loop ends. Returns the final (empty) plan, which says what the budget left
    undone, and each pass's record."""
    passes = []
    while True:
        plan = plan_remeasure(pd.DataFrame(sample_rows), trace(), planned_rounds, budget)
        if not plan.tasks:
            return plan, passes
        replaced = set(plan.replace)
        for row in sample_rows:
            if (row["point_id"], row["round"]) in replaced:
                row["superseded"] = True
        passes.append({"pass": len(passes) + 1, "t_s": clock(),
                       "remeasured": [list(task) for task in plan.replace],
                       "extra_rounds": [list(task) for task in plan.extra]})
        measure_pass(order(plan.tasks), len(passes))
        record()
        budget -= len(plan.tasks)


def speed_summary(trace: pd.DataFrame) -> dict:
    """How far the machine's speed moved during the run, per reference and overall: the range of the
    relative speed (min and max over the median) and moved_pct = 100 x (max - min) / median. Over the
    readings `in_band` when the trace marks them (the quiet ones, and any disturbed one next to a
    measurement the profile kept); all_readings_moved_pct counts every reading."""
    band = trace[trace["in_band"].to_numpy(bool)] if "in_band" in trace else trace
    kinds = {}
    for kind in sorted(band["kind"].unique()):
        seconds = band.loc[band["kind"] == kind, "seconds"].to_numpy(float)
        median = float(np.median(seconds))
        kinds[kind] = {"n": int(len(seconds)), "median_s": median,
                       "relative_min": float(seconds.min() / median), "relative_max": float(seconds.max() / median),
                       "moved_pct": float(100.0 * (seconds.max() - seconds.min()) / median)}
    moved = max((k["moved_pct"] for k in kinds.values()), default=0.0)
    every = [100.0 * (rows["seconds"].max() - rows["seconds"].min()) / rows["seconds"].median()
             for _, rows in trace.groupby("kind")]
    span = float(trace["t_s"].max() - trace["t_s"].min()) if len(trace) else 0.0
    return {"by_kind": kinds, "moved_pct": moved, "moved_more_than_10pct": bool(moved > 100 * SPEED_MOVED_WARNING),
            "warning_threshold_pct": 100 * SPEED_MOVED_WARNING, "span_s": span,
            "all_readings_moved_pct": float(max(every, default=0.0)),
            "n_readings_out_of_band": int(len(trace) - len(band))}


def round_spread(values: pd.Series) -> float:
    return float(100.0 * (values.max() - values.min()) / values.median()) if len(values) > 1 else 0.0


def measured_kv_bytes_per_token(model) -> float:
    """KV bytes one token adds, read off the cache a real prefill builds."""
    input_ids = torch.zeros(1, KV_PROBE_TOKENS, dtype=torch.long, device=model_device(model))
    return cache_bytes(prefill_call(model, input_ids).past_key_values) / KV_PROBE_TOKENS


def peak_rss_bytes() -> int:
    # ru_maxrss is KiB on Linux, bytes on macOS.
    scale = 1 if sys.platform == "darwin" else 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


@dataclass
class Profile:
    points: pd.DataFrame
    samples: pd.DataFrame
    meta: dict

    def write(self, points_csv, samples_csv, meta_json) -> None:
        write_csv(points_csv, self.points)
        write_csv(samples_csv, self.samples)
        write_json(meta_json, self.meta)


def profile_settings(profile_cfg: dict, quick: bool) -> dict:
    return {**profile_cfg, **QUICK_PROFILE} if quick else dict(profile_cfg)


def time_references(calls: dict, settings: dict, clock_zero: float) -> list[dict]:
    """One reading of each reference: {t_s, kind, seconds}, the median of `repeats` timed calls after
    `warmup` untimed ones. The profiler's speed trace and validation's re-timings both read this way,
    so a ratio between them measures the machine, not the method."""
    rows = []
    for kind, call in calls.items():
        timed = time_call(call, settings["warmup"], settings["repeats"], clock_zero)
        rows.append({"t_s": float(np.median([t for t, _, _ in timed])), "kind": kind,
                     "seconds": float(np.median([s for _, s, _ in timed]))})
    return rows


class SpeedTracer:
    """Re-times the reference shapes whenever `interval_s` has passed since it last did."""

    def __init__(self, calls: dict, settings: dict, clock_zero: float):
        self.calls, self.settings, self.clock_zero = calls, settings, clock_zero
        self.rows: list[dict] = []
        self.readings = 0
        self.last = -np.inf

    def due(self) -> bool:
        return time.perf_counter() - self.last >= self.settings["reference_interval_s"]

    def record(self) -> None:
        self.rows += [{**row, "reading": self.readings}
                      for row in time_references(self.calls, self.settings, self.clock_zero)]
        self.readings += 1
        self.last = time.perf_counter()

    def frame(self) -> pd.DataFrame:
        return pd.DataFrame(self.rows, columns=["t_s", "kind", "seconds", "reading"])


class WindowReadings:
    """The carry-over check's reference shapes read in this profile's window, at the check's threads and
    with its estimator (`check`: threads, reference_decode, reference_prefill, warmup, repeats;
    servingplan.profile.grid.check_references): the check's 1-thread profile runs minutes later, when the
    machine may run tens of percent faster or slower, and the same readings in both windows measure by
    how much (servingplan.check.carry_check.window_correction). Read before each round and at the end,
    between measurements, then the profile's own threads are restored."""

    def __init__(self, check: dict, threads: int, calls: dict, clock_zero: float):
        self.check, self.threads, self.calls, self.clock_zero = check, threads, calls, clock_zero
        self.rows: list[dict] = []

    def record(self, label: str) -> None:
        torch.set_num_threads(int(self.check["threads"]))
        try:
            self.rows += [{**row, "label": label} for row in time_references(self.calls, self.check, self.clock_zero)]
        finally:
            torch.set_num_threads(self.threads)

    def summary(self) -> dict:
        """machine.json's `check_references`: the shapes and estimator, every reading, and per kind the
        readings' median and their robust spread (log_sigma)."""
        by_kind = {}
        for kind in sorted({row["kind"] for row in self.rows}):
            seconds = [row["seconds"] for row in self.rows if row["kind"] == kind]
            by_kind[kind] = {"n": len(seconds), "median_s": float(np.median(seconds)), "log_sigma": log_sigma(seconds)}
        return {**self.check, "readings": self.rows, "by_kind": by_kind}


def run_profile(profile_cfg: dict, model_cfg: dict, seed: int, quick: bool = False,
                threads: int | None = None, progress: bool = True) -> Profile:
    """Profile the model of `model_cfg` over the grid of `profile_cfg`; `quick` swaps in QUICK_PROFILE's
    grid and the tiny random model, model_cfg["tiny"] the tiny model alone. `threads` overrides
    profile_cfg["threads"]; 0/None there means all cores."""
    started = time.perf_counter()
    load_at_start = os.getloadavg()
    if model_cfg.get("dtype", "float32") != "float32":
        raise ValueError(f"model dtype {model_cfg['dtype']!r}: only float32 is supported")
    settings = profile_settings(profile_cfg, quick)
    allocator = configure_allocator()
    threads = machine.configure_threads(threads or settings.get("threads"))
    tiny = quick or model_cfg.get("tiny", False)
    source = RANDOM_SOURCE if tiny else model_cfg["source"]
    device = model_cfg.get("device", "cpu")
    model, model_meta = load_model(source, seed, QUICK_CONFIG_OVERRIDES if tiny else None, device)
    rss_after_load = psutil.Process().memory_info().rss
    arch = work_model.architecture_of(model_meta)
    gemm_shapes = work_model.gemm_shapes(arch, max(settings["decode_batches"]), max(settings["prefill_lengths"]))

    def read_probes(label: str) -> dict:
        reading = machine.roofline_probes(settings["probe_bytes"], settings["gemm_size"], device, gemm_shapes)
        return {"label": label, "t_s": time.perf_counter() - started, **reading}

    # the peaks are read through the run, beside the speed trace: the machine is at its fastest only
    # some of the time, and the roofline is the fastest it went
    probe_readings = [read_probes("start")]
    kv_bytes_per_token = measured_kv_bytes_per_token(model)

    grid = build_grid(settings)
    references = reference_points(settings)
    generator = torch.Generator().manual_seed(seed)
    shuffler = random.Random(seed)
    check_points = reference_points(settings["check_references"]) if settings.get("check_references") else {}
    pool = pool_for(model.config, grid + list(references.values()) + list(check_points.values()), generator, device)
    calls = [point_call(model, pool, point, generator) for point in grid]
    tracer = SpeedTracer({kind: point_call(model, pool, point, generator) for kind, point in references.items()},
                         settings, started)
    window = WindowReadings(settings["check_references"], threads,
                            {kind: point_call(model, pool, point, generator) for kind, point in check_points.items()},
                            started) if check_points else None
    # Everything alive now (torch, transformers, the model: some 400,000 objects) stays alive for the
    # run: frozen out of the collector, the collection before each point (so no collection lands in a
    # timed call) costs microseconds instead of the 0.2 s of CPU a full sweep of them takes, 264 times.
    gc.collect()
    gc.freeze()
    sample_rows: list[dict] = []
    rounds = settings["rounds"]
    # the carry-over check's thinned profile asks for a smaller budget (servingplan/profile/grid.py);
    # the config's profile has no such key
    budget_rounds = settings.get("remeasure_rounds", MAX_REMEASURE_ROUNDS)

    def measure(tasks: list[tuple[int, int]], remeasure_pass: int, bar) -> None:
        """Time each (point_id, round) of `tasks` in order, re-timing the references when due."""
        for point_id, round_number in tasks:
            if tracer.due():
                tracer.record()
            point = grid[point_id]
            bar.set_postfix_str(f"round {round_number + 1}/{rounds} {point.kind} B={point.batch} "
                                f"L={point.prompt_len} cached={point.cached}", refresh=False)
            gc.collect()
            timed = time_call(calls[point_id], settings["warmup"], settings["repeats"], started)
            sample_rows.extend({"point_id": point_id, "kind": point.kind, "batch": point.batch,
                                "prompt_len": point.prompt_len, "cached": point.cached, "round": round_number,
                                "repeat": repeat, "t_s": t_s, "seconds": seconds, "cpu_share": share,
                                "remeasure_pass": remeasure_pass, "superseded": False}
                               for repeat, (t_s, seconds, share) in enumerate(timed))
            bar.update()

    def measure_pass(tasks: list[tuple[int, int]], remeasure_pass: int) -> None:
        bar.total += len(tasks)
        measure(tasks, remeasure_pass, bar)

    with torch.inference_mode(), tqdm(total=rounds * len(grid), desc="profile", unit="pt", file=terminal(),
                                      disable=not progress, mininterval=5.0) as bar:
        for round_number in range(rounds):
            if round_number:
                probe_readings.append(read_probes(f"before round {round_number + 1}"))
            if window:
                window.record(f"before round {round_number + 1}")
            # A shuffled order per round turns slow drifts of the machine into noise spread over the
            # grid instead of a trend along one axis that the fit would mistake for cost.
            measure([(point_id, round_number) for point_id in shuffler.sample(range(len(grid)), len(grid))], 0, bar)
        tracer.record()
        plan, passes = remeasure_until_settled(sample_rows, tracer.frame, tracer.record, rounds,
                                               budget_rounds * len(grid), measure_pass,
                                               lambda tasks: shuffler.sample(tasks, len(tasks)),
                                               lambda: time.perf_counter() - started)
        if window:
            window.record("end")
    gc.unfreeze()
    probe_readings.append(read_probes("end"))
    roofline = machine.peak_roofline(probe_readings)

    points, all_samples, trace, brackets = settled_points(sample_rows, tracer.frame(), grid, arch, roofline, rounds)
    remeasure = remeasure_summary(plan, passes, trace, brackets, rounds, len(grid), budget_rounds)
    expected_kv = 2 * model_meta["n_layer"] * model_meta["n_embd"] * FLOAT32_BYTES
    meta = {
        "machine": machine.describe_machine(threads, device),
        "roofline": roofline,
        "model": model_meta,
        "memory": {
            "param_bytes": model_meta["param_bytes"],
            "kv_bytes_per_token": kv_bytes_per_token,
            "kv_bytes_per_token_expected": expected_kv,
            "rss_after_load_bytes": rss_after_load,
            "peak_rss_bytes": peak_rss_bytes(),
        },
        "settings": {**settings, "quick": quick, "tiny": tiny, "seed": seed, "threads": threads, "device": device,
                     "cached_prefill": [list(p) for p in settings.get("cached_prefill", CACHED_PREFILL_POINTS)],
                     "batched_prefill_len": BATCHED_PREFILL_LEN,
                     "references": {kind: vars(point) for kind, point in references.items()}},
        "n_points": len(grid),
        "speed": {**speed_summary(trace), "trace": trace.to_dict("records")},
        "remeasure": remeasure,
        "rounds": {"n": rounds,
                   "median_spread_pct": float(points["spread_pct"].median()),
                   "median_raw_spread_pct": float(points["raw_spread_pct"].median())},
        **({"check_references": window.summary()} if window else {}),
        "allocator": allocator,
        "load_average": {"start": load_at_start, "end": os.getloadavg()},
        "cpu_share": {"min": float(points["cpu_share"].min()), "median": float(points["cpu_share"].median())},
        "wall_time_s": time.perf_counter() - started,
    }
    return Profile(points, all_samples, meta)


def settled_points(sample_rows: list[dict], trace: pd.DataFrame, grid: list[GridPoint], arch: dict, roofline: dict,
                   planned_rounds: int) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """A finished profile's (points, every call normalised, speed trace, measurement brackets): the trace's
    disturbed readings marked and its speed band chosen, every call normalised by it, and one row per grid
    point over the calls no re-measurement superseded. The torch and the llama.cpp profilers both end here."""
    all_samples = pd.DataFrame(sample_rows)
    trace = mark_disturbed(trace)
    brackets = measurement_brackets(all_samples[~all_samples["superseded"]], trace)
    # a disturbed reading still next to a kept measurement (the budget ran out) stays in the speed band
    kept_next_to = set(brackets.loc[brackets["disturbed"], ["before", "after"]].to_numpy().ravel())
    trace = trace.assign(in_band=~trace["disturbed"] | trace["reading"].isin(kept_next_to))
    all_samples = normalise(all_samples, trace)
    samples = all_samples[~all_samples["superseded"]]
    points = pd.DataFrame([_point_row(point_id, point, samples[samples["point_id"] == point_id], arch, roofline,
                                      all_samples[all_samples["point_id"] == point_id], planned_rounds)
                           for point_id, point in enumerate(grid)])
    return points, all_samples, trace, brackets


def remeasure_summary(plan: RemeasurePlan, passes: list, trace: pd.DataFrame, brackets: pd.DataFrame,
                      planned_rounds: int, n_points: int, budget_rounds: int) -> dict:
    """machine.json's `remeasure`: the rule, each reference's noise floor, the disturbed readings, each
    pass (the (point_id, round) measured again and the extra rounds given), totals, and what the budget
    left undone (disturbed measurements kept, points whose rounds still disagree)."""
    disturbed = trace[trace["disturbed"]]
    return {
        "rule": (f"a reading is disturbed when a reference's time departs from its median by more than "
                 f"{NOISE_FLOOR_SIGMAS:g} x {MAD_TO_SIGMA} x the median absolute deviation of its readings' log "
                 f"time (at least {MIN_NOISE_FLOOR:g}); the measurements next to it are measured again; a point "
                 f"gets another round while fewer than {planned_rounds} of its rounds agree within that floor "
                 f"(at most {MAX_EXTRA_ROUNDS_PER_POINT} extra); at most {budget_rounds} x {n_points} "
                 f"measurements in all"),
        "noise_floor": plan.floors,
        "noise_floor_pct": {kind: float(100.0 * (np.exp(floor) - 1.0)) for kind, floor in plan.floors.items()},
        "disturbed_readings": sorted(int(r) for r in disturbed["reading"].unique()),
        "disturbed_max_departure_pct": float(100.0 * (np.exp(disturbed["departure"].abs().max()) - 1.0))
                                       if len(disturbed) else 0.0,
        "passes": passes,
        "n_remeasured": sum(len(p["remeasured"]) for p in passes),
        "n_extra_rounds": sum(len(p["extra_rounds"]) for p in passes),
        "budget": budget_rounds * n_points,
        "budget_exhausted": bool(plan.disturbed_left or plan.unsettled_left),
        "disturbed_kept": int(brackets["disturbed"].sum()),
        "unsettled_left": [int(point_id) for point_id, _ in plan.unsettled_left],
    }


def _point_row(point_id, point, samples, arch, roofline, every_sample, planned_rounds) -> dict:
    work = work_model.call_work(arch, point.kind, point.batch, point.prompt_len, point.cached)
    flops, bytes_read = work.flops, work.bytes
    floor_mem = bytes_read / (roofline["bandwidth_gbs"] * 1e9)
    floor_compute = flops / (roofline["gemm_gflops"] * 1e9)
    per_round = samples.groupby("round")["normalized_s"].median()
    raw_per_round = samples.groupby("round")["seconds"].median()
    normalized = samples["normalized_s"].to_numpy(float)
    median = float(per_round.median())
    return {
        "point_id": point_id, "kind": point.kind, "batch": point.batch,
        "prompt_len": point.prompt_len, "cached": point.cached,
        "median_s": median, "round_min_s": float(per_round.min()), "round_max_s": float(per_round.max()),
        "spread_pct": round_spread(per_round), "raw_median_s": float(raw_per_round.median()),
        "raw_spread_pct": round_spread(raw_per_round),
        "p10_s": float(np.percentile(normalized, 10)), "p90_s": float(np.percentile(normalized, 90)),
        "mean_s": float(normalized.mean()), "min_s": float(normalized.min()), "n_repeats": len(normalized),
        "n_rounds": int(per_round.size), "flops": flops, "bytes": bytes_read,
        "floor_mem_s": floor_mem, "floor_compute_s": floor_compute, "floor_s": max(floor_mem, floor_compute),
        "bound": "memory" if floor_mem >= floor_compute else "compute",
        "efficiency": max(floor_mem, floor_compute) / median,
        "cpu_share": float(samples["cpu_share"].median()),
        "n_remeasured": int(every_sample.loc[every_sample["superseded"], "round"].nunique()),
        "n_extra_rounds": int(max(per_round.size - planned_rounds, 0)),
    }
