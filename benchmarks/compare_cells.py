"""Recompute the simulation cells of a finished run with this tree's code, and compare them with that run's.

    .venv/bin/python benchmarks/compare_cells.py REFERENCE_RESULTS OUT [--stages capacity fleet sweep]
        [--machines here nvidia-t4 ...] [--config config.yaml] [--compare-only]

Each cell is computed from the reference run's cost models (results/fit/costmodel.json for this machine,
results/machines/<target>/costmodel.json for a target) and machine.json, with the cell functions of
servingplan.plan.planner and servingplan.simulate.searches and the config's sections as the pipeline passes them. OUT gets the cells in the
pipeline's layout (OUT/machines/<machine>/{capacity,fleet}/cells/*.json, sweep/cells/*.csv) and
OUT/cpu.json: the CPU seconds each (machine, stage) took in this process, imports excluded (a pipeline
job adds its own start-up to each cell).

The comparison: the same verdicts, capacities within the bisection tolerance.
- capacity: per criterion, every seed's search ends censored the same way, and its lower bound (the
  capacity) differs from the reference's by at most the tolerance (both brackets hold the seed's
  threshold and are at most 1 + tolerance wide); never_met identical.
- fleet: per router the same feasibility and replica count, and at the largest fleet (when infeasible)
  the same stability; the speed-up needed (and at each speed of the band) within the tolerance, or None
  in both.
- sweep: identical tables.
Exit status 1 when any cell differs."""
from __future__ import annotations

import argparse
import glob
import json
import math
import sys
import time
from pathlib import Path

import pandas as pd
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from servingplan.config import HERE
from servingplan.costmodel import load  # noqa: E402
from servingplan.io import read_json, write_csv, write_json  # noqa: E402
from servingplan.plan import planner  # noqa: E402
from servingplan.seeds import simulation_seeds  # noqa: E402
from servingplan.simulate import searches  # noqa: E402

STAGES = ("capacity", "fleet", "sweep")


def cost_model_path(results: Path, machine: str) -> Path:
    return results / "fit" / "costmodel.json" if machine == HERE else results / "machines" / machine / "costmodel.json"


def cell_path(root: Path, machine: str, stage: str, cell: str) -> Path:
    return root / "machines" / machine / stage / "cells" / (f"{cell}.csv" if stage == "sweep" else f"{cell}.json")


def compute(reference: Path, out: Path, config: dict, machines: list[str], stages: list[str],
            cells: list[str] | None = None) -> dict:
    seeds = simulation_seeds(config)
    machine_json = read_json(glob.glob(str(reference / "profile" / "*" / "machine.json"))[0])
    cpu = {}
    for machine in machines:
        cost = load(cost_model_path(reference, machine))
        for stage in stages:
            start = time.process_time()
            for policy in config["sweep"]["policies"]:
                for cap in config["sweep"]["caps"]:
                    if cells and f"{policy}_cap{cap}" not in cells:
                        continue
                    args = (cost, machine_json, policy, cap, config["workload"], config["slo"], config["sweep"],
                            config["memory"], seeds)
                    path = cell_path(out, machine, stage, f"{policy}_cap{cap}")
                    path.parent.mkdir(parents=True, exist_ok=True)
                    if stage == "capacity":
                        write_json(path, searches.capacity_cell(*args, config["capacity"]))
                    elif stage == "fleet":
                        write_json(path, searches.fleet_cell(*args, config["capacity"], config["cost"]))
                    else:
                        write_csv(path, planner.sweep_cell(*args))
            cpu[f"{machine}/{stage}"] = round(time.process_time() - start, 2)
            print(f"{machine}/{stage}: {cpu[f'{machine}/{stage}']} CPU s", flush=True)
    write_json(out / "cpu.json", cpu)
    return cpu


def within(a: float | None, b: float | None, tolerance: float) -> bool:
    if a is None or b is None or a == 0 or b == 0:
        return a == b
    return abs(math.log(a / b)) <= math.log1p(tolerance) * (1 + 1e-9)


