"""Wall time of the simulator: one capstone run per policy and cap, and a 1,008-cell sweep.

    .venv/bin/python benchmarks/bench_sim.py [COST_MODEL_JSON] [--repeats N]

Without a JSON, the cost model is an assumed GPT-2 small on 2 CPU cores (not a measurement):
30 ms per decode step + 2 ms per sequence + 1 us per KV token read, 10 ms + 1.8 ms per prompt
token per prefill call. At the capstone's 6 req/s that machine is overloaded, so the runs include
a growing queue, as the low-cap cells of a real sweep do. The goal is <= 10 ms per 600-request run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from servingplan import costmodel  # noqa: E402
from servingplan.simulate import workload  # noqa: E402
from servingplan.simulate import POLICIES, simulate  # noqa: E402

GPT2_SMALL_2_CORES = costmodel.CostModel(
    decode_fixed_s=30e-3, decode_per_seq_s=2e-3, decode_per_ctx_token_s=1e-6,
    prefill_fixed_s=10e-3, prefill_per_token_s=1.8e-3, name="gpt2-small-2-cores (assumed)")

SWEEP_CAPS = (1, 2, 4, 8, 16, 32)
SWEEP_RATES = (0.25, 0.5, 1, 2, 3, 4, 6, 9)
SWEEP_SEEDS = 7


def median_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cost_model", nargs="?", help="cost-model JSON or preset (default: assumed GPT-2 small)")
    parser.add_argument("--repeats", type=int, default=15, help="runs per single-simulation figure")
    args = parser.parse_args(argv)
    cost = costmodel.load(args.cost_model) if args.cost_model else GPT2_SMALL_2_CORES
    trace = workload.generate(workload.CAPSTONE, seed=0)
    print(f"cost model: {cost.name}; capstone trace: {len(trace)} requests at {workload.CAPSTONE['rate']} req/s")

    print(f"{'policy':<20}{'cap':>4}{'median_ms':>11}{'steps':>8}{'events':>8}  stable")
    for policy in POLICIES:
        for cap in (8, 32):
            result = simulate(trace, cost, policy, cap)
            ms = median_ms(lambda: simulate(trace, cost, policy, cap), args.repeats)
            print(f"{policy:<20}{cap:>4}{ms:>11.2f}{result.steps:>8}{result.events:>8}  {result.stable}")

    start = time.perf_counter()
    traces = {(rate, seed): workload.generate({**workload.CAPSTONE, "rate": rate}, seed)
              for rate in SWEEP_RATES for seed in range(SWEEP_SEEDS)}
    generate_s = time.perf_counter() - start
    cells = [(policy, cap, key) for policy in POLICIES for cap in SWEEP_CAPS for key in traces]
    start = time.perf_counter()
    for policy, cap, key in cells:
        simulate(traces[key], cost, policy, cap, record_tokens=False)
    sweep_s = time.perf_counter() - start
    print(f"sweep: {len(cells)} cells ({len(POLICIES)} policies x {len(SWEEP_CAPS)} caps x {len(SWEEP_RATES)} "
          f"rates x {SWEEP_SEEDS} seeds) in {sweep_s:.2f} s = {sweep_s / len(cells) * 1e3:.2f} ms per cell; "
          f"{len(traces)} traces generated in {generate_s:.2f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
