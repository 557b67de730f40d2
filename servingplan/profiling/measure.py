"""Measure how long GPT-2's two serving calls take on this machine, over a grid of shapes.

The serving engine and this profiler run the very same calls, so the cost model fitted on these
numbers describes what the engine does:

    prefill_call(model, input_ids, cache=None)            one prompt (or chunk), logits of its last token
    decode_call(model, input_ids, cache, attention_mask, position_ids)
                                                          one new token for each of B padded sequences
    random_kv_cache(config, batch, context, generator)    a DynamicCache as B prefills of `context` tokens leave it
    configure_allocator()                                 process-wide malloc setting both must run under

Profiling:

    run_profile(profile_cfg, model_cfg, seed, quick=False, threads=None, progress=True) -> Profile
    Profile.write(points_csv, samples_csv, meta_json)      atomic writes

run_profile calls configure_allocator() first: the engine must too (see its docstring).
`profile_cfg` and `model_cfg` are the `profile` and `model` sections of config.yaml. `quick` swaps in
a 2-layer random model (QUICK_CONFIG_OVERRIDES) and a tiny grid (QUICK_PROFILE) that run in seconds;
model_cfg["tiny"] (config/quick.yaml) swaps in the 2-layer model alone and keeps profile_cfg's grid.
Grid points, in kinds:

    prefill         batch 1, prompt_len in profile.prefill_lengths, nothing cached
    prefill_batch   batch in profile.prefill_batches, prompt_len BATCHED_PREFILL_LEN (informative only:
                    the engine prefills one sequence per call)
    prefill_cached  batch 1, a chunk of prompt_len tokens after `cached` tokens of the same prompt
                    (profile_cfg["cached_prefill"] if given, else CACHED_PREFILL_POINTS)
    decode          batch in profile.decode_batches, one token each, cached in profile.decode_contexts

points CSV, one row per grid point:
    point_id, kind, batch, prompt_len (new tokens per sequence), cached (tokens per sequence already
    in the KV cache), median_s, p10_s, p90_s, mean_s, min_s, n_repeats, flops, bytes (weights + KV read), floor_mem_s (bytes / probed bandwidth),
    floor_compute_s (flops / probed GEMM rate), floor_s (the larger), bound, efficiency (floor_s/median_s),
    cpu_share (median over its calls of the CPU time the process got over threads x wall time: well
    below 1 means other load competed for the cores and the point is slower than the machine alone),
    attempts, kept_attempt (see "Visits" below)
samples CSV, one row per timed call: point_id, kind, batch, prompt_len, cached, attempt, kept (its
    attempt is the one the point's statistics come from), repeat, seconds, cpu_share
meta JSON: machine, roofline probes (run before and after the grid, the faster kept), model, memory
    (param bytes, KV bytes per token measured and expected, peak RSS), the settings used, load
    averages, cpu_share summary, and wall_time_s of the whole profile.

Visits. The grid is measured in VISITS passes, each in a shuffled order and with its share of the
point budget, and a point measured while other processes competed for the cores
(cpu_share < machine.CONTENDED_CPU_SHARE) gets one more attempt after them. A point's statistics come
from its fastest uncontended attempt (the least contended if none is): a disturbance on this shared
machine only ever slows a call down, and two visits minutes apart rarely both meet one. On a quiet
machine two visits' medians differ by a few percent; a single visit left decode points ~10% apart
between runs.
"""
from __future__ import annotations

import ctypes
import ctypes.util
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
from transformers import DynamicCache

from servingplan.io import write_csv, write_json
from servingplan.profiling import machine
from servingplan.profiling.model import QUICK_CONFIG_OVERRIDES, RANDOM_SOURCE, load_model

BATCHED_PREFILL_LEN = 128
# (chunk tokens, tokens of the same prompt already cached): enough spread in L*cached to fit p3.
CACHED_PREFILL_POINTS = ((128, 256), (256, 256), (128, 512), (256, 512))
KV_PROBE_TOKENS = 16
VISITS = 2
FLOAT32_BYTES = 4

