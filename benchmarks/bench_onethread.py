"""The carry-over's measured accuracy: carry a 2-thread profile's cost model to "this machine at 1
thread" by the roofline and compare each capacity cell with what a 1-thread profile of the same
machine gives. Goal: every cell within +-15%. The pipeline measures the same in a run with
`carry_over_check: true` (rules/check.smk); both use servingplan.check.carry_check.

From two finished result trees (the default config run twice, with profile.threads 2 and 1; the
lead runs these on a quiet machine):

    .venv/bin/python benchmarks/bench_onethread.py --two RUN_2T --one RUN_1T [--config config.yaml]

RUN_2T and RUN_1T are directories holding results/ (or results/ itself): each gives its
results/profile/*/machine.json and results/fit/costmodel.json. --config is the config both runs used
(its workload, slo, sweep, memory, capacity and seed sections set the capacity searches).

Or let it measure both profiles itself (two profiles and fits back to back, then the searches):

    .venv/bin/python benchmarks/bench_onethread.py --measure [--config config/quick.yaml]

--measure with config/quick.yaml (the tiny 2-layer model, small grid) is a smoke run of the
machinery that takes about a minute; it is no measurement. Prints one line per (criterion, policy,
cap): the 1-thread capacity, the carried-over estimate, their error (estimate / measured - 1) and
whether it is within the goal; then the summary. Exits 0 whether or not the goal is met (the
benchmark reports, it does not judge); 2 on bad input.
"""

from __future__ import annotations

import argparse
import glob
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from servingplan.check import carry_check  # noqa: E402
from servingplan.config import ConfigError, check
from servingplan.costmodel import CostModel, load  # noqa: E402
from servingplan.io import read_json  # noqa: E402


def results_dir(path: Path) -> Path:
    return path if path.name == "results" else path / "results"


def tree_files(path: Path) -> tuple[dict, CostModel]:
    """(machine.json, fitted cost model) of a finished result tree."""
    results = results_dir(path)
    machines = sorted(glob.glob(str(results / "profile" / "*" / "machine.json")))
    if len(machines) != 1:
        raise ValueError(f"{results}: needs exactly one profile/*/machine.json, found {len(machines)}")
    return read_json(machines[0]), load(results / "fit" / "costmodel.json")


def measure_both(config: dict) -> tuple[tuple[dict, CostModel], tuple[dict, CostModel]]:
    """Profile and fit this machine at 2 threads and at 1, back to back."""
    from servingplan.fit.step_model import fit_profile
    from servingplan.profile.measure import run_profile
    fitted = []
    for threads in (2, 1):
        profile = run_profile(config["profile"], config["model"], config["seed"], threads=threads)
        fit = fit_profile(profile.points, profile.samples, profile.meta, config["fit"]["holdout_fraction"],
                          config["fit"]["mape_goal"], config["seed"])
        fitted.append((profile.meta, fit.cost_model))
    return fitted[0], fitted[1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--two", type=Path, help="result tree of the 2-thread run")
    parser.add_argument("--one", type=Path, help="result tree of the 1-thread run")
    parser.add_argument("--measure", action="store_true", help="profile and fit both thread counts here first")
    parser.add_argument("--config", type=Path, default=Path("config.yaml"))
    args = parser.parse_args(argv)
    try:
        config = yaml.safe_load(args.config.read_text())
        check(config)
        if args.measure == bool(args.two or args.one) or not args.measure and not (args.two and args.one):
            raise ValueError("give either --measure or both --two and --one")
        if args.measure:
            (machine_two, cost_two), (machine_one, cost_one) = measure_both(config)
        else:
            machine_two, cost_two = tree_files(args.two)
            machine_one, cost_one = tree_files(args.one)
    except (OSError, ValueError, ConfigError) as err:
        print(f"bench_onethread: {err}", file=sys.stderr)
        return 2

    result = carry_check.check(cost_two, machine_two, cost_one, machine_one, config["model"],
                               carry_check.settings_of(config))
    here, target = result["roofline_here"], result["roofline_target"]
    print(f"{result['threads_here']} threads: {here['bandwidth_gbs']:.1f} GB/s, {here['gflops']:.1f} GFLOP/s; "
          f"1 thread: {target['bandwidth_gbs']:.1f} GB/s, {target['gflops']:.1f} GFLOP/s; "
          f"clamped: {', '.join(result['clamped_terms']) or 'none'}")
    print(f"\n{'criterion':10s} {'policy':20s} {'cap':>4s} {'1-thread':>10s} {'carried':>10s} {'error':>8s}  "
          f"goal +-{carry_check.GOAL:.0%}")
    for row in result["rows"]:
        if row["error"] is None:
            print(f"{row['criterion']:10s} {row['policy']:20s} {row['cap']:4d} {row['measured_rps']!s:>10s} "
                  f"{row['estimated_rps']!s:>10s}  (no capacity)")
            continue
        print(f"{row['criterion']:10s} {row['policy']:20s} {row['cap']:4d} {row['measured_rps']:10.3f} "
              f"{row['estimated_rps']:10.3f} {row['error']:+8.1%}  "
              f"{'within' if abs(row['error']) <= carry_check.GOAL else 'MISSED'}")
    summary = result["summary"]
    if summary:
        print(f"\n{summary['within_goal']}/{summary['cells']} cells within +-{carry_check.GOAL:.0%}; largest error "
              f"{summary['largest_error']:+.1%}; median |error| {summary['median_abs_error']:.1%}; "
              f"{summary['direction']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
