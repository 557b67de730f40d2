"""A disturbed minute costs one round, not the run: profile and fit this machine twice, quiet and with a
CPU burner (a process spinning on every core) started in the middle of the profile, and compare.

    .venv/bin/python benchmarks/bench_disturb.py [--config config.yaml] [--burn-s SECONDS] [--today-s SECONDS]

For each run it prints the held-out error of the fit (MAPE, goal config fit.mape_goal), the headline
interval, the profile's duration and what the profiler measured again (machine.json `remeasure`).

The headline interval is the prefill speed-up: the factor by which prefill must shrink for the prompts
alone to meet the TTFT percentile, as fitted and at the slowest and fastest speed the profile measured
(servingplan.plan.planner.prefill_floor over the config's workload draws, on the cost model and its
speed-band models, as planner._routes computes it). On this machine no configuration meets the TTFT
target (its prefill alone is slower), so that is the interval the report's first screen leads with; it
is also the interval a disturbance widens first, since it reads the speed band straight off the
profile's speed trace (the disturbed run in issue 20 showed 16-64x).

Goals, from issue 20: with the burner, held-out error within the goal and each end of the headline
interval within +-20% of the quiet run's; quiet, the profile no longer than today's (`--today-s`, the
duration of today's quiet profile, if given).

The burner runs `--burn-s` seconds (default 60, or a third of the quiet profile's duration when that is
shorter, so a smoke run still has quiet time around it), starting when the quiet run's duration minus
the burn has half elapsed: the middle of the profile. With config/quick.yaml (the tiny 2-layer model)
the whole benchmark is a smoke run of the machinery of about a minute; it is no measurement. Run the
default config on a quiet machine only. Exits 0 whether or not the goals are met (the benchmark
reports, it does not judge); 2 on bad input.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from servingplan.config import ConfigError, check
from servingplan.fit.step_model import fit_profile  # noqa: E402
from servingplan.plan.planner import prefill_floor, traces  # noqa: E402
from servingplan.profile.measure import run_profile  # noqa: E402
from servingplan.seeds import simulation_seeds  # noqa: E402
from servingplan.simulate.capacity import speed_band_models  # noqa: E402

INTERVAL_GOAL = 0.20
BURN_S = 60.0
SPIN = "import time\nend = time.monotonic() + {seconds}\nwhile time.monotonic() < end:\n    pass\n"


class Burner:
    """One spinning process per logical core for `seconds`, started after `delay_s`."""

    def __init__(self, delay_s: float, seconds: float):
        self.seconds = seconds
        self.processes: list[subprocess.Popen] = []
        self.started_at = None
        self.timer = threading.Timer(delay_s, self.start)

    def start(self) -> None:
        self.started_at = time.perf_counter()
        self.processes = [subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=self.seconds)])
                          for _ in range(os.cpu_count())]

    def stop(self) -> None:
        self.timer.cancel()
        for process in self.processes:
            process.kill()
            process.wait()


def headline(cost, config: dict) -> dict:
    """The prefill speed-up interval: value as fitted, low and high over the speed band."""
    slo = config["slo"]
    draws = traces(config["workload"], simulation_seeds(config))
    models = [cost, *speed_band_models(cost).values()]
    factors = [max(1.0, prefill_floor(model, draws, slo["ttft_percentile"])["floor_ms"] / float(slo["ttft_ms"]))
               for model in models]
    return {"value": factors[0], "low": min(factors), "high": max(factors)}


def profile_and_fit(config: dict, burner: Burner | None) -> dict:
    started = time.perf_counter()
    if burner:
        burner.timer.start()
    try:
        profile = run_profile(config["profile"], config["model"], config["seed"], progress=False)
    finally:
        if burner:
            burner.stop()
    fit = fit_profile(profile.points, profile.samples, profile.meta, config["fit"]["holdout_fraction"],
                      config["fit"]["mape_goal"], config["seed"])
    remeasure = profile.meta["remeasure"]
    return {"heldout_mape": fit.report["heldout_mape"], "headline": headline(fit.cost_model, config),
            "profile_s": profile.meta["wall_time_s"], "remeasure": remeasure,
            "speed_moved_pct": profile.meta["speed"]["moved_pct"],
            "all_readings_moved_pct": profile.meta["speed"]["all_readings_moved_pct"],
            "burner_at_s": None if burner is None or burner.started_at is None else burner.started_at - started}


def line(name: str, run: dict, goal: float) -> str:
    h, r = run["headline"], run["remeasure"]
    burner = f", burner from {run['burner_at_s']:.0f} s" if run["burner_at_s"] is not None else ""
    return (f"{name:7s} held-out MAPE {run['heldout_mape']:.2%} ({'within' if run['heldout_mape'] <= goal else 'MISSED'} "
            f"{goal:.0%})  prefill speed-up {h['value']:.2f}x [{h['low']:.2f}-{h['high']:.2f}]  "
            f"profile {run['profile_s']:.0f} s{burner}\n"
            f"        speed moved {run['speed_moved_pct']:.0f}% over the band ({run['all_readings_moved_pct']:.0f}% over "
            f"every reading); {len(r['disturbed_readings'])} disturbed readings; re-measured {r['n_remeasured']} "
            f"and {r['n_extra_rounds']} extra rounds of a budget of {r['budget']}"
            + ("; budget exhausted" if r["budget_exhausted"] else ""))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("config.yaml"))
    parser.add_argument("--burn-s", type=float, default=None, help=f"burner duration (default {BURN_S:g} s)")
    parser.add_argument("--today-s", type=float, default=None, help="today's quiet profile duration to compare")
    args = parser.parse_args(argv)
    try:
        config = yaml.safe_load(args.config.read_text())
        check(config)
        if args.burn_s is not None and not 0 < args.burn_s < 3600:
            raise ValueError(f"--burn-s {args.burn_s}: must be above 0 and below 3600 seconds")
    except (OSError, ValueError, ConfigError) as err:
        print(f"bench_disturb: {err}", file=sys.stderr)
        return 2
    goal = config["fit"]["mape_goal"]
    quiet = profile_and_fit(config, None)
    print(line("quiet", quiet, goal), flush=True)
    burn_s = args.burn_s if args.burn_s is not None else min(BURN_S, quiet["profile_s"] / 3)
    disturbed = profile_and_fit(config, Burner(max(quiet["profile_s"] - burn_s, 0.0) / 2, burn_s))
    print(line("burner", disturbed, goal))

    ends = {end: disturbed["headline"][end] / quiet["headline"][end] - 1 for end in ("low", "value", "high")}
    print(f"\nwith the burner ({burn_s:.0f} s): held-out MAPE {disturbed['heldout_mape']:.2%} "
          f"({'within' if disturbed['heldout_mape'] <= goal else 'MISSED'} {goal:.0%}); headline interval vs quiet: "
          + ", ".join(f"{end} {change:+.1%}" for end, change in ends.items())
          + f" ({'within' if all(abs(c) <= INTERVAL_GOAL for c in ends.values()) else 'MISSED'} +-{INTERVAL_GOAL:.0%})")
    if args.today_s:
        print(f"quiet profile {quiet['profile_s']:.0f} s vs today's {args.today_s:.0f} s: "
              f"{'no longer' if quiet['profile_s'] <= args.today_s else 'LONGER'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