QUICK_PROFILE = {
    "warmup": 1, "min_repeats": 3, "max_repeats": 5, "point_budget_s": 0.05,
    "prefill_lengths": [8, 16, 32, 64], "prefill_batches": [1, 2],
    "decode_batches": [1, 2, 4], "decode_contexts": [8, 32], "cached_prefill": [(8, 16), (16, 16)],
    "probe_bytes": 8 * 2**20, "gemm_size": 128,
}


# glibc mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
INT_MAX = 2**31 - 1


def configure_allocator() -> str:
    """Keep freed memory in the process for reuse instead of handing it back to the OS.

    A DynamicCache grows by torch.cat, which allocates every layer's cache anew at each decode step.
    Under glibc's defaults a block above 32 MiB (one layer's keys beyond ~11k batch x context tokens
    for GPT-2 small) is mmap-ed fresh each time and all its pages faulted in and zeroed: on the 2-core
    profiling machine decode at batch 64 x 768 tokens took 1.5 s instead of 0.54 s, and the step time
    bent upward past that size instead of growing linearly with the KV tokens read. Serving every block
    from the heap and never trimming it reuses the pages. It is process-wide and must be in force in
    the engine as in the profiler, or the engine runs slower than its cost model. Returns what was set.
    """
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return "system default (no glibc mallopt)"
    if mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, INT_MAX):
        return "glibc: no mmap, no trim"
    return "system default (mallopt refused)"


@torch.inference_mode()
def prefill_call(model, input_ids: torch.Tensor, cache: DynamicCache | None = None):
    """Process prompt tokens [B, L] after whatever `cache` holds; the cache grows by L (a fresh one is
    built when None, and returned as .past_key_values). Logits only for the last position."""
    return model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)


@torch.inference_mode()
def decode_call(model, input_ids: torch.Tensor, cache: DynamicCache, attention_mask: torch.Tensor,
                position_ids: torch.Tensor):
    """One decode step: input_ids [B, 1], cache holding the B sequences padded to one length T,
    attention_mask [B, T+1] (0 on padding), position_ids [B, 1]. The cache grows by one token."""
    return model(input_ids=input_ids, past_key_values=cache, attention_mask=attention_mask,
                 position_ids=position_ids, use_cache=True)


def random_kv_cache(config, batch: int, context: int, generator: torch.Generator | None = None) -> DynamicCache:
    """A DynamicCache of `context` tokens per sequence, shaped as `batch` prefills leave it.

    The values are random because they do not change the cost; one block is copied into every layer
    and sequence since drawing gigabytes of normals would take longer than timing the point.
    """
    head_dim = config.n_embd // config.n_head
    block = torch.randn(1, config.n_head, context, head_dim, generator=generator).expand(batch, -1, -1, -1)
    layers = [(block.contiguous(), block.contiguous()) for _ in range(config.n_layer)]
    return DynamicCache(layers, config=config)


def cache_bytes(cache: DynamicCache) -> int:
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


def time_point(call, reset, warmup: int, min_repeats: int, max_repeats: int,
               budget_s: float) -> tuple[list[float], list[float]]:
    """Seconds of each timed `call` (`reset` restores its inputs outside the timed region), and for
    each call the CPU time the process got over threads x wall time: other load competing for the
    cores shows as a share well below one."""
    for _ in range(warmup):
        call()
        reset()
    threads = torch.get_num_threads()
    samples, cpu_shares = [], []
    started = time.perf_counter()
    while len(samples) < min_repeats or (len(samples) < max_repeats
                                         and time.perf_counter() - started < budget_s):
        cpu_start = time.process_time()
        start = time.perf_counter()
        call()
        elapsed = time.perf_counter() - start
        cpu_shares.append((time.process_time() - cpu_start) / (elapsed * threads))
        samples.append(elapsed)
        reset()
    return samples, cpu_shares


