"""Profile llama.cpp's steps on this machine into the files the torch profiler writes
(servingplan.profile.measure: points CSV, samples CSV, meta JSON), so servingplan.fit.step_model fits
them unchanged.

    run_llamacpp_profile(gguf, profile_cfg, llamacpp_cfg, seed, tiny=False, progress=True) -> Profile

Every call is timed by llama-batched-bench (the pinned build), one process per measurement, on the
converted GGUF with the threads, n_batch and n_ubatch llama-server runs with, and a float32 KV cache
(`-ctk f32 -ctv f32`: the model is float32, and the roofline floors the fit holds its terms to count
float32 KV bytes). The grid, the rounds in shuffled order, the speed trace, the re-measuring of
disturbed or disagreeing measurements, the roofline probes and every per-point statistic are
measure.py's own; what differs is the timed call:

    prefill   one sequence of prompt_len tokens, nothing cached: `-npp L,L,... -ntg 1 -npl 1`, one
              tool row per call (t_pp, the prompt's llama_decode alone); the first `warmup` rows are
              dropped, the next `repeats` are the calls.
    prefill_cached
              a chunk of prompt_len = C tokens after `cached` = P tokens of the same prompt, as a
              llama-server slot runs a prompt split across steps (`-b` below the prompt). The tool
              clears the KV cache before every prompt, but it decodes a prompt in views of n_batch
              tokens (batched-bench.cpp, decode_helper), so at `-b C` a prompt of P + C tokens is
              the chunks at 0, C, ..., P, its last the call, when P is a whole number of chunks.
              The run alternates prompts of P and P + C tokens (`-npp P,P+C,P,P+C,... -b C`, -ub at
              most C), and each pair's difference of t_pp is one call: a difference of two readings
              taken seconds apart, so the machine's drift cancels. The first `warmup` pairs are
              dropped.
    decode    batch B, each sequence holding `cached` = T tokens: `-npp T -ntg R -npl B -pps`, the
              prompt prefilled once and copied to the B sequences (untimed), then R decode steps of B
              tokens; the call is one step, t_tg / R (the tool times the R steps together; contexts
              T to T + R - 1, R = warmup + repeats). The KV cache is split per sequence (no -kvu), as
              llama-server runs it. A step reads B times the longest context, not the sum of the
              contexts: with a float32 KV cache, flash attention first casts each sequence's K and V
              views to float16, and every view spans the KV cells up to the longest sequence's (a cast
              of cells the kernel then skips as masked). So the profile says settings.ctx_mode
              "padded_max", which the fit writes; its decode points hold B sequences of one context T,
              where B * T is what either mode reads.

measure.py's batched prefill is not measured: a batched prefill of several prompts is what a
llama-server step of several prefilling slots is, which the fit does not model.

The speed references are one prefill and one decode shape (profile.reference_prefill,
profile.reference_decode), re-timed with the same tool every reference_interval_s; a call's time is
normalised by that trace exactly as measure.py normalises. The meta's `model` is the torch model's
metadata (the same seeded weights the GGUF was converted from), `memory` the float32 KV arithmetic
(llama.cpp allocates its cache itself: nothing to read it from) and the largest tool process's peak
resident memory.
"""
from __future__ import annotations

import json
import math
import os
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from servingplan import roofline as work_model
from servingplan.llamacpp import build
from servingplan.pipeline import terminal
from servingplan.profile import machine
from servingplan.profile.measure import (FLOAT32_BYTES, MAX_REMEASURE_ROUNDS, QUICK_PROFILE, GridPoint, Profile,
                                         SpeedTracer, build_grid, reference_points, remeasure_summary,
                                         remeasure_until_settled, settled_points, speed_summary)

