"""Why the carry-over check swings: how much faster 2 threads make the memory-bandwidth probe, and how much
faster they make the decode calls the carried terms stand for, read in pairs in one window of time.

    .venv/bin/python benchmarks/bench_thread_scaling.py [--seconds 150] [--batches 1 8] [--context 256] [--json OUT]

The carry-over check (servingplan/check/carry_check.py) carries the profile's fit, made at every core,
to this machine at 1 thread by the roofline: a bandwidth-bound term scales by the ratio of the two
profiles' bandwidth probes (each the median of its own profile's readings, minutes apart). This
benchmark reads, back to back and over and over for `--seconds`, at 2 threads then at 1: the probe
(servingplan.profile.machine.memory_bandwidth_gbs, the profile's own 256 MiB sum) and a decode step of
GPT-2 small (random weights) at each batch of `--batches`, the longest sequence at `--context` entries
(ragged like the profile's batches), the median of 5 timed calls after a warm-up. Per pair it prints
the readings; then, per quantity, the speed-up of 2 threads over 1 (median, min and max over the pairs).
Where the probe's speed-up and a call's differ, a term scaled by the probe mispredicts that call, and
where the probe's ratio moves from window to window, so does the check's verdict.

Exits 0 whatever it measures (the benchmark reports, it does not judge); 2 on bad input. Run it on a
quiet machine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PROBE_BYTES = 256 * 2**20
TIMED_CALLS = 5
MAX_SECONDS = 3600
MAX_BATCH = 64


def arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=150.0, help="how long to read pairs (1 to 3600)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8], help=f"decode batches (1 to {MAX_BATCH})")
    parser.add_argument("--context", type=int, default=256, help="entries of the longest sequence (2 to 1023)")
    parser.add_argument("--json", type=Path, help="also write the pairs and the summary here")
    args = parser.parse_args(argv)
    if not 1 <= args.seconds <= MAX_SECONDS:
        parser.exit(2, f"bench_thread_scaling: --seconds {args.seconds}: must be 1 to {MAX_SECONDS}\n")
    if any(not 1 <= batch <= MAX_BATCH for batch in args.batches):
        parser.exit(2, f"bench_thread_scaling: --batches {args.batches}: each must be 1 to {MAX_BATCH}\n")
    if not 2 <= args.context <= 1023:
        parser.exit(2, f"bench_thread_scaling: --context {args.context}: must be 2 to 1023\n")
    if args.json is not None and (args.json.is_symlink() or (args.json.exists() and not args.json.is_file())):
        parser.exit(2, f"bench_thread_scaling: --json {args.json}: must be a regular file path\n")
    return args


def main(argv=None) -> int:
    args = arguments(argv)
    import torch

    from servingplan.io import write_json
    from servingplan.profile.kvpool import KVPool, configure_allocator, decode_step
    from servingplan.profile.machine import memory_bandwidth_gbs
    from servingplan.profile.measure import decode_lengths, time_call
    from servingplan.profile.model import RANDOM_SOURCE, load_model
    configure_allocator()
    model, _ = load_model(RANDOM_SOURCE, 0)
    pool = KVPool(model.config, max(args.batches), args.context + 1, "cpu")
    generator = torch.Generator().manual_seed(0)
    tokens = {batch: torch.randint(model.config.vocab_size, (batch, 1), generator=generator) for batch in args.batches}

    def decode_ms(batch: int) -> float:
        # timed as the profile times its points: a warm-up call, then the median of TIMED_CALLS
        lengths = decode_lengths(batch, args.context)
        with torch.inference_mode():
            timed = time_call(lambda: decode_step(model, pool, lengths, tokens[batch]), 1, TIMED_CALLS, 0.0)
        return 1e3 * statistics.median(seconds for _, seconds, _ in timed)

    pairs = []
    began = time.perf_counter()
    while time.perf_counter() - began < args.seconds:
        pair = {"t_s": round(time.perf_counter() - began, 1)}
        for threads in (2, 1):
            torch.set_num_threads(threads)
            pair[f"bandwidth_gbs_{threads}t"] = memory_bandwidth_gbs(PROBE_BYTES)
            for batch in args.batches:
                pair[f"decode_b{batch}_ms_{threads}t"] = decode_ms(batch)
        pairs.append(pair)
        print(json.dumps({key: round(value, 2) for key, value in pair.items()}), flush=True)
    # speed-up of 2 threads over 1: a rate's ratio, or a time's inverse ratio
    speedups = {"bandwidth probe": [p["bandwidth_gbs_2t"] / p["bandwidth_gbs_1t"] for p in pairs]}
    for batch in args.batches:
        speedups[f"decode batch {batch}"] = [p[f"decode_b{batch}_ms_1t"] / p[f"decode_b{batch}_ms_2t"] for p in pairs]
    summary = {name: {"median": statistics.median(values), "min": min(values), "max": max(values)}
               for name, values in speedups.items()}
    print(f"{len(pairs)} pairs in {args.seconds:g} s; speed-up of 2 threads over 1 (median, min to max):")
    for name, row in summary.items():
        print(f"  {name:<18} {row['median']:.3f}  ({row['min']:.3f} to {row['max']:.3f})")
    if args.json is not None:
        write_json(args.json, {"pairs": pairs, "speedup_2t_over_1t": summary, "context": args.context,
                               "probe_bytes": PROBE_BYTES})
    return 0


if __name__ == "__main__":
    sys.exit(main())
