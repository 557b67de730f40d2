"""Why the carry-over check swings from run to run (issue 37): one 2-thread profile held fixed, the check's
1-thread profile (servingplan.profile.grid.check_profile) measured again and again, each in a fresh process
as the pipeline's job runs it, and the check (servingplan.check.carry_check) recomputed against each. What
moves between the runs is then the 1-thread side alone: its calls' times, its fit, its probes.

    .venv/bin/python benchmarks/bench_check_swing.py --profile DIR [--runs N] [--out DIR] [--config config.yaml]
    .venv/bin/python benchmarks/bench_check_swing.py --profile DIR --one-thread DIR [DIR ...]

--profile is a 2-thread profile's directory (profile.csv, samples.csv, machine.json: a run's
results/profile/<fingerprint>/), fitted here as rule fit fits it. --runs measures N 1-thread profiles (1 to
MAX_RUNS; with --out each goes to DIR/run.K/, where a later call can read it); --one-thread reads
directories measured before (benchmarks/bench_check_cost.py --out writes the same files). Each run is also
fitted on its calls' raw times, without the speed trace's normalisation, to show what normalising buys at
1 thread.

Prints one line per run: the speed references' movement, the median spread of the rounds (normalised and
raw), the 1-thread fit's held-out error (normalised and raw), the check's cells within the goal and their
median |error|; then each compared call's time measured at 1 thread and carried over, as a range over the
runs. Exits 0 whatever the figures (the benchmark reports, it does not judge); 2 on bad input.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from servingplan.config import ConfigError, check  # noqa: E402

MAX_RUNS = 20
PROFILE_FILES = ("profile.csv", "samples.csv", "machine.json")


def profile_dir(path: Path, flag: str) -> Path:
    missing = [name for name in PROFILE_FILES if not (path / name).is_file()]
    if missing:
        raise ValueError(f"{flag} {path}: needs regular files {', '.join(PROFILE_FILES)}; missing {', '.join(missing)}")
    return path


def measure_run(config_path: Path, out: Path) -> Path:
    """One 1-thread check profile in a fresh process (bench_check_cost's child), written to `out`."""
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_check_cost.py"), "--config", str(config_path),
               "--child", "new", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"1-thread profile failed: {done.stderr.strip().splitlines()[-1:]}")
    return out


def fitted(path: Path, config: dict, raw: bool = False):
    """(cost model, machine.json, fit report) of the profile in `path`; `raw` fits the calls' times as
    measured instead of normalised by the speed trace."""
    from servingplan.fit.step_model import fit_profile
    from servingplan.io import read_json
    try:
        points, samples = pd.read_csv(path / "profile.csv"), pd.read_csv(path / "samples.csv")
        meta = read_json(path / "machine.json")
        if raw:
            points = points.assign(median_s=points["raw_median_s"])
            samples = samples.assign(normalized_s=samples["seconds"])
        fit = fit_profile(points, samples, meta, config["fit"]["holdout_fraction"], config["fit"]["mape_goal"],
                          config["seed"])
    except (OSError, ValueError, KeyError) as error:
        raise ValueError(f"{path}: not a profile the fit reads ({type(error).__name__}: {error})") from None
    return fit.cost_model, meta, fit.report


def one_run(path: Path, here: tuple, config: dict, settings: dict) -> dict:
    from servingplan.check.carry_check import check as carry_check
    cost_one, meta_one, report = fitted(path, config)
    _, _, raw_report = fitted(path, config, raw=True)
    result = carry_check(here[0], here[1], cost_one, meta_one, config["model"], settings)
    return {"path": path, "moved_pct": meta_one["speed"]["moved_pct"],
            "spread_pct": meta_one["rounds"]["median_spread_pct"],
            "raw_spread_pct": meta_one["rounds"]["median_raw_spread_pct"],
            "heldout_pct": 100 * report["heldout_mape"], "raw_heldout_pct": 100 * raw_report["heldout_mape"],
            "summary": result["summary"], "summary_as_run": result["summary_as_run"], "window": result["window"],
            "calls": result["calls"], "goal": result["goal"]}


def cells(summary: dict | None, goal: float) -> str:
    return (f"{summary['within_goal']} of {summary['cells']} cells within +-{goal:.0%}, median "
            f"|error| {summary['median_abs_error']:.1%}, largest {summary['largest_error']:+.1%}"
            if summary else "no cell compared")


def window(correction: dict) -> str:
    """The window correction: each kind's ratio (1-thread run over the profile's window) and whether applied."""
    if not correction["read"]:
        return "no window readings"
    return ", ".join(f"{kind} x{correction[kind]['ratio']:.3f} (se {correction[kind]['standard_error']:.3f}, "
                     f"{'applied' if correction[kind]['applied'] != 1.0 else 'not applied'})"
                     for kind in ("decode", "prefill") if correction[kind]["ratio"] is not None)


