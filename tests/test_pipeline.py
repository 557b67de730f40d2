"""The real pipeline, end to end, on the quick configuration, in a scratch copy of the repository."""
import contextlib
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from markupsafe import escape

from servingplan.plan import names
from servingplan.report import blocks

ROOT = Path(__file__).resolve().parent.parent
QUICK = "config/quick.yaml"
HERE = "results/machines/here"  # this machine's simulations and plan


def snakemake(workdir: Path, *args, configfile=QUICK, check=True):
    # the timeout only stops a hung run: on a shared, busy machine the quick run took over 15 minutes
    proc = subprocess.run([sys.executable, "-m", "snakemake", "--cores", "2", *args, "--configfile", configfile],
                          cwd=workdir, capture_output=True, text=True, timeout=1800)
    if check and proc.returncode != 0:
        pytest.fail(f"snakemake {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def planned_rules(workdir: Path, configfile=QUICK) -> set:
    """Rules a dry run would execute."""
    out = snakemake(workdir, "-n", "--quiet", "rules", configfile=configfile).stdout
    rules = set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit() and parts[0] not in ("total", "job"):
            rules.add(parts[0])
    return rules


def copy_repository(workdir: Path) -> Path:
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (workdir / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, workdir / name)
    return workdir


@contextlib.contextmanager
def edited(path: Path, addition: str):
    """`path` with `addition` appended, then restored with its old content and times, so that the
    results the other tests share stay up to date."""
    original, stamp = path.read_text(), path.stat()
    path.write_text(original + addition)
    try:
        yield
    finally:
        path.write_text(original)
        os.utime(path, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))


@pytest.fixture
def pipeline(quick_pipeline):
    return quick_pipeline[0]


def test_full_run_writes_the_report_and_every_stage_output(pipeline):
    for name in ["results/report/report.html", "results/report/report.md", "results/report/provenance.json",
                 "results/fit/costmodel.json", f"{HERE}/latency.csv", f"{HERE}/chunk_sweep.csv",
                 f"{HERE}/capacity.csv", f"{HERE}/memory.csv", f"{HERE}/recommendation.json",
                 "results/plan/decision.json", "results/exercise2/answers.json",
                 "results/validation/comparison.csv"]:
        assert (pipeline / name).stat().st_size > 0, name
    assert not list(pipeline.glob("results/**/*.tmp"))


def test_the_report_gives_each_hardware_target_its_verdicts_as_a_roofline_estimate(pipeline):
    config = yaml.safe_load((pipeline / QUICK).read_text())
    verdicts = json.loads((pipeline / "results/plan/hardware_verdicts.json").read_text())["targets"]
    assert [t["name"] for t in verdicts] == [t["name"] for t in config["hardware"]] and verdicts
    html = (pipeline / "results/report/report.html").read_text()
    md = (pipeline / "results/report/report.md").read_text()
    for target in verdicts:
        assert {row["target"] for row in target["recommendation"]["verdict"]} == {"latency", "capacity", "memory", "cost"}
        # named by its display name (its description, or its name made readable), never its config name
        shown = names.display(target["name"], config["hardware"])
        heading = ": an estimate from the roofline, not a measurement"
        assert f"### {blocks.md(shown)}{heading}" in md and f">{escape(shown)}{heading}</h3>" in html
        assert f"### {target['name']}" not in md


def test_the_carry_over_checked_in_the_run_is_quoted_on_the_first_screen_and_tabulated(pipeline):
    check = json.loads((pipeline / "results/check/carry_over_check.json").read_text())
    one_thread = json.loads((pipeline / "results/check/one_thread/machine.json").read_text())
    assert (check["threads_target"], one_thread["machine"]["threads"]) == (1, 1) and check["threads_here"] >= 2
    config = yaml.safe_load((pipeline / QUICK).read_text())
    cells = len(config["sweep"]["policies"]) * len(config["sweep"]["caps"])
    assert len(check["rows"]) == 2 * cells
    summary = check["summary"]
    assert summary["cells"] + summary["uncompared"] == len(check["rows"])
    md = (pipeline / "results/report/report.md").read_text()
    first_screen = md.split("## Summary", 1)[1].split("\n## ", 1)[0]
    quoted = f"put {summary['within_goal']} of {summary['cells']} capacity estimates within ±15%"
    assert "How far the estimated machines can be trusted" in first_screen and quoted in first_screen
    # the profile read the check's references at 1 thread in its window, and the report says how the model compared
    window = check["window"]
    assert window["read"] and window["readings"] == config["profile"]["rounds"] + 1
    assert "as long as the profile's window did" in first_screen
    said = "by both ratios" if len(window["corrected"]) == 2 else f"within {window['sigmas']:g} standard errors of one"
    assert said in first_screen
    assert md.count("| Capacity | Configuration | Measured at 1 thread | Estimated | Error |") == 1
    assert "(../check/carry_over_check.json)" in md  # the table links its data file
    # why: every call compared, and the one missed most named with both ratios
    assert md.count("| Call | Here, ") == 1 and len(check["calls"]) == 8
    worst = check["worst_call"]
    assert f"The largest miss is {'a decode step of' if worst['kind'] == 'decode' else 'a prefill of'} {worst['size']}" in md