def point_runner(model, point: GridPoint, generator: torch.Generator):
    """(call, reset) for one grid point; each call sees the same input shapes and cache length."""
    config = model.config
    input_ids = torch.randint(config.vocab_size, (point.batch, point.prompt_len), generator=generator)
    if point.kind == "decode":
        cache = random_kv_cache(config, point.batch, point.cached, generator)
        attention_mask = torch.ones(point.batch, point.cached + 1, dtype=torch.long)
        position_ids = torch.full((point.batch, 1), point.cached, dtype=torch.long)
        # transformers 5.23 DynamicCache.crop takes minus the number of tokens to drop.
        return (lambda: decode_call(model, input_ids, cache, attention_mask, position_ids),
                lambda: cache.crop(-1))
    if point.cached:
        cache = random_kv_cache(config, point.batch, point.cached, generator)
        return lambda: prefill_call(model, input_ids, cache), lambda: cache.crop(-point.prompt_len)
    return lambda: prefill_call(model, input_ids), lambda: None


def point_work(point: GridPoint, model_meta: dict, kv_bytes_per_token: float) -> tuple[float, float]:
    """(FLOPs, bytes) the call cannot avoid: every weight read once plus the KV it attends over."""
    batch, new, cached = point.batch, point.prompt_len, point.cached
    n_layer, n_embd = model_meta["n_layer"], model_meta["n_embd"]
    flops = (2.0 * model_meta["non_embedding_param_count"] * batch * new
             + 4.0 * n_layer * n_embd * batch * new * (new + cached)
             + 2.0 * n_embd * model_meta["vocab_size"] * batch)
    bytes_read = model_meta["param_bytes"] + kv_bytes_per_token * batch * (cached + new)
    return flops, bytes_read


