"""The carry-over's measured accuracy: carry a 2-thread profile's cost model to "this machine at 1
thread" by the roofline and compare each capacity cell with what a 1-thread profile of the same
machine gives. Goal: every cell within +-15%.

The target's roofline is the 1-thread profile's own peak probes (machine.json `roofline`), so the
check tests the method (servingplan.hardware.carry_over and the one roofline work model) on a target
whose truth can be measured here. Capacities come from the planner's own capacity cells
(servingplan.planner.capacity_cell: the TTFT SLO and keeping up, the config's seeds and bisection).

From two finished result trees (the default config run twice, with profile.threads 2 and 1; the
lead runs these on a quiet machine):

    .venv/bin/python benchmarks/bench_onethread.py --two RUN_2T --one RUN_1T [--config config.yaml]

RUN_2T and RUN_1T are directories holding results/ (or results/ itself): each gives its
results/profile/*/machine.json and results/fit/costmodel.json, and RUN_1T its capacity cells
results/machines/here/capacity/cells/{policy}_cap{cap}.json. --config is the config both runs used (its workload,
slo, sweep, memory, capacity and seed sections set the capacity searches).

Or let it measure both profiles itself (two profiles and fits back to back, then the searches):

    .venv/bin/python benchmarks/bench_onethread.py --measure [--config config/quick.yaml]

--measure with config/quick.yaml (the tiny 2-layer model, small grid) is a smoke run of the
machinery that takes about a minute; it is no measurement. Prints one line per (criterion, policy,
cap): the 1-thread capacity, the carried-over estimate, their error (estimate / measured - 1) and
whether it is within the goal; then the largest error. Exits 0 whether or not the goal is met (the
benchmark reports, it does not judge); 2 on bad input.
"""
from __future__ import annotations

import argparse
import glob
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from servingplan import architecture, hardware  # noqa: E402
from servingplan.config import ConfigError, check, simulation_seeds  # noqa: E402
from servingplan.costmodel import CostModel, load  # noqa: E402
from servingplan.io import read_json  # noqa: E402
from servingplan.planner import capacity_cell  # noqa: E402

GOAL = 0.15
CRITERIA = ("ttft_slo", "stable")


def results_dir(path: Path) -> Path:
    return path if path.name == "results" else path / "results"


def tree_files(path: Path) -> tuple[dict, CostModel]:
    """(machine.json, fitted cost model) of a finished result tree."""
    results = results_dir(path)
    machines = sorted(glob.glob(str(results / "profile" / "*" / "machine.json")))
    if len(machines) != 1:
        raise ValueError(f"{results}: needs exactly one profile/*/machine.json, found {len(machines)}")
    return read_json(machines[0]), load(results / "fit" / "costmodel.json")


def cells(config: dict) -> list[tuple[str, int]]:
    return [(policy, int(cap)) for policy in config["sweep"]["policies"] for cap in config["sweep"]["caps"]]


def capacities(cost: CostModel, machine: dict, config: dict, policy: str, cap: int) -> dict:
    """{criterion: capacity_rps} of one cell, searched as the pipeline's capacity stage searches."""
    cell = capacity_cell(cost, machine, policy, cap, config["workload"], config["slo"], config["sweep"],
                         config["memory"], simulation_seeds(config), config["capacity"], criteria=CRITERIA)
    return {name: cell[name]["capacity_rps"] for name in CRITERIA}


def measure_both(config: dict) -> tuple[tuple[dict, CostModel], tuple[dict, CostModel]]:
    """Profile and fit this machine at 2 threads and at 1, back to back."""
    from servingplan.profiling.fit import fit_profile
    from servingplan.profiling.measure import run_profile
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
            measured_one = None
        else:
            machine_two, cost_two = tree_files(args.two)
            machine_one, cost_one = tree_files(args.one)
            measured_one = results_dir(args.one) / "machines" / "here" / "capacity" / "cells"
    except (OSError, ValueError, ConfigError) as err:
        print(f"bench_onethread: {err}", file=sys.stderr)
        return 2

    here = hardware.here_roofline(machine_two)
    target = {**hardware.here_roofline(machine_one), "name": "this machine at 1 thread", "kind": "cpu"}
    carried, terms = hardware.carry_over(cost_two, architecture.architecture(config["model"]), here, target)
    print(f"2 threads: {here['bandwidth_gbs']:.1f} GB/s, {here['gflops']:.1f} GFLOP/s; "
          f"1 thread: {target['bandwidth_gbs']:.1f} GB/s, {target['gflops']:.1f} GFLOP/s")
    for row in terms:
        label = row["term"] + (f"[{row['batch']}]" if row["batch"] is not None else "")
        own = getattr(cost_one, row["term"]) if row["batch"] is None else dict(cost_one.decode_batch_fixed_s).get(row["batch"])
        own_text = f"{own:.4g}" if own is not None else "-"
        print(f"  {label:28s} scale {row['scale']:.3f} ({row['bound_here']}->{row['bound_target']})  "
              f"carried {row['seconds_target']:.4g} s  1-thread fit {own_text} s"
              + ("  clamped" if row["clamped"] else ""))

    print(f"\n{'criterion':10s} {'policy':20s} {'cap':>4s} {'1-thread':>10s} {'carried':>10s} {'error':>8s}  goal +-{GOAL:.0%}")
    errors = []
    for policy, cap in cells(config):
        if measured_one is None:
            truth = capacities(cost_one, machine_one, config, policy, cap)
        else:
            cell = read_json(measured_one / f"{policy}_cap{cap}.json")
            truth = {name: cell[name]["capacity_rps"] for name in CRITERIA}
        estimate = capacities(carried, machine_one, config, policy, cap)
        for name in CRITERIA:
            if not truth[name] or estimate[name] is None:
                print(f"{name:10s} {policy:20s} {cap:4d} {truth[name]!s:>10s} {estimate[name]!s:>10s}  (no capacity)")
                continue
            error = estimate[name] / truth[name] - 1
            errors.append(error)
            print(f"{name:10s} {policy:20s} {cap:4d} {truth[name]:10.3f} {estimate[name]:10.3f} {error:+8.1%}  "
                  f"{'within' if abs(error) <= GOAL else 'MISSED'}")
    if errors:
        worst = max(errors, key=abs)
        within = sum(abs(e) <= GOAL for e in errors)
        print(f"\n{within}/{len(errors)} cells within +-{GOAL:.0%}; largest error {worst:+.1%}; "
              f"median |error| {sorted(map(abs, errors))[len(errors) // 2]:.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