def test_no_two_sentences_of_the_run_report_run_together(pipeline):
    # the unit scenarios of test_report do not reach every branch a real run takes (no speed-up clears the
    # latency floor, no swept cap keeps up in Exercise 2): a conditional's sentence ending at its endif ran
    # into the next with no space
    from test_report import prose_lines
    md = (pipeline / "results/report/report.md").read_text()
    for line in prose_lines(md):
        assert re.findall(r"[A-Za-z0-9)%]\.[A-Z]", line) == [], line[:200]


def test_the_console_shows_each_long_stages_progress_and_no_empty_shell_commands(quick_pipeline):
    console = quick_pipeline[1].stdout + quick_pipeline[1].stderr
    assert "Shell command" not in console  # every rule runs a script: there is no shell command to show
    assert re.search(r"profile: +100%", console)
    assert "validate: trace 1 of 2:" in console
    # the path check runs in the traces' idle gaps, and what is left of it after them has its own line: on
    # a quiet machine the gaps can hold all of it
    replay = json.loads((quick_pipeline[0] / "results/validation/replay.json").read_text())
    assert ("validate: timing engine steps" in console) == (replay["stage_s"]["path_check_after_s"] > 0)


def test_noop_rerun_does_nothing(pipeline):
    assert planned_rules(pipeline) == set()


def test_snakemake_report_shows_the_key_outputs_with_their_captions(pipeline):
    # snakemake's own HTML report is pure Python (no system package), so nothing here is skipped
    snakemake(pipeline, "--report", "results/snakemake_report.html")
    page = (pipeline / "results/snakemake_report.html").read_text()
    for name in ("report.html", "report.md", "recommendation.json", "latency.csv", "capacity.csv", "memory.csv",
                 "costmodel.json", "predicted_vs_measured.csv", "comparison.csv", "answers.json", "workload.json",
                 "workload.png", "capacity.png"):
        assert name in page, name
    for caption in sorted((ROOT / "reports" / "captions").glob("*.rst")):
        first_line = caption.read_text().splitlines()[0]
        assert first_line in page, caption.name


