"""Where a pipeline run's time went: each stage's wall and CPU time from the run's benchmark files.

    .venv/bin/python benchmarks/bench_pipeline.py [RESULTS_DIR] [--json]

Snakemake writes one TSV per job under RESULTS_DIR/benchmarks (default `results`): `s` is the job's
wall time, `cpu_time` the CPU seconds of the job and its children. A stage is the folder a job's file
sits in (`sweep`, `capacity`, `machines/t4/fleet`, ...) or, for a single job, its file name without a
machine fingerprint (`profile`, `validate`). The measuring stages (profile, validation replay) run alone
on every core; everything else is simulation or rendering, whose CPU time is what the simulation goal
counts. Wall times of jobs that ran side by side add up to more than the run's wall time.
"""
from __future__ import annotations

import argparse
import csv
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

# Stages that measure this machine (the profile, the real-time replay, the serving-memory probes, the
# carry-over check's 1-thread profile, and with engine: llamacpp llama.cpp's profile, server terms and replay): they are
# not simulation. llama.cpp's profile times short-lived tool processes, whose CPU snakemake's benchmark
# mostly misses: read its wall time.
MEASURING = ("profile", "validate_replay", "serving_memory", "profile_one_thread", "llamacpp_profile",
             "llamacpp_server_terms", "llamacpp_validate_replay")
# profile_<fingerprint>.tsv: the profile's file is named by the machine's fingerprint (hex digits)
FINGERPRINTED = re.compile(r"profile_[0-9a-f]+")


def stage_of(path: Path, root: Path) -> str:
    relative = path.relative_to(root)
    if len(relative.parts) > 1:
        return "/".join(relative.parts[:-1])
    stem = relative.stem
    # the fingerprint names the machine, not the stage
    return "profile" if FINGERPRINTED.fullmatch(stem) else stem


def read_job(path: Path) -> dict:
    with path.open(newline="") as handle:
        rows = list(csv.DictReader(handle, delimiter="\t"))
    if not rows:
        raise ValueError(f"{path}: no benchmark row")
    row = rows[-1]  # a rerun appends nothing: snakemake rewrites the file; the last row is this run's
    return {"wall_s": float(row["s"]), "cpu_s": float(row.get("cpu_time") or 0.0),
            "max_rss_mb": float(row.get("max_rss") or 0.0) if row.get("max_rss") not in ("", "NA") else 0.0}


def stage_table(results: Path) -> list[dict]:
    root = results / "benchmarks"
    if not root.is_dir():
        raise FileNotFoundError(f"{root} is not a folder: run the pipeline first")
    stages: dict[str, dict] = defaultdict(lambda: {"jobs": 0, "wall_s": 0.0, "cpu_s": 0.0, "max_rss_mb": 0.0})
    for path in sorted(root.rglob("*.tsv")):
        job, stage = read_job(path), stages[stage_of(path, root)]
        stage["jobs"] += 1
        stage["wall_s"] += job["wall_s"]
        stage["cpu_s"] += job["cpu_s"]
        stage["max_rss_mb"] = max(stage["max_rss_mb"], job["max_rss_mb"])
    return [{"stage": name, **figures, "measuring": name.split("/")[0] in MEASURING}
            for name, figures in sorted(stages.items())]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="?", default="results", type=Path)
    parser.add_argument("--json", action="store_true", help="print the table as JSON")
    args = parser.parse_args(argv)
    try:
        table = stage_table(args.results)
    except (OSError, ValueError, KeyError) as error:
        print(f"bench_pipeline: {error}", file=sys.stderr)
        return 2
    simulation = [row for row in table if not row["measuring"]]
    totals = {"simulation_cpu_s": sum(r["cpu_s"] for r in simulation),
              "simulation_wall_s": sum(r["wall_s"] for r in simulation),
              "measuring_wall_s": sum(r["wall_s"] for r in table if r["measuring"])}
    if args.json:
        print(json.dumps({"stages": table, "totals": totals}, indent=1))
        return 0
    print(f"{'stage':<34} {'jobs':>5} {'wall s':>9} {'CPU s':>9} {'max RSS MB':>11}")
    for row in table:
        mark = " (measures)" if row["measuring"] else ""
        print(f"{row['stage'] + mark:<34} {row['jobs']:>5} {row['wall_s']:>9.1f} {row['cpu_s']:>9.1f} "
              f"{row['max_rss_mb']:>11.0f}")
    print(f"{'simulation and rendering, all':<34} {sum(r['jobs'] for r in simulation):>5} "
          f"{totals['simulation_wall_s']:>9.1f} "
          f"{totals['simulation_cpu_s']:>9.1f}")
    print(f"{'measuring stages, all':<34} {'':>5} {totals['measuring_wall_s']:>9.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
