"""Where a pipeline run's time went: each stage's wall and CPU time from the run's benchmark files.

    .venv/bin/python benchmarks/bench_pipeline.py [RESULTS_DIR] [--json]

Snakemake writes one TSV per job under RESULTS_DIR/benchmarks (default `results`): `s` is the job's
wall time, `cpu_time` the CPU seconds of the job and its children. A stage is the folder a job's file
sits in (`sweep`, `capacity`, `machines/t4/fleet`, ...) or, for a single job, its file name without a
machine fingerprint (`profile`, `validate`). The measuring stages (profile, validation replay) run alone
on every core; everything else is simulation or rendering, whose CPU time is what the simulation goal
counts. Wall times of jobs that ran side by side add up to more than the run's wall time.

Then the critical path: when each job ran, from its benchmark file (snakemake writes it as the job ends:
the file's modification time is the end, minus `s` the start), the measuring stages that run alone, in
the order they ran, and for each what ran beside it (jobs that overlap it, and their CPU seconds within
it); then what ran before the first and after the last. The run's span is the first start to the last
end. Read it from the run's own tree: a copy that did not keep the files' times has no timeline.
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
# The measuring stages that take every core and run alone, one after another: the run's critical path.
# The serving-memory probe reads resident memory, not a clock, and runs beside the simulations.
ALONE = tuple(stage for stage in MEASURING if stage != "serving_memory")
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


def job_intervals(results: Path) -> list[dict]:
    """Every job's stage, start, end (seconds since the first start), wall and CPU seconds."""
    root = results / "benchmarks"
    jobs = []
    for path in sorted(root.rglob("*.tsv")):
        job = read_job(path)
        end = path.stat().st_mtime
        jobs.append({"stage": stage_of(path, root), "start": end - job["wall_s"], "end": end, **job})
    zero = min((job["start"] for job in jobs), default=0.0)
    for job in jobs:
        job["start"] -= zero
        job["end"] -= zero
    return sorted(jobs, key=lambda job: job["start"])


def critical_path(jobs: list[dict]) -> dict:
    """The alone-measuring jobs in the order they ran, each with what ran beside it, and the stretches
    before the first and after the last (see the module docstring)."""
    alone = [job for job in jobs if job["stage"].split("/")[0] in ALONE]
    others = [job for job in jobs if job not in alone]

    def beside(start: float, end: float) -> dict:
        overlapping = [job for job in others if job["start"] < end and job["end"] > start]
        # a job's CPU seconds counted in proportion to the share of its wall time inside the stretch
        cpu = sum(job["cpu_s"] * (min(end, job["end"]) - max(start, job["start"])) / job["wall_s"]
                  for job in overlapping if job["wall_s"] > 0)
        return {"jobs": len(overlapping), "cpu_s": cpu,
                "stages": sorted({job["stage"].split("/")[0] for job in overlapping})}

    span = max((job["end"] for job in jobs), default=0.0)
    serial = [{"stage": job["stage"], "start": job["start"], "end": job["end"], "wall_s": job["wall_s"],
               "beside": beside(job["start"], job["end"])} for job in alone]
    first = alone[0]["start"] if alone else span
    last = max((job["end"] for job in alone), default=0.0)
    overlaps = sum(1 for a, b in zip(alone, alone[1:]) if b["start"] < a["end"])
    return {"span_s": span, "alone": serial, "alone_wall_s": sum(job["wall_s"] for job in alone),
            "alone_overlapping_pairs": overlaps,
            "before_first": {"wall_s": first, "beside": beside(0.0, first)},
            "after_last": {"wall_s": max(0.0, span - last), "beside": beside(last, span)}}


def print_critical_path(path: dict) -> None:
    print(f"\nCritical path: the run spanned {path['span_s']:.0f} s, of which {path['alone_wall_s']:.0f} s in "
          f"the measuring stages that run alone ({'in series' if not path['alone_overlapping_pairs'] else str(path['alone_overlapping_pairs']) + ' pairs overlapping'})")
    print(f"{'stretch':<34} {'start s':>8} {'wall s':>8} {'jobs beside':>12} {'their CPU s':>12}  stages beside")
    rows = [("before the first", 0.0, path["before_first"]["wall_s"], path["before_first"]["beside"])]
    rows += [(job["stage"], job["start"], job["wall_s"], job["beside"]) for job in path["alone"]]
    last = max((job["end"] for job in path["alone"]), default=0.0)
    rows.append(("after the last", last, path["after_last"]["wall_s"], path["after_last"]["beside"]))
    for name, start, wall, beside in rows:
        print(f"{name:<34} {start:>8.0f} {wall:>8.0f} {beside['jobs']:>12} {beside['cpu_s']:>12.0f}  "
              f"{', '.join(beside['stages'])}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="?", default="results", type=Path)
    parser.add_argument("--json", action="store_true", help="print the table as JSON")
    args = parser.parse_args(argv)
    try:
        table = stage_table(args.results)
        path = critical_path(job_intervals(args.results))
    except (OSError, ValueError, KeyError) as error:
        print(f"bench_pipeline: {error}", file=sys.stderr)
        return 2
    simulation = [row for row in table if not row["measuring"]]
    totals = {"simulation_cpu_s": sum(r["cpu_s"] for r in simulation),
              "simulation_wall_s": sum(r["wall_s"] for r in simulation),
              "measuring_wall_s": sum(r["wall_s"] for r in table if r["measuring"])}
    if args.json:
        print(json.dumps({"stages": table, "totals": totals, "critical_path": path}, indent=1))
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
    print_critical_path(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