MEASURED_KINDS = ("prefill", "prefill_cached", "decode")
CTX_MODE = "padded_max"
# a tool run that takes longer than this is stuck (the largest default point takes a few seconds)
BENCH_TIMEOUT_S = 600.0
# runs of one measurement whose output lost rows (see run_bench) before the measurement fails, and the
# pause before the n-th rerun (n x this): on a busy machine losses come in spells (the tiny test model,
# 2 cores both busy: 3 of 40 runs lost rows, and once three runs in a row), so reruns are spread out
BENCH_ATTEMPTS = 8
BENCH_RETRY_PAUSE_S = 0.25
# KV cells llama.cpp pads its cache to; the context given to a run leaves room for it
KV_PAD = 256


class BenchError(ValueError):
    """llama-batched-bench failed or printed what it should not: one line saying which run and why."""


class MissingRows(BenchError):
    """The tool's output lacks result rows (see run_bench)."""


class UnorderedPair(BenchError):
    """A prefill_cached pair whose longer prompt did not take longer than its shorter one (see run_bench)."""


def pair_prompts(point: GridPoint) -> tuple[int, int]:
    """The two prompt lengths whose difference times a prefill_cached point: `cached`, then `cached` + the
    chunk. ValueError unless `cached` is a positive whole number of chunks (see the module docstring)."""
    if point.cached < point.prompt_len or point.cached % point.prompt_len:
        raise ValueError(f"llama.cpp profile: a chunk of {point.prompt_len} tokens after {point.cached} cached: "
                         f"the cached tokens must be a positive whole number of chunks")
    return point.cached, point.cached + point.prompt_len


def bench_command(point: GridPoint, calls: int, settings: dict, gguf: Path, binary: Path) -> list[str]:
    """The llama-batched-bench command that times `calls` calls of `point` (see the module docstring)."""
    n_batch, n_ubatch = int(settings["n_batch"]), int(settings["n_ubatch"])
    if point.kind == "prefill":
        context = point.prompt_len + 1
        shape = ["-npp", ",".join([str(point.prompt_len)] * calls), "-ntg", "1", "-npl", "1"]
    elif point.kind == "prefill_cached":
        shorter, longer = pair_prompts(point)
        n_batch, n_ubatch = point.prompt_len, min(point.prompt_len, n_ubatch)
        context = longer + 1
        shape = ["-npp", ",".join([f"{shorter},{longer}"] * calls), "-ntg", "1", "-npl", "1"]
    elif point.kind == "decode":
        context = point.batch * (point.cached + calls)
        shape = ["-npp", str(point.cached), "-ntg", str(calls), "-npl", str(point.batch), "-pps"]
    else:
        raise ValueError(f"llama.cpp profile: kind {point.kind!r} is not measured (measured: {', '.join(MEASURED_KINDS)})")
    return [str(binary), "-m", str(gguf), "-t", str(settings["threads"]), "-b", str(n_batch), "-ub", str(n_ubatch),
            "-ctk", "f32", "-ctv", "f32", "--output-format", "jsonl", "-c", str(context + KV_PAD)] + shape


def point_label(point: GridPoint) -> str:
    """How the tool's messages name a point."""
    return f"{point.kind} B={point.batch} L={point.prompt_len} cached={point.cached}"


def result_rows(point: GridPoint, calls: int) -> int:
    """The rows a run timing `calls` calls of `point` prints: a row per prompt (a pair of prompts per
    prefill_cached call), or one row for a decode run's steps."""
    return {"prefill": calls, "prefill_cached": 2 * calls}.get(point.kind, 1)


