"""What machine a profile was measured on, and the two roofline probes its points are judged against.

`fingerprint(threads)` is cheap (no torch import, no measurement) so the pipeline can put it in output
paths while it builds its job graph; `describe_machine`, `memory_bandwidth_gbs` and `gemm_gflops`
are measured in the same run as the profile they qualify.
"""
from __future__ import annotations

import hashlib
import os
import platform
import statistics
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


def _median_seconds(run, repeats: int, device) -> float:
    from servingplan.device import wait_for
    run()  # first touch: page faults and lazy kernel selection are not what we measure
    wait_for(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        wait_for(device)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def memory_bandwidth_gbs(probe_bytes: int, repeats: int = PROBE_REPEATS, device: str = "cpu") -> float:
    """Read bandwidth (decimal GB/s) of summing a float32 buffer far larger than the caches, in the
    memory of `device` (the GPU's for cuda)."""
    import torch
    buffer = torch.rand(probe_bytes // 4, dtype=torch.float32).to(device)
    seconds = _median_seconds(buffer.sum, repeats, buffer.device)
    return buffer.nbytes / seconds / 1e9


def gemm_gflops(size: int, repeats: int = PROBE_REPEATS, device: str = "cpu") -> float:
    """float32 matrix-multiply rate (GFLOP/s) of one size x size x size product on `device`."""
    import torch
    generator = torch.Generator().manual_seed(0)
    left = torch.randn(size, size, generator=generator).to(device)
    right = torch.randn(size, size, generator=generator).to(device)
    seconds = _median_seconds(lambda: torch.matmul(left, right), repeats, left.device)
    return 2.0 * size**3 / seconds / 1e9


def roofline_probes(probe_bytes: int, gemm_size: int, device: str = "cpu") -> dict:
    """The memory bandwidth and GEMM rate of `device`, the ceilings its calls are judged against."""
    return {"bandwidth_gbs": memory_bandwidth_gbs(probe_bytes, device=device),
            "gemm_gflops": gemm_gflops(gemm_size, device=device),
            "probe_bytes": probe_bytes, "gemm_size": gemm_size, "probe_repeats": PROBE_REPEATS}