def measured_kv_bytes_per_token(model) -> float:
    """KV bytes one token adds, read off the cache a real prefill builds."""
    input_ids = torch.zeros(1, KV_PROBE_TOKENS, dtype=torch.long)
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
    model, model_meta = load_model(source, seed, QUICK_CONFIG_OVERRIDES if tiny else None)
    rss_after_load = psutil.Process().memory_info().rss
    roofline_at_start = machine.roofline_probes(settings["probe_bytes"], settings["gemm_size"])
    kv_bytes_per_token = measured_kv_bytes_per_token(model)

    grid = build_grid(settings)
    generator = torch.Generator().manual_seed(seed)
    shuffler = random.Random(seed)
    per_visit = {**settings, "point_budget_s": settings["point_budget_s"] / VISITS,
                 "max_repeats": max(settings["min_repeats"], settings["max_repeats"] // VISITS)}
    attempts = {point_id: [] for point_id in range(len(grid))}
    with torch.inference_mode(), tqdm(total=VISITS * len(grid), desc="profile", unit="pt", file=sys.stderr,
                                      disable=not progress) as bar:
        def measure(point_id: int) -> None:
            point = grid[point_id]
            bar.set_postfix_str(f"{point.kind} B={point.batch} L={point.prompt_len} cached={point.cached}")
            gc.collect()
            call, reset = point_runner(model, point, generator)
            attempts[point_id].append(time_point(call, reset, per_visit["warmup"], per_visit["min_repeats"],
                                                 per_visit["max_repeats"], per_visit["point_budget_s"]))
            bar.update()

        for _ in range(VISITS):
            # A shuffled order turns slow drifts of the machine (other load, heat) into noise spread
            # over the grid instead of a trend along one axis that the fit would mistake for cost.
            for point_id in shuffler.sample(range(len(grid)), len(grid)):
                measure(point_id)
        retry = [point_id for point_id in range(len(grid))
                 if not any(uncontended(attempt) for attempt in attempts[point_id])]
        bar.total += len(retry)
        for point_id in retry:
            measure(point_id)
    # Other load can only slow a probe down, so the faster of the two runs is the machine's.
    roofline_at_end = machine.roofline_probes(settings["probe_bytes"], settings["gemm_size"])
    roofline = {**roofline_at_start,
                "bandwidth_gbs": max(roofline_at_start["bandwidth_gbs"], roofline_at_end["bandwidth_gbs"]),
                "gemm_gflops": max(roofline_at_start["gemm_gflops"], roofline_at_end["gemm_gflops"]),
                "at_start": roofline_at_start, "at_end": roofline_at_end}

    rows, sample_rows = [], []
    for point_id, point in enumerate(grid):
        kept = kept_attempt(attempts[point_id])
        samples, cpu_shares = attempts[point_id][kept]
        rows.append({**_point_row(point_id, point, samples, model_meta, kv_bytes_per_token, roofline),
                     "cpu_share": float(np.median(cpu_shares)), "attempts": len(attempts[point_id]),
                     "kept_attempt": kept})
        sample_rows += [{"point_id": point_id, "kind": point.kind, "batch": point.batch,
                         "prompt_len": point.prompt_len, "cached": point.cached, "attempt": number,
                         "kept": number == kept, "repeat": repeat, "seconds": seconds, "cpu_share": share}
                        for number, (all_samples, all_shares) in enumerate(attempts[point_id])
                        for repeat, (seconds, share) in enumerate(zip(all_samples, all_shares))]

    points = pd.DataFrame(rows).sort_values("point_id", ignore_index=True)
    samples_frame = pd.DataFrame(sample_rows)
    expected_kv = 2 * model_meta["n_layer"] * model_meta["n_embd"] * FLOAT32_BYTES
    meta = {
        "machine": machine.describe_machine(threads),
        "roofline": roofline,
        "model": model_meta,
        "memory": {
            "param_bytes": model_meta["param_bytes"],
            "kv_bytes_per_token": kv_bytes_per_token,
            "kv_bytes_per_token_expected": expected_kv,
            "rss_after_load_bytes": rss_after_load,
            "peak_rss_bytes": peak_rss_bytes(),
        },
        "settings": {**settings, "quick": quick, "tiny": tiny, "seed": seed, "threads": threads, "visits": VISITS,
                     "cached_prefill": [list(p) for p in settings.get("cached_prefill", CACHED_PREFILL_POINTS)],
                     "batched_prefill_len": BATCHED_PREFILL_LEN},
        "n_points": len(grid),
        "allocator": allocator,
        "load_average": {"start": load_at_start, "end": os.getloadavg()},
        "cpu_share": {"min": float(points["cpu_share"].min()), "median": float(points["cpu_share"].median())},
        "wall_time_s": time.perf_counter() - started,
    }
    return Profile(points, samples_frame, meta)


def uncontended(attempt) -> bool:
    return np.median(attempt[1]) >= machine.CONTENDED_CPU_SHARE


def kept_attempt(attempts: list) -> int:
    """Index of the fastest uncontended attempt, or of the least contended when all were."""
    clean = [i for i, attempt in enumerate(attempts) if uncontended(attempt)]
    if clean:
        return min(clean, key=lambda i: np.median(attempts[i][0]))
    return max(range(len(attempts)), key=lambda i: np.median(attempts[i][1]))


def _point_row(point_id, point, samples, model_meta, kv_bytes_per_token, roofline) -> dict:
    flops, bytes_read = point_work(point, model_meta, kv_bytes_per_token)
    floor_mem = bytes_read / (roofline["bandwidth_gbs"] * 1e9)
    floor_compute = flops / (roofline["gemm_gflops"] * 1e9)
    median = float(np.median(samples))
    return {
        "point_id": point_id, "kind": point.kind, "batch": point.batch,
        "prompt_len": point.prompt_len, "cached": point.cached,
        "median_s": median, "p10_s": float(np.percentile(samples, 10)), "p90_s": float(np.percentile(samples, 90)),
        "mean_s": float(np.mean(samples)), "min_s": float(np.min(samples)), "n_repeats": len(samples),
        "flops": flops, "bytes": bytes_read,
        "floor_mem_s": floor_mem, "floor_compute_s": floor_compute, "floor_s": max(floor_mem, floor_compute),
        "bound": "memory" if floor_mem >= floor_compute else "compute",
        "efficiency": max(floor_mem, floor_compute) / median,
    }