def compare_capacity(new: dict, ref: dict, tolerance: float) -> list[str]:
    problems = []
    for name, ref_found in ref.items():
        found = new.get(name)
        if found is None:
            problems.append(f"{name}: missing")
            continue
        runs = [("fitted", found, ref_found), *((speed, found["speed_band"].get(speed), band)
                                                for speed, band in ref_found.get("speed_band", {}).items())]
        for speed, mine, theirs in runs:
            if mine is None:
                problems.append(f"{name}/{speed}: missing")
                continue
            if mine["never_met"] != theirs["never_met"]:
                problems.append(f"{name}/{speed}: never_met {mine['never_met']} vs {theirs['never_met']}")
            for a, b in zip(mine["per_seed"], theirs["per_seed"]):
                if a["censored"] != b["censored"] or not within(a["lower"], b["lower"], tolerance):
                    problems.append(f"{name}/{speed} seed {a['seed']}: {a['lower']:.6g} ({a['censored']}) vs "
                                    f"{b['lower']:.6g} ({b['censored']})")
    return problems


def compare_fleet(new: dict, ref: dict, tolerance: float) -> list[str]:
    problems = []
    for router, theirs in ref["fleets"].items():
        mine = new["fleets"].get(router, {})
        if (mine.get("feasible"), mine.get("replicas")) != (theirs["feasible"], theirs["replicas"]):
            problems.append(f"{router}: {mine.get('replicas')} replicas vs {theirs['replicas']}")
        elif not theirs["feasible"]:
            stable = {k: v["stable"] for k, v in theirs["at_max"].items()}
            if {k: v["stable"] for k, v in mine["at_max"].items()} != stable:
                problems.append(f"{router}: at the largest fleet, stability differs")
    pairs = [("fitted", new, ref), *((speed, new["speedup_speed_band"].get(speed, {}), band)
                                     for speed, band in ref["speedup_speed_band"].items())]
    for speed, mine, theirs in pairs:
        if not within(mine.get("speedup_needed"), theirs["speedup_needed"], tolerance):
            problems.append(f"speed-up ({speed}): {mine.get('speedup_needed')} vs {theirs['speedup_needed']}")
    return problems


def compare(reference: Path, out: Path, config: dict, machines: list[str], stages: list[str]) -> int:
    tolerance = config["capacity"]["tolerance"]
    checked = failed = 0
    for machine in machines:
        for stage in stages:
            for policy in config["sweep"]["policies"]:
                for cap in config["sweep"]["caps"]:
                    cell = f"{policy}_cap{cap}"
                    mine, theirs = cell_path(out, machine, stage, cell), cell_path(reference, machine, stage, cell)
                    if not mine.exists():
                        continue
                    if stage == "sweep":
                        same = pd.read_csv(mine).equals(pd.read_csv(theirs))
                        problems = [] if same else ["tables differ"]
                    else:
                        check = compare_capacity if stage == "capacity" else compare_fleet
                        problems = check(read_json(mine), read_json(theirs), tolerance)
                    checked += 1
                    failed += bool(problems)
                    for problem in problems:
                        print(f"DIFFERS {machine}/{stage}/{cell}: {problem}")
    print(f"{checked} cells compared, {failed} differ")
    return 1 if failed else 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reference", type=Path, help="a finished run's results/ directory")
    parser.add_argument("out", type=Path, help="where this tree's cells go")
    parser.add_argument("--config", type=Path, default=Path("config.yaml"))
    parser.add_argument("--machines", nargs="+", help="default: every machine of the reference run")
    parser.add_argument("--stages", nargs="+", choices=STAGES, default=["capacity", "fleet"])
    parser.add_argument("--cells", nargs="+", help="only these cells, as policy_capN (default: all)")
    parser.add_argument("--compare-only", action="store_true", help="compare cells already in OUT")
    args = parser.parse_args(argv)
    config = yaml.safe_load(args.config.read_text())
    machines = args.machines or sorted(p.name for p in (args.reference / "machines").iterdir() if p.is_dir())
    if not args.compare_only:
        compute(args.reference, args.out, config, machines, args.stages, args.cells)
    return compare(args.reference, args.out, config, machines, args.stages)


if __name__ == "__main__":
    sys.exit(main())