def describe(run: dict) -> str:
    return (f"{run['path']}: speed moved {run['moved_pct']:.1f}%; rounds' spread {run['spread_pct']:.1f}% "
            f"(raw {run['raw_spread_pct']:.1f}%); held-out fit {run['heldout_pct']:.2f}% (raw "
            f"{run['raw_heldout_pct']:.2f}%); window {window(run['window'])}; "
            f"{cells(run['summary'], run['goal'])}; as run {cells(run['summary_as_run'], run['goal'])}")


def call_ranges(runs: list[dict]) -> list[str]:
    """Per compared call, its 1-thread time and its carried estimate over the runs (min to max, and how far
    that range is of the median), and the carried call's error range."""
    lines = []
    for index, call in enumerate(runs[0]["calls"]):
        measured = [run["calls"][index]["seconds_measured"] for run in runs]
        carried = [run["calls"][index]["seconds_estimated"] for run in runs]
        errors = [run["calls"][index]["error"] for run in runs]
        lines.append(f"{call['kind']:8s} {call['size']:4d}: here {call['seconds_here'] * 1e3:8.1f} ms; 1 thread "
                     f"{min(measured) * 1e3:7.1f} to {max(measured) * 1e3:7.1f} ms "
                     f"({100 * (max(measured) - min(measured)) / statistics.median(measured):4.1f}%); carried "
                     f"{min(carried) * 1e3:7.1f} to {max(carried) * 1e3:7.1f} ms "
                     f"({100 * (max(carried) - min(carried)) / statistics.median(carried):4.1f}%); error "
                     f"{min(errors):+.1%} to {max(errors):+.1%}")
    return lines


def measured_runs(two: Path, given: list[Path], args, config: dict) -> list[dict]:
    """Fit the 2-thread profile, then each 1-thread run (measured now, or `given`) and the check against it,
    printing each as it comes."""
    from servingplan.check.carry_check import settings_of
    cost_here, machine_here, report_here = fitted(two, config)
    print(f"{two}: {machine_here['machine']['threads']} threads, held-out fit {100 * report_here['heldout_mape']:.2f}%")
    settings = settings_of(config)
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        out = args.out or Path(scratch)
        paths = given or (measure_run(args.config, out / f"run.{number + 1}") for number in range(args.runs))
        for path in paths:
            runs.append(one_run(path, (cost_here, machine_here), config, settings))
            print(describe(runs[-1]), flush=True)
    return runs


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", type=Path, required=True, help="the 2-thread profile's directory")
    parser.add_argument("--runs", type=int, help=f"1-thread profiles to measure, 1 to {MAX_RUNS}")
    parser.add_argument("--one-thread", type=Path, nargs="+", help="1-thread profile directories measured before")
    parser.add_argument("--out", type=Path, help="a directory for the measured runs' profile files")
    parser.add_argument("--config", type=Path, default=ROOT / "config.yaml")
    args = parser.parse_args(argv)

    def refuse(message: str):
        parser.exit(2, f"bench_check_swing: {message}\n")

    if (args.runs is None) == (args.one_thread is None):
        refuse("give one of --runs N or --one-thread DIR ...")
    if args.runs is not None and not 1 <= args.runs <= MAX_RUNS:
        refuse(f"--runs {args.runs}: must be 1 to {MAX_RUNS}")
    if args.out is not None and (args.one_thread is not None or args.out.exists() and not args.out.is_dir()):
        refuse(f"--out {args.out}: must be a directory, and only with --runs")
    if not args.config.is_file():
        refuse(f"--config {args.config}: not a regular file")
    try:
        config = yaml.safe_load(args.config.read_text())
        check(config)
        two = profile_dir(args.profile, "--profile")
        given = [profile_dir(path, "--one-thread") for path in args.one_thread or []]
    except (ConfigError, yaml.YAMLError, ValueError) as error:
        print(f"bench_check_swing: {str(error).splitlines()[0]}", file=sys.stderr)
        return 2
    try:
        runs = measured_runs(two, given, args, config)
    except (ValueError, RuntimeError) as error:
        print(f"bench_check_swing: {str(error).splitlines()[0]}", file=sys.stderr)
        return 2
    for label, key in (("in the profile's window", "summary"), ("as run", "summary_as_run")):
        within = [run[key]["within_goal"] for run in runs if run[key]]
        if within:
            print(f"\ncells within the goal over {len(within)} runs, {label}: {min(within)} to {max(within)} "
                  f"(median {statistics.median(within)})", end="")
    print()
    print("\n".join(call_ranges(runs)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