def test_price_change_reruns_only_recommend_and_report(pipeline):
    config = yaml.safe_load((pipeline / QUICK).read_text())
    config["cost"]["price_per_hour"] = 2.5
    (pipeline / "config" / "pricier.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    assert planned_rules(pipeline, configfile="config/pricier.yaml") == {"recommend", "decide", "report", "all"}


def planned_jobs(workdir: Path, configfile=QUICK) -> dict:
    """Jobs per rule a dry run would execute."""
    out = snakemake(workdir, "-n", "--quiet", "rules", configfile=configfile).stdout
    return {parts[0]: int(parts[1]) for parts in map(str.split, out.splitlines())
            if len(parts) == 2 and parts[1].isdigit() and parts[0] not in ("total", "job")}


def test_the_decision_judges_every_machine_and_names_the_pick_or_the_closest(pipeline):
    config = yaml.safe_load((pipeline / QUICK).read_text())
    decision = json.loads((pipeline / "results/plan/decision.json").read_text())
    machines = ["here", *(t["name"] for t in config["hardware"])]
    assert [m["machine"] for m in decision["machines"]] == machines
    assert (decision["pick"] is None) != (decision["closest"] is None)
    options = decision["options"]
    assert {o["machine"] for o in options} == set(machines)
    assert all(o["replicas"] <= config["cost"]["max_replicas"] for o in options)
    # meets all four first, then every defined cost before none, then fewest misses, dear end, fewer replicas
    ranks = [(not o["meets_all"], o["usd_per_1k"]["high"] is None, len(o["misses"]),
              o["usd_per_1k"]["high"] or 0.0, o["replicas"]) for o in options]
    assert ranks == sorted(ranks) and [o["rank"] for o in options] == list(range(1, len(options) + 1))
    assert all(o["usd_per_1k"]["high"] is None for o in options if not o["stable"])
    table = pd.read_csv(pipeline / "results/plan/options.csv")
    assert list(table["rank"]) == [o["rank"] for o in options]
    for option in options:
        assert set(option["verdicts"]) == {"latency", "capacity", "memory", "cost"}
        capacity = option["verdicts"]["capacity"]
        if capacity["low"] is not None and capacity["low"] < config["slo"]["capacity_target_rate"]:
            assert not capacity["pass"]
        assert option["misses"] == [t for t in ("latency", "capacity", "memory", "cost") if not option["verdicts"][t]["pass"]]
    assert set(decision["routes"]) == {"prefill_speedup", "replicas_to_keep_up", "replicas_usd_per_1k",
                                       "cheapest_mix"}


def test_a_new_cap_and_target_plan_only_their_cells_and_what_aggregates_them(pipeline):
    config = yaml.safe_load((pipeline / QUICK).read_text())
    policies, caps = config["sweep"]["policies"], config["sweep"]["caps"]
    machines = 1 + len(config["hardware"])
    config["sweep"]["caps"] = sorted({*caps, 8})
    config["hardware"].append({"name": "bigger-cpu", "bandwidth_gbs": 200, "gflops": 2000})
    (pipeline / "config" / "grown.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    jobs = planned_jobs(pipeline, configfile="config/grown.yaml")
    # the new cap on every machine so far, and every cap of the new target; no other cell
    new_cells = machines * len(policies) + len(policies) * len(config["sweep"]["caps"])
    for rule in ("sweep_cell", "capacity_cell", "fleet_cell"):
        assert jobs.pop(rule) == new_cells, rule
    assert jobs.pop("chunk_cell") == 1  # this machine's chunk comparison, at the new cap
    assert jobs.pop("carry_over") == 1
    for rule in ("collect", "memory", "recommend"):
        assert jobs.pop(rule) == machines + 1, rule
    # each machine's cap searches start from its grid's verdicts, which the new cap adds to
    assert jobs.pop("cap_search") == (machines + 1) * len(policies)
    assert {rule: jobs.pop(rule) for rule in ("collect_chunks", "decide", "report", "all")} == dict.fromkeys(
        ("collect_chunks", "decide", "report", "all"), 1)
    assert not {"profile", "fit", "workload", "exercise2"} & set(jobs)
    # the serving memory, whose caps measured follow the swept caps (one job, a forked probe per cap); the
    # report's findings
    assert {rule: jobs.pop(rule) for rule in ("serving_memory", "findings")} == {"serving_memory": 1, "findings": 1}
    # the carry-over check compares every cell: it searches the new cap's too, on the 1-thread profile it has
    assert jobs.pop("carry_over_check") == 1 and "profile_one_thread" not in jobs
    # the real-time replay serves its own cap: a new cap never re-serves it
    assert "validate_replay" not in jobs and set(jobs) <= {"validate"}


def test_the_same_config_with_its_keys_in_another_order_plans_nothing(pipeline):
    config = yaml.safe_load((pipeline / QUICK).read_text())
    (pipeline / "config" / "sorted.yaml").write_text(yaml.safe_dump(config, sort_keys=True))
    assert planned_rules(pipeline, configfile="config/sorted.yaml") == set()


def test_simulator_edit_reruns_simulation_but_not_profiling(pipeline):
    scheduler = pipeline / "servingplan" / "simulate" / "scheduler.py"
    # a real edit: Snakemake compares content, so touching the file alone changes nothing
    with edited(scheduler, "\n# edited\n"):
        rules = planned_rules(pipeline)
    assert {"sweep_cell", "chunk_cell", "capacity_cell", "fleet_cell", "carry_over_check"} <= rules
    assert not {"profile", "fit", "profile_one_thread", "fit_one_thread"} & rules


def planned_from(run_dir: Path, repository: Path, *args, cwd: Path | None = None) -> set:
    """Rules a dry run from `run_dir` (or with --directory run_dir from `cwd`) would execute for the
    repository's Snakefile. Only the mtime trigger: a code edit fires it, while the 'input' trigger would
    rerun everything in a copied results tree whose recorded inputs are named from the repository."""
    location = ["--directory", str(run_dir)] if cwd else []
    proc = subprocess.run([sys.executable, "-m", "snakemake", "-s", str(repository / "Snakefile"), *location,
                           "--cores", "2", "--configfile", str(repository / QUICK), "-n", "--quiet", "rules",
                           "--rerun-triggers", "mtime", *args],
                          cwd=cwd or run_dir, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        pytest.fail(f"dry run from {run_dir} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return {parts[0] for parts in map(str.split, proc.stdout.splitlines())
            if len(parts) == 2 and parts[1].isdigit() and parts[0] not in ("total", "job")}


def test_a_simulator_edit_reruns_the_simulation_when_snakemake_runs_from_another_directory(pipeline, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(pipeline / "results", elsewhere / "results")  # copytree keeps the files' times
    assert planned_from(elsewhere, pipeline) == set()
    with edited(pipeline / "servingplan" / "simulate" / "scheduler.py", "\n# edited\n"):
        from_cwd = planned_from(elsewhere, pipeline)
        with_directory = planned_from(elsewhere, pipeline, cwd=tmp_path)
    for planned in (from_cwd, with_directory):
        assert {"sweep_cell", "chunk_cell", "capacity_cell", "fleet_cell", "collect", "report"} <= planned
        assert "profile" not in planned and "fit" not in planned


def test_a_report_template_edit_reruns_the_report_from_another_directory(pipeline, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(pipeline / "results", elsewhere / "results")
    with edited(pipeline / "reports" / "templates" / "report.text.j2", "{# edited #}\n"):
        planned = planned_from(elsewhere, pipeline)
    assert planned == {"report", "all"}


def test_simulation_outputs_are_byte_identical_on_rerun(pipeline):
    before = (pipeline / HERE / "latency.csv").read_bytes()
    cells_before = {p.name: p.read_bytes() for p in (pipeline / HERE / "capacity/cells").iterdir()}
    # the sweep cells only: sweep/chunks is this machine's chunk comparison, which this rerun does not rebuild
    for name in ("sweep/cells", "capacity", "latency.csv", "capacity.csv"):
        (shutil.rmtree if (pipeline / HERE / name).is_dir() else os.remove)(pipeline / HERE / name)
    snakemake(pipeline, f"{HERE}/latency.csv", f"{HERE}/capacity.csv")
    assert (pipeline / HERE / "latency.csv").read_bytes() == before
    assert {p.name: p.read_bytes() for p in (pipeline / HERE / "capacity/cells").iterdir()} == cells_before


def test_bad_config_stops_before_any_work_with_one_line(pipeline):
    config = yaml.safe_load((pipeline / QUICK).read_text())
    config["sweep"]["caps"] = [4, -2]
    (pipeline / "config" / "bad.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    proc = snakemake(pipeline, configfile="config/bad.yaml", check=False)
    assert proc.returncode != 0
    lines = [l for l in (proc.stdout + proc.stderr).splitlines() if "config error" in l]
    assert lines == ["config error: sweep.caps[1] = -2: must be >= 1"]


def test_the_quick_profile_measures_the_configs_grid_on_the_tiny_model(pipeline):
    config = yaml.safe_load((pipeline / QUICK).read_text())
    [machine_json] = pipeline.glob("results/profile/*/machine.json")
    machine = json.loads(machine_json.read_text())
    for key in ("prefill_lengths", "prefill_batches", "decode_batches", "decode_contexts", "rounds", "repeats",
                "reference_interval_s", "reference_decode", "reference_prefill", "probe_bytes", "gemm_size"):
        assert machine["settings"][key] == config["profile"][key], key
    assert machine["settings"]["tiny"] and not machine["settings"]["quick"]
    assert machine["model"]["n_layer"] == 2


def test_a_budget_below_the_weights_stops_before_any_work_with_one_line(pipeline):
    config = yaml.safe_load((pipeline / QUICK).read_text())
    config["memory"]["budget_gb"] = 0.0001
    (pipeline / "config" / "tight.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    proc = snakemake(pipeline, configfile="config/tight.yaml", check=False)
    assert proc.returncode != 0
    lines = [l for l in (proc.stdout + proc.stderr).splitlines() if "config error" in l]
    assert len(lines) == 1
    assert lines[0].startswith("config error: memory.budget_gb = 0.0001: must hold the weights of the tiny "
                               "2-layer GPT-2")
    assert "Traceback" not in proc.stdout + proc.stderr


def write_trace(path: Path, layout: str, rows: int = 150) -> int:
    """A logged-traffic file in a public layout, about 6 req/s, every 25th request failed (0 reply
    tokens); returns the requests it holds."""
    rng = np.random.default_rng(3)
    seconds = np.cumsum(rng.exponential(1 / 6, rows))
    prompts, replies = rng.integers(16, 500, rows), rng.integers(8, 200, rows)
    replies[7::25] = 0
    if layout == "azure":
        start = datetime.datetime(2023, 11, 16, 18, 0, 0)
        lines = [f"{(start + datetime.timedelta(seconds=float(s))).isoformat(sep=' ')},{p},{r}"
                 for s, p, r in zip(seconds, prompts, replies)]
        path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(lines) + "\n")
    else:
        path.write_text("".join(json.dumps({"Timestamp": float(s), "Model": "ChatGPT", "Request tokens": int(p),
                                            "Response tokens": int(r), "Log Type": "Conversation log"}) + "\n"
                                for s, p, r in zip(seconds, prompts, replies)))
    return int((replies > 0).sum())


def trace_run(pipeline: Path, tmp_path: Path, layout: str, name: str, **settings) -> tuple[Path, int]:
    """A copy of the quick run (the trace changes the workload, not the profile, which is kept) with a
    trace file of `layout` as its workload: (its directory, the requests the file holds). This machine
    alone, at the first cap, validated at the first load: how a trace is read, replayed and reported
    depends on none of them, and the shared run covers the targets, every cap and both loads (a cap more
    is ten simulation cells and three serving-memory probes, all made again after the trace's replay; a
    load more is one more trace served in real time)."""
    workdir = Path(shutil.copytree(pipeline, tmp_path / "run", symlinks=True))
    requests = write_trace(workdir / name, layout)
    config = yaml.safe_load((workdir / QUICK).read_text())
    config["workload"]["trace"] = {"path": name, "layout": layout, **settings}
    config["hardware"], config["carry_over_check"] = [], False
    config["sweep"]["caps"] = config["sweep"]["caps"][:1]
    config["validation"]["rates_fraction"] = config["validation"]["rates_fraction"][:1]
    (workdir / "config" / "trace.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    assert "profile" not in planned_rules(workdir, configfile="config/trace.yaml")
    return workdir, requests


def test_the_pipeline_sizes_the_service_for_an_azure_trace_and_its_report_describes_it(pipeline, tmp_path):
    name = "azure.csv"
    workdir, requests = trace_run(pipeline, tmp_path, "azure", name, too_long="clip", max_context=512)
    snakemake(workdir, configfile="config/trace.yaml")
    latency = pd.read_csv(workdir / HERE / "latency.csv")
    assert (latency["num_requests"] == requests).all()
    assert latency["seed"].nunique() == 1  # one fixed workload: more seeds would replay the same requests
    described = json.loads((workdir / "results/workload/workload.json").read_text())
    assert (described["file"], described["rows"], described["requests"]) == (name, 150, requests)
    assert described["skipped_zero_tokens"] == 150 - requests
    assert described["too_long"] == "clip" and described["too_long_requests"] > 0
    # the report describes the trace it was given, not the synthetic spec
    report = " ".join((workdir / "results/report/report.md").read_text().split())
    assert f"The workload is the trace file {name}, read in the azure layout" in report
    assert f"Of its 150 rows, {150 - requests} asked for 0 prompt or 0 reply tokens" in report
    assert (f"{described['too_long_requests']} of them needed more than the 512-token context (prompt + reply) "
            "and were clipped to fit") in report
    assert f"That leaves {requests} requests over" in report
    assert "Poisson process" not in report.split("## The workload")[1].split("## Simulation")[0]
    # the file is an input: editing it reruns every stage that reads it, and nothing that does not
    with (workdir / name).open("a") as handle:
        handle.write((workdir / name).read_text().splitlines()[-1] + "\n")
    rules = planned_rules(workdir, configfile="config/trace.yaml")
    assert {"workload", "sweep_cell", "chunk_cell", "capacity_cell", "fleet_cell", "validate", "recommend",
            "report"} <= rules
    assert not {"profile", "fit", "exercise2"} & rules


def test_the_pipeline_simulates_a_burstgpt_trace(pipeline, tmp_path):
    # the simulations and the capacity search; the stages after them read the trace as the Azure test shows
    workdir, requests = trace_run(pipeline, tmp_path, "burstgpt", "burstgpt.jsonl")
    snakemake(workdir, "results/workload/workload.json", f"{HERE}/latency.csv", f"{HERE}/capacity.csv",
              configfile="config/trace.yaml")
    latency = pd.read_csv(workdir / HERE / "latency.csv")
    assert (latency["num_requests"] == requests).all() and latency["seed"].nunique() == 1
    assert pd.read_csv(workdir / HERE / "capacity.csv")["capacity_rps"].notna().any()
    described = json.loads((workdir / "results/workload/workload.json").read_text())
    assert (described["layout"], described["rows"], described["requests"]) == ("burstgpt", 150, requests)
    assert described["columns"]["output_tokens"] == "Response tokens"
