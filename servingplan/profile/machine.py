"""What machine a profile was measured on, and the two roofline probes its points are judged against.

`fingerprint(threads)` is cheap (no torch import, no measurement) so the pipeline can put it in output
paths while it builds its job graph; `describe_machine`, `memory_bandwidth_gbs` and `gemm_gflops`
are measured in the same run as the profile they qualify.

A peak is measured as a peak: each probe times its work `repeats` times and keeps the fastest, the
GEMM probe runs the model's own products (servingplan.roofline.gemm_shapes) beside a square one, and
the profiler reads the probes several times through its run (`peak_roofline` keeps every reading and
the highest of each): a machine whose speed moves is at its peak only some of the time, and the floors
the fit must respect are only floors if they come from the fastest the machine went.

The peak bounds the fit; it is not what the profiled calls ran at. On a shared machine the memory
bandwidth two cores can draw moves with the neighbours' load (here 31 to 64 GB/s between readings of
one profile, while one core drew 28 to 34), and each profiled point is a median over rounds. So
`peak_roofline` also keeps the median of each probe's readings (`seen`): the rate a typical round ran
at, which the carry-over to other machines scales from (servingplan.plan.hardware.here_roofline).
"""
from __future__ import annotations

import hashlib
import os
import statistics
import platform
import time
from importlib.metadata import version

import psutil

PROBE_REPEATS = 7
# A call that got less CPU time than this share of threads x wall time was slowed by other processes.
CONTENDED_CPU_SHARE = 0.8


def resolve_threads(threads: int | None) -> int:
    """0 or None means every logical core of the machine."""
    return int(threads) if threads else os.cpu_count()


def configure_threads(threads: int | None) -> int:
    import torch
    resolved = resolve_threads(threads)
    torch.set_num_threads(resolved)
    return resolved


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def ram_gib() -> int:
    # Rounded so that a kernel reserving a few MiB more after a reboot keeps the same fingerprint.
    return round(psutil.virtual_memory().total / 2**30)


def fingerprint(threads: int | None = None, device: str = "cpu") -> str:
    """A short stable id of the hardware and software that set the speed of a profile; a profile on a
    GPU (`device` cuda) gets an id of its own."""
    parts = [cpu_model(), str(os.cpu_count()), str(ram_gib()), version("torch"), str(resolve_threads(threads))]
    key = "|".join(parts if device == "cpu" else parts + [device])
    return hashlib.sha256(key.encode()).hexdigest()[:10]


def describe_machine(threads: int | None = None, device: str = "cpu") -> dict:
    import torch
    return {
        "fingerprint": fingerprint(threads, device),
        "device": device,
        "gpu": torch.cuda.get_device_name() if device == "cuda" else None,
        "cpu_model": cpu_model(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "ram_bytes": psutil.virtual_memory().total,
        "ram_gib": ram_gib(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": version("torch"),
        "transformers": version("transformers"),
        "numpy": version("numpy"),
        "threads": resolve_threads(threads),
    }


def _best_seconds(run, repeats: int, device) -> float:
    """The fastest of `repeats` timed runs: what the machine can do, not what it did on average."""
    from servingplan.device import wait_for
    run()  # first touch: page faults and lazy kernel selection are not what we measure
    wait_for(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        wait_for(device)
        samples.append(time.perf_counter() - start)
    return min(samples)


def memory_bandwidth_gbs(probe_bytes: int, repeats: int = PROBE_REPEATS, device: str = "cpu") -> float:
    """Read bandwidth (decimal GB/s) of summing a float32 buffer far larger than the caches, in the
    memory of `device` (the GPU's for cuda), at its fastest of `repeats`."""
    import torch
    buffer = torch.rand(probe_bytes // 4, dtype=torch.float32).to(device)
    seconds = _best_seconds(buffer.sum, repeats, buffer.device)
    return buffer.nbytes / seconds / 1e9


def product_gflops(shape: tuple[int, int, int], repeats: int = PROBE_REPEATS, device: str = "cpu") -> float:
    """float32 rate (GFLOP/s) of one (rows x inner) @ (inner x outer) product on `device`, at its
    fastest of `repeats`."""
    import torch
    rows, inner, outer = shape
    generator = torch.Generator().manual_seed(0)
    left = torch.randn(rows, inner, generator=generator).to(device)
    right = torch.randn(inner, outer, generator=generator).to(device)
    seconds = _best_seconds(lambda: torch.matmul(left, right), repeats, left.device)
    return 2.0 * rows * inner * outer / seconds / 1e9


def gemm_gflops(size: int, repeats: int = PROBE_REPEATS, device: str = "cpu") -> float:
    """float32 matrix-multiply rate (GFLOP/s) of one size x size x size product on `device`."""
    return product_gflops((size, size, size), repeats, device)


def shape_name(shape) -> str:
    return "x".join(str(int(n)) for n in shape)


def roofline_probes(probe_bytes: int, gemm_size: int, device: str = "cpu", gemm_shapes=()) -> dict:
    """One reading of the memory bandwidth and GEMM rate of `device`: the rate of each product of
    `gemm_shapes` (rows, inner, outer) and of the square gemm_size one, `gemm_gflops` the highest."""
    shapes = [tuple(int(n) for n in shape) for shape in gemm_shapes] + [(gemm_size, gemm_size, gemm_size)]
    by_shape = {shape_name(shape): product_gflops(shape, device=device) for shape in shapes}
    return {"bandwidth_gbs": memory_bandwidth_gbs(probe_bytes, device=device),
            "gemm_gflops": max(by_shape.values()), "gemm_by_shape": by_shape,
            "probe_bytes": probe_bytes, "gemm_size": gemm_size, "probe_repeats": PROBE_REPEATS}


def peak_roofline(readings: list[dict]) -> dict:
    """machine.json's `roofline` from every reading ({label, t_s, bandwidth_gbs, gemm_gflops,
    gemm_by_shape, ...}): the highest bandwidth and GEMM rate of any reading, which reading and product
    gave each, how far the readings moved, the median of each (`seen`, what a typical round of the
    profile ran at) and the readings themselves."""
    bandwidth = max(readings, key=lambda r: r["bandwidth_gbs"])
    gemm = max(readings, key=lambda r: r["gemm_gflops"])
    best_shape = max(gemm["gemm_by_shape"], key=gemm["gemm_by_shape"].get)

    def lowest_over_peak(key: str) -> float:
        return min(r[key] for r in readings) / max(r[key] for r in readings)

    return {"bandwidth_gbs": bandwidth["bandwidth_gbs"], "gemm_gflops": gemm["gemm_gflops"],
            "probe_bytes": readings[0]["probe_bytes"], "gemm_size": readings[0]["gemm_size"],
            "gemm_shapes": [[int(n) for n in name.split("x")] for name in readings[0]["gemm_by_shape"]],
            "probe_repeats": readings[0]["probe_repeats"],
            "peak": {"bandwidth_reading": bandwidth["label"], "gemm_reading": gemm["label"], "gemm_shape": best_shape,
                     "bandwidth_lowest_over_peak": lowest_over_peak("bandwidth_gbs"),
                     "gemm_lowest_over_peak": lowest_over_peak("gemm_gflops")},
            "seen": {"bandwidth_gbs": statistics.median(r["bandwidth_gbs"] for r in readings),
                     "gemm_gflops": statistics.median(r["gemm_gflops"] for r in readings),
                     "readings": len(readings)},
            "readings": readings}
