"""Validation's two jobs and the serving memory file, in the shared quick pipeline run."""
import json

import yaml

from test_pipeline import QUICK, edited, planned_rules, snakemake
from servingplan.engine.memory_probe import fit_caps, resident_at


def test_a_simulator_edit_reruns_the_comparison_but_not_the_real_time_replay(quick_pipeline):
    pipeline = quick_pipeline[0]
    # a real edit: Snakemake compares content, so touching the file alone changes nothing
    with edited(pipeline / "servingplan" / "simulate" / "simulator.py", "\n# edited\n"):
        rules = planned_rules(pipeline)
    assert "validate" in rules and "validate_replay" not in rules
    assert "profile" not in rules


def test_the_replay_gives_the_comparison_findings_with_directions(quick_pipeline):
    pipeline = quick_pipeline[0]
    meta = json.loads((pipeline / "results/validation/validation.json").read_text())
    replay = json.loads((pipeline / "results/validation/replay.json").read_text())
    assert [t["load_fraction"] for t in replay["traces"]] == [t["load_fraction"] for t in meta["traces"]]
    findings = meta["findings"]
    for gap in findings["requests"]:
        assert gap["direction"] in ("optimistic", "pessimistic", "mixed", "not measured")
        assert len(gap["diff_pct"]) == len(gap["loads"]) == gap["judged"]
    for row in meta["corrections"]:
        assert row["status"] in ("applied", "contradicted", "no closer", "no evidence", "no steps")
        assert (row["applied_factor"] == 1.0) == (row["status"] != "applied")
    console = quick_pipeline[1].stdout + quick_pipeline[1].stderr
    assert "validate: trace 1 of 2:" in console
    # a line per batch of finished requests (on a busy machine a trace may be cut before any finished)
    if any(not t["skipped"] and t["measured_finished"] for t in meta["traces"]):
        assert "requests finished" in console
    for trace in meta["traces"]:
        if trace["skipped"]:
            assert f"({trace['load_fraction']:g} x the service rate) skipped" in console
        elif trace["measured_truncated"]:
            assert "truncated at" in console


def test_serving_memory_measures_each_policy_at_the_fitted_and_checked_caps_and_fits_its_line(quick_pipeline):
    pipeline = quick_pipeline[0]
    snakemake(pipeline, "results/validation/serving_memory.json")
    config = yaml.safe_load((pipeline / QUICK).read_text())
    memory = json.loads((pipeline / "results/validation/serving_memory.json").read_text())
    assert set(memory) == {"rows", "model", "check", "method", "profiler_peak_rss_bytes"}
    fitted, check = fit_caps(config["sweep"]["caps"])
    measured = sorted([*fitted, *([check] if check is not None else [])])
    assert [(row["policy"], row["cap"]) for row in memory["rows"]] == sorted(
        (policy, cap) for policy in config["sweep"]["policies"] for cap in measured)
    assert memory["model"]["caps"] == fitted and set(memory["model"]["policies"]) == set(config["sweep"]["policies"])
    machine = json.loads((pipeline / "results/profile").glob("*/machine.json").__next__().read_text())
    assert memory["profiler_peak_rss_bytes"] == machine["memory"]["peak_rss_bytes"]
    for row in memory["rows"]:
        assert set(row) == {"policy", "cap", "peak_rss_bytes", "sequences", "context_tokens", "use", "probe_policy"}
        assert row["sequences"] == row["cap"] and row["peak_rss_bytes"] > 0
        # a shared probe is another swept policy's at the same cap, with that row's very reading
        probe = next(r for r in memory["rows"] if (r["policy"], r["cap"]) == (row["probe_policy"], row["cap"]))
        assert probe["probe_policy"] == probe["policy"] and probe["peak_rss_bytes"] == row["peak_rss_bytes"]
        assert row["use"] == ("fit" if row["cap"] in fitted else "check")
        # every (policy, cap) the decision reads: measured where it was, else the policy's line
        for cap in config["sweep"]["caps"]:
            assert resident_at(memory, row["policy"], cap)["basis"] == ("measured" if cap in measured else "model")


def _span(log):
    stamps = dict(line.split(" ", 1) for line in log.read_text().splitlines()
                  if line.startswith(("started_unix ", "finished_unix ")))
    return float(stamps["started_unix"]), float(stamps["finished_unix"])


def test_the_measurements_run_before_every_simulation_and_memory_probe(quick_pipeline):
    """The replay right after the profile, then the 1-thread profile; every simulation cell, Exercise 2
    and memory probe starts after both have finished (the replay would otherwise wait behind them)."""
    pipeline = quick_pipeline[0]
    logs = pipeline / "results/logs"
    replay, one_thread = _span(logs / "validate_replay.log"), _span(logs / "profile_one_thread.log")
    assert replay[1] <= one_thread[0]
    after = [logs / "exercise2.log", *logs.glob("*/sweep/*.log"), *logs.glob("*/capacity/*.log"),
             *logs.glob("*/fleet/*.log"), *logs.glob("*/chunks/*.log"), logs / "serving_memory.log"]
    assert len(after) > 20
    for log in after:
        assert _span(log)[0] >= one_thread[1], log


def test_a_rerun_measurement_reruns_none_of_the_jobs_ordered_after_it(quick_pipeline):
    pipeline = quick_pipeline[0]
    for measurement, downstream in (("validate_replay", "validate"), ("profile_one_thread", "carry_over_check")):
        out = snakemake(pipeline, "-n", "--quiet", "rules", "--forcerun", measurement)
        rules = {line.split()[0] for line in out.stdout.splitlines() if len(line.split()) == 2}
        assert {measurement, downstream} <= rules, out.stdout
        assert not rules & {"sweep_cell", "capacity_cell", "fleet_cell", "chunk_cell", "exercise2",
                            "serving_memory"}, rules