def row_prompts(point: GridPoint, rows: int) -> list[int]:
    """The pp of each of a run's `rows` result rows, in order."""
    if point.kind == "prefill":
        return [point.prompt_len] * rows
    if point.kind == "prefill_cached":
        return list(pair_prompts(point)) * (rows // 2)
    return [point.cached] * rows


def parse_bench_output(text: str, point: GridPoint, rows_expected: int) -> list[dict]:
    """The JSON rows llama-batched-bench printed (--output-format jsonl) for `point`, validated: exactly
    `rows_expected` rows of its shape, in order, each time finite and positive. BenchError (one line)
    otherwise."""
    where = f"llama-batched-bench at {point_label(point)}"
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise BenchError(f"{where}: output line {number} is not JSON ({exc.msg}): {line[:120]}") from None
        if not isinstance(row, dict):
            raise BenchError(f"{where}: output line {number} is not a JSON object: {line[:120]}")
        for key in ("pp", "tg", "pl", "t_pp", "t_tg"):
            value = row.get(key)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise BenchError(f"{where}: output line {number}: {key} = {value!r}, must be a finite number")
        rows.append(row)
    if len(rows) != rows_expected:
        raise MissingRows(f"{where}: {len(rows)} result rows, expected {rows_expected}")
    want_pl = point.batch if point.kind == "decode" else 1
    timed = "t_tg" if point.kind == "decode" else "t_pp"
    for row, want_pp in zip(rows, row_prompts(point, rows_expected)):
        if (row["pp"], row["pl"]) != (want_pp, want_pl):
            raise BenchError(f"{where}: a result row has pp={row['pp']} pl={row['pl']}, expected pp={want_pp} "
                             f"pl={want_pl}")
        if row[timed] <= 0:
            raise BenchError(f"{where}: {timed} = {row[timed]!r}, must be > 0")
    return rows


def call_seconds(rows: list[dict], point: GridPoint, warmup: int) -> list[float]:
    """Seconds of each timed call in a run's rows: a prefill's t_pp after the warm-up rows; a chunk after
    cached tokens, the t_pp of each pair's longer prompt less its shorter one's, after the warm-up pairs;
    a decode step, t_tg over the run's steps. UnorderedPair if a timed pair's difference is not positive."""
    if point.kind == "prefill":
        return [float(row["t_pp"]) for row in rows[warmup:]]
    if point.kind == "prefill_cached":
        pairs = list(zip(rows[0::2], rows[1::2]))[warmup:]
        chunks = [float(longer["t_pp"]) - float(shorter["t_pp"]) for shorter, longer in pairs]
        if min(chunks) <= 0:
            raise UnorderedPair(f"llama-batched-bench at {point_label(point)}: a prompt of "
                                f"{point.cached + point.prompt_len} tokens took no longer than one of {point.cached} "
                                f"({min(chunks):.3g} s)")
        return chunks
    return [float(row["t_tg"]) / float(row["tg"]) for row in rows]


def run_bench(point: GridPoint, settings: dict, gguf: Path, binary: Path) -> list[float]:
    """Run the tool for `point` and return the seconds of its timed calls. A run that exits cleanly with
    rows missing is run again, at most BENCH_ATTEMPTS times: the tool prints through llama.cpp's
    asynchronous logger, which can lose its last lines when the process exits before the logger's thread
    wrote them (common/log.cpp, common_log_main; llama.cpp issue 22142), more often on a busy machine.
    So is a prefill_cached run with a pair out of order: only a stall of the machine during the shorter
    prompt, longer than the chunk itself, gives one, and the profile re-measures disturbed readings anyway."""
    warmup, repeats = int(settings["warmup"]), int(settings["repeats"])
    calls = warmup + repeats
    command = bench_command(point, calls, settings, gguf, binary)
    where = point_label(point)
    rows_expected = result_rows(point, calls)
    for attempt in range(1, BENCH_ATTEMPTS + 1):
        try:
            done = subprocess.run(command, capture_output=True, text=True, env=build.env(), timeout=BENCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise BenchError(f"llama-batched-bench at {where}: no result within {BENCH_TIMEOUT_S:g} s") from None
        if done.returncode != 0:
            last = next((line for line in reversed(done.stderr.splitlines()) if line.strip()), "no message")
            raise BenchError(f"llama-batched-bench exited with {done.returncode} at {where}: {last.strip()}")
        try:
            return call_seconds(parse_bench_output(done.stdout, point, rows_expected), point, warmup)
        except (MissingRows, UnorderedPair):
            if attempt == BENCH_ATTEMPTS:
                raise
            pause_before_rerun(attempt)


def pause_before_rerun(attempt: int) -> None:
    time.sleep(BENCH_RETRY_PAUSE_S * attempt)


class BenchTracer(SpeedTracer):
    """measure.SpeedTracer's speed trace, each reference re-timed by a tool run: the call's time is the
    tool's own timing, not the wall clock around a Python call as time_references reads it."""

    def __init__(self, references: dict, settings: dict, clock_zero: float, timer):
        super().__init__(references, settings, clock_zero)
        self.timer = timer

    def record(self) -> None:
        for kind, point in self.calls.items():
            start = time.perf_counter()
            seconds = self.timer(point)
            middle = (start + time.perf_counter()) / 2 - self.clock_zero
            self.rows.append({"t_s": middle, "kind": kind, "seconds": float(np.median(seconds)),
                              "reading": self.readings})
        self.readings += 1
        self.last = time.perf_counter()


def profile_grid(settings: dict) -> list[GridPoint]:
    return [point for point in build_grid(settings) if point.kind in MEASURED_KINDS]


def model_metadata(seed: int, tiny: bool) -> dict:
    """The metadata of the torch model the GGUF was converted from (same seed, same shape)."""
    from servingplan.llamacpp.gguf_model import TINY_OVERRIDES
    from servingplan.profile.model import RANDOM_SOURCE, load_model
    model, meta = load_model(RANDOM_SOURCE, seed, TINY_OVERRIDES if tiny else None)
    del model
    return meta


def peak_child_rss_bytes() -> int:
    scale = 1 if sys.platform == "darwin" else 1024   # ru_maxrss is KiB on Linux
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * scale


def run_llamacpp_profile(gguf, profile_cfg: dict, llamacpp_cfg: dict, seed: int, tiny: bool = False,
                         progress: bool = True, binary: Path | None = None) -> Profile:
    """Profile llama.cpp on `gguf` over profile_cfg's grid (prefill and decode kinds) with
    llamacpp_cfg's threads, n_batch and n_ubatch; `tiny` says the GGUF is the tiny test model."""
    started = time.perf_counter()
    load_at_start = os.getloadavg()
    gguf = Path(gguf)
    binary = Path(binary or build.binary("llama-batched-bench"))
    threads = machine.resolve_threads(llamacpp_cfg.get("threads"))
    settings = {**profile_cfg, "threads": threads, "n_batch": int(llamacpp_cfg["n_batch"]),
                "n_ubatch": int(llamacpp_cfg["n_ubatch"])}
    if tiny:
        # the tiny model's positions hold the quick profile's chunks after cached tokens, not the default's
        settings.setdefault("cached_prefill", QUICK_PROFILE["cached_prefill"])
    model_meta = model_metadata(seed, tiny)
    grid = profile_grid(settings)
    chunks_after_cached = [point for point in grid if point.kind == "prefill_cached"]
    for point in chunks_after_cached:
        pair_prompts(point)   # refuses, before anything is timed, a point the tool cannot time
    longest = max((point.cached + point.prompt_len for point in chunks_after_cached), default=0)
    if longest > model_meta["n_positions"]:
        raise ValueError(f"llama.cpp profile: a chunk after cached tokens spans {longest} positions, the model has "
                         f"{model_meta['n_positions']}")
    arch = work_model.architecture_of(model_meta)
    gemm_shapes = work_model.gemm_shapes(arch, max(settings["decode_batches"]), max(settings["prefill_lengths"]))
    # the roofline probes run on torch at the tool's thread count: they read the machine, not the engine
    machine.configure_threads(threads)

    def read_probes(label: str) -> dict:
        reading = machine.roofline_probes(settings["probe_bytes"], settings["gemm_size"], "cpu", gemm_shapes)
        return {"label": label, "t_s": time.perf_counter() - started, **reading}

    probe_readings = [read_probes("start")]
    references = reference_points(settings)
    shuffler = random.Random(seed)

    def timer(point: GridPoint) -> list[float]:
        return run_bench(point, settings, gguf, binary)

    tracer = BenchTracer(references, settings, started, timer)
    sample_rows: list[dict] = []
    rounds = settings["rounds"]

    def measure(tasks, remeasure_pass: int, bar) -> None:
        for point_id, round_number in tasks:
            if tracer.due():
                tracer.record()
            point = grid[point_id]
            bar.set_postfix_str(f"round {round_number + 1}/{rounds} {point.kind} B={point.batch} "
                                f"L={point.prompt_len} cached={point.cached}", refresh=False)
            cpu_before = os.times()
            start = time.perf_counter()
            seconds = timer(point)
            wall = time.perf_counter() - start
            cpu_after = os.times()
            # the CPU the tool processes got over threads x their wall time, as measure.time_call reads it
            share = ((cpu_after.children_user + cpu_after.children_system - cpu_before.children_user
                      - cpu_before.children_system) / (wall * threads))
            middle = start + wall / 2 - started
            sample_rows.extend({"point_id": point_id, "kind": point.kind, "batch": point.batch,
                                "prompt_len": point.prompt_len, "cached": point.cached, "round": round_number,
                                "repeat": repeat, "t_s": middle, "seconds": value, "cpu_share": share,
                                "remeasure_pass": remeasure_pass, "superseded": False}
                               for repeat, value in enumerate(seconds))
            bar.update()

    def measure_pass(tasks, remeasure_pass: int) -> None:
        bar.total += len(tasks)
        measure(tasks, remeasure_pass, bar)

    with tqdm(total=rounds * len(grid), desc="llama.cpp profile", unit="pt", file=terminal(),
              disable=not progress, mininterval=5.0) as bar:
        for round_number in range(rounds):
            if round_number:
                probe_readings.append(read_probes(f"before round {round_number + 1}"))
            # shuffled per round, as measure.py does: drifts become noise spread over the grid
            measure([(point_id, round_number) for point_id in shuffler.sample(range(len(grid)), len(grid))], 0, bar)
        tracer.record()
        plan, passes = remeasure_until_settled(sample_rows, tracer.frame, tracer.record, rounds,
                                               MAX_REMEASURE_ROUNDS * len(grid), measure_pass,
                                               lambda tasks: shuffler.sample(tasks, len(tasks)),
                                               lambda: time.perf_counter() - started)
    probe_readings.append(read_probes("end"))
    roofline = machine.peak_roofline(probe_readings)

    points, all_samples, trace, brackets = settled_points(sample_rows, tracer.frame(), grid, arch, roofline, rounds)
    kv_per_token = 2 * model_meta["n_layer"] * model_meta["n_embd"] * FLOAT32_BYTES
    meta = {
        "engine": "llamacpp",
        "machine": {**machine.describe_machine(threads, "cpu"), "llamacpp_version": build.VERSION},
        "roofline": roofline,
        "model": {**model_meta, "gguf": str(gguf), "gguf_bytes": gguf.stat().st_size},
        "memory": {"param_bytes": model_meta["param_bytes"], "kv_bytes_per_token": kv_per_token,
                   "kv_bytes_per_token_expected": kv_per_token, "peak_rss_bytes": peak_child_rss_bytes()},
        "settings": {**settings, "cached_prefill": [[point.prompt_len, point.cached] for point in chunks_after_cached],
                     "tiny": tiny, "seed": seed, "device": "cpu", "ctx_mode": CTX_MODE,
                     "kinds": list(MEASURED_KINDS), "kv_type": "f32", "decode_steps_per_run":
                     int(settings["warmup"]) + int(settings["repeats"]),
                     "references": {kind: vars(point) for kind, point in references.items()}},
        "n_points": len(grid),
        "speed": {**speed_summary(trace), "trace": trace.to_dict("records")},
        "remeasure": remeasure_summary(plan, passes, trace, brackets, rounds, len(grid), MAX_REMEASURE_ROUNDS),
        "rounds": {"n": rounds, "median_spread_pct": float(points["spread_pct"].median()),
                   "median_raw_spread_pct": float(points["raw_spread_pct"].median())},
        "load_average": {"start": load_at_start, "end": os.getloadavg()},
        "cpu_share": {"min": float(points["cpu_share"].min()), "median": float(points["cpu_share"].median())},
        "wall_time_s": time.perf_counter() - started,
    }
    return Profile(points, all_samples, meta)
