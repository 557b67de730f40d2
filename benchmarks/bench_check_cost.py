"""What the carry-over check's 1-thread profile costs, against the check it replaced (issue 37): the
pipeline's check settings (servingplan.profile.grid.check_profile) and the settings of commit 6e598b4
(the profile's grid thinned to 6 prompt lengths, 6 batches and 3 contexts with the references kept,
batched prefill, four cached-prefill points, the profile's warm-up call and prefill reference, and
re-measurement of up to two grid-sizes), profiled in turn, A B A B ..., each in a fresh process as the
pipeline's job runs it, so a ratio pairs two runs minutes apart on this noisy machine.

    .venv/bin/python benchmarks/bench_check_cost.py [--config config.yaml] [--pairs N] [--out DIR]

Prints one line per run (process wall seconds, profile seconds, grid points, measurements re-measured
and extra rounds, how far the speed references moved), then the median of each and the median ratio
new / old pair by pair. With --out, each run's profile files go to DIR/{new,old}.N/, where rules
fit_one_thread and carry_over_check can read them (docs/benchmarks.md says how). Exits 0 whatever the
figures (the benchmark reports, it does not judge); 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from servingplan.config import ConfigError, check  # noqa: E402
from servingplan.profile import grid  # noqa: E402

VARIANTS = ("new", "old")
MAX_PAIRS = 20
# the check's grid at 6e598b4, frozen here: values per axis (prompt lengths, decode batches, decode
# contexts) and rounds
ISSUE_AXES = (6, 6, 3)
ISSUE_ROUNDS = 2


def issue_settings(profile: dict) -> dict:
    """The check's 1-thread profile settings at 6e598b4, the cost the issue halves."""
    batch, context = profile["reference_decode"]
    lengths, batches, contexts = ISSUE_AXES
    return {**profile, "threads": 1, "rounds": min(int(profile["rounds"]), ISSUE_ROUNDS),
            "prefill_lengths": grid.thinned(profile["prefill_lengths"], lengths, [profile["reference_prefill"]]),
            "decode_batches": grid.thinned(profile["decode_batches"], batches, [batch]),
            "decode_contexts": grid.thinned(profile["decode_contexts"], contexts, [context])}


def settings_of(variant: str, profile: dict) -> dict:
    return grid.check_profile(profile) if variant == "new" else issue_settings(profile)


def profile_once(variant: str, config: dict, out: Path | None) -> dict:
    """One run in this process: the 1-thread profile of `variant`, and what it cost."""
    from servingplan.profile.measure import run_profile
    started = time.perf_counter()
    profile = run_profile(settings_of(variant, config["profile"]), config["model"], config["seed"], progress=False)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        profile.write(out / "profile.csv", out / "samples.csv", out / "machine.json")
    meta = profile.meta
    return {"variant": variant, "profile_s": time.perf_counter() - started, "points": meta["n_points"],
            "remeasured": meta["remeasure"]["n_remeasured"], "extra_rounds": meta["remeasure"]["n_extra_rounds"],
            "moved_pct": meta["speed"]["moved_pct"]}


def run_child(variant: str, config_path: Path, out: Path | None) -> dict:
    command = [sys.executable, __file__, "--config", str(config_path), "--child", variant]
    if out is not None:
        command += ["--out", str(out)]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{variant} run failed: {done.stderr.strip().splitlines()[-1:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "wall_s": time.perf_counter() - started}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=ROOT / "config.yaml")
    parser.add_argument("--pairs", type=int, default=2, help=f"A/B pairs, 1 to {MAX_PAIRS} (default 2)")
    parser.add_argument("--out", type=Path, help="a directory for each run's profile files")
    parser.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not 1 <= args.pairs <= MAX_PAIRS:
        parser.error(f"--pairs {args.pairs}: must be 1 to {MAX_PAIRS}")
    if not args.config.is_file():
        parser.error(f"--config {args.config}: not a regular file")
    try:
        config = yaml.safe_load(args.config.read_text())
        check(config)
    except (ConfigError, yaml.YAMLError) as error:
        print(f"--config {args.config}: {str(error).splitlines()[0]}", file=sys.stderr)
        return 2
    if args.child:
        print(json.dumps(profile_once(args.child, config, args.out)))
        return 0
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out}: not a directory")
    runs = []
    for pair in range(args.pairs):
        for variant in VARIANTS:
            row = run_child(variant, args.config, args.out / f"{variant}.{pair + 1}" if args.out else None)
            runs.append(row)
            print(f"{variant} {pair + 1}: {row['wall_s']:.1f} s process, {row['profile_s']:.1f} s profile, "
                  f"{row['points']} points, {row['remeasured']} re-measured, {row['extra_rounds']} extra rounds, "
                  f"speed moved {row['moved_pct']:.1f}%", flush=True)
    walls = {variant: [row["wall_s"] for row in runs if row["variant"] == variant] for variant in VARIANTS}
    ratios = [new / old for new, old in zip(walls["new"], walls["old"])]
    for variant in VARIANTS:
        print(f"{variant}: median {statistics.median(walls[variant]):.1f} s over {len(walls[variant])} runs")
    print(f"new / old, pair by pair: median {statistics.median(ratios):.3f} "
          f"({min(ratios):.3f} to {max(ratios):.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
