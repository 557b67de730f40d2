"""python -m servingplan.gpu_check: check the GPU targets' estimates on a real GPU (issue 36).

    PYTHONPATH=. python3 -m servingplan.gpu_check --out DIR [--device cuda|cpu] [--tiny]
        [--carry-from results/fit/costmodel.json --machine-json results/profile/<fingerprint>/machine.json]
        [--hardware NAME]

(`make gpu-check OUT=DIR` passes this machine's fit and profile; docs/hardware.md says how to run it on a
GPU machine.) On the device, each stage printing its progress:

1. profile: the engine's prefill and decode calls, timed by the project's profiler
   (servingplan.profile.measure.run_profile) over config.yaml's own `profile` grid, with the roofline
   probes (memory bandwidth, float32 GEMM on the model's products) read through the run on the device.
   The default grid, not a reduced one: a GPT-2 small call takes milliseconds on an H100, so the whole
   grid in its rounds takes about a minute there, and it is the grid the CPU model was fitted on, so the
   two fits resolve every term from the same shapes and a term's error is the carry-over's, not the
   grids'. --tiny swaps in the tiny model and QUICK_PROFILE's grid (measure.run_profile's quick).
2. fit: the project's fit (servingplan.fit.step_model.run_fit) of the cost model to that profile.
3. host time: a decode step at batch 1 and HOST_TIME_CONTEXT cached tokens, timed HOST_TIME_REPEATS
   times, against its roofline floor at the probes' peaks; what the floor does not explain is the host's
   time per call (Python, the dispatcher, the kernel launches), set against the 2.5 ms the carry-over
   assumes (hardware.DEFAULT_GPU_LAUNCH_OVERHEAD_MS).
4. replay: one short Poisson trace at the validation's first load fraction of the measured model's
   service rate, served in real time by the project's engine on the device and simulated on the measured
   model, compared as the validation compares them (validation_replay's trace and load reference,
   engine.replay's compare and predict_steps).
5. carry-over (with --carry-from): the CPU model carried to the GPU's `hardware:` entry as the rule
   carry_over carries it (servingplan.plan.hardware.carry_over), and to the rates and host time the GPU
   measured, each compared term by term, decode batch by decode batch and call by call with the model
   measured (servingplan.gpu_check.compare).
6. capstone: p90 TTFT at today's rate and the capacity at the TTFT target on the measured model and on
   the carried one, in every configuration of the sweep (policies x caps), as the pipeline's cells compute
   them, with the seeds, SLO, workload and search settings of config.yaml (simulations: about 20 s per
   model on a 2-core machine, --tiny one seed).

It writes DIR/gpu_check.json (the contract the pipeline reads: servingplan.plan.gpu_evidence) and
DIR/gpu_check.md, with the profile, its fit and the fitted cost model beside them. It runs from the
source tree with what the GPU machine has (torch, transformers, numpy, pandas, scipy, jinja2 and
markupsafe, pyyaml, psutil, tqdm): no snakemake and no jsonschema. So config.yaml, the checked-in file
the test suite validates, is read as plain YAML, and servingplan.config (which imports jsonschema) is not
imported. Bad arguments end it with one line and exit code 2.
"""
from __future__ import annotations

import argparse
import math
import re
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import yaml

from servingplan import architecture, roofline
from servingplan.check import carry_check
from servingplan.costmodel import CostModel, read_written
from servingplan.device import model_device
from servingplan.engine.replay import compare as compare_replay
from servingplan.engine.replay import predict_steps, replay
from servingplan.fit.step_model import run_fit
from servingplan.gpu_check import compare
from servingplan.gpu_check.markdown import render_markdown
from servingplan.io import (InputError, _check_replaceable, _check_writable, parse_json, read_json,
                            read_text_input, write_json, write_text)
from servingplan.memory import kv_blocks
from servingplan.plan import hardware
from servingplan.plan.gpu_evidence import SCHEMA_VERSION, check_document, measured_basis
from servingplan.profile import machine as probes
from servingplan.profile.measure import GridPoint, point_call, pool_for, run_profile, time_call
from servingplan.profile.model import QUICK_CONFIG_OVERRIDES, RANDOM_SOURCE, load_model
from servingplan.seeds import simulation_seeds
from servingplan.simulate import simulate
from servingplan.simulate.policies import chunk_budget
from servingplan.validate.validation_replay import reference_rps, validation_traces

PROG = "gpu_check"
ROOT = Path(__file__).resolve().parent.parent.parent
CONFIG_PATH = ROOT / "config.yaml"
GPUS_PATH = ROOT / "config" / "gpus.yaml"
MAX_CONFIG_BYTES = 1 << 20
MAX_MACHINE_BYTES = 1 << 24
DEVICES = ("cuda", "cpu")
OUTPUTS = {"check": "gpu_check.json", "markdown": "gpu_check.md", "points": "profile.csv", "samples": "samples.csv",
           "machine": "machine.json", "costmodel": "costmodel.json", "fit_report": "fit_report.json",
           "predicted": "predicted_vs_measured.csv"}
# The host-time call: the least work a model call does (one sequence, a short context), so its time is
# the host's plus a floor the roofline states; enough repeats that the median is steady to a few µs.
HOST_TIME_CONTEXT = 16
HOST_TIME_WARMUP = 5
HOST_TIME_REPEATS = 50
# The replay: one trace of at least this many seconds of arrivals and this many requests (--tiny: the
# second of each), served for at most REPLAY_MAX_WALL_S (the comparison reads the requests finished by then).
REPLAY_SECONDS = (20.0, 3.0)
REPLAY_MIN_REQUESTS = (40, 8)
REPLAY_MAX_WALL_S = (120.0, 10.0)
# --tiny runs at one thread: on a shared 2-core machine a second process on the cores stalls OpenMP's threads,
# and a tiny decode step took 50 ms at 2 threads against 1.3 ms at 1; the GPU's own run keeps config.yaml's
# profile.threads (its calls wait for the GPU, not for the cores)
TINY_THREADS = 1
# the keys of an entry the rule carry_over carries to (rules/plan.smk)
CARRY_KEYS = ("name", "bandwidth_gbs", "gflops", "kind", "launch_overhead_ms")
# Board variants of one chip differ in bandwidth and clocks (an H100 PCIe: 2,000 GB/s and 51 TFLOP/s
# float32 against the SXM's 3,350 and 67), and torch names them by a word the data-sheet entry's name
# must then carry too.
VARIANT_WORDS = ("pcie", "nvl")
MEMORY_SIZE = re.compile(r"^\d+gb$")


class UsageError(Exception):
    """A bad argument, found before any measurement; its message is the whole error line."""


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{PROG}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(prog=f"python -m servingplan.{PROG}", description=(
        "Profile, fit and replay GPT-2 on a GPU and compare it with the CPU cost model carried over to that "
        "GPU by the roofline (docs/hardware.md#checking-the-estimates-on-a-gpu)."))
    parser.add_argument("--out", required=True, type=Path, help="directory for gpu_check.json, gpu_check.md and "
                                                                "the profile and fit beside them")
    parser.add_argument("--device", choices=DEVICES, default="cuda",
                        help="where the model runs (default cuda; cpu runs the whole path without a GPU)")
    parser.add_argument("--tiny", action="store_true",
                        help="the tiny 2-layer model over the quick grid: seconds, not minutes, and no GPU figure")
    parser.add_argument("--carry-from", type=Path, help="the cost model fitted on the CPU (results/fit/costmodel.json)")
    parser.add_argument("--machine-json", type=Path,
                        help="the machine.json of the profile it was fitted to (results/profile/<fingerprint>/)")
    parser.add_argument("--hardware", metavar="NAME", help="the hardware entry to carry over to (config.yaml's "
                                                           "hardware or config/gpus.yaml; default: the one matching "
                                                           "the GPU's name)")
    return parser


@dataclass
class Plan:
    """What a check measures and compares, every argument checked."""
    out: Path
    device: str
    tiny: bool
    config: dict
    device_name: str
    entry: dict | None
    matched_by: str | None
    cpu_cost: CostModel | None = None
    cpu_machine: dict | None = None
    carry_from: Path | None = None
    machine_json: Path | None = None


def say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def read_yaml(path: Path, what: str) -> dict:
    return yaml.safe_load(read_text_input(path, what, MAX_CONFIG_BYTES))


def hardware_entries() -> list[dict]:
    """Every shipped `hardware:` entry: config.yaml's targets and config/gpus.yaml's."""
    entries = (read_yaml(CONFIG_PATH, "config").get("hardware") or []) + read_yaml(GPUS_PATH, "GPU entries")["hardware"]
    names = [entry["name"] for entry in entries]
    if len(set(names)) < len(names):
        raise ValueError(f"hardware entries: a name appears twice in {CONFIG_PATH.name} and {GPUS_PATH.name}: {names}")
    return entries


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def match_entry(device_name: str, entries: list[dict]) -> dict | None:
    """The GPU entry whose name's model words (those with a digit: h100, t4) are all words of torch's
    device name ("NVIDIA H100 80GB HBM3", "Tesla T4"), memory sizes aside, and which names every board
    variant word the device name has (PCIe, NVL: VARIANT_WORDS); None unless exactly one entry matches."""
    words = set(_words(device_name))
    found = []
    for entry in entries:
        if hardware.machine_kind(entry) != "gpu":
            continue
        name_words = set(_words(entry["name"]))
        model = {w for w in name_words if any(c.isdigit() for c in w) and not MEMORY_SIZE.match(w)}
        variants = {w for w in words if w in VARIANT_WORDS}
        if model and model <= words and variants <= name_words:
            found.append(entry)
    return found[0] if len(found) == 1 else None


def planned_kv_memory(entry: dict | None, device: str) -> str:
    """How the GPU's serving engine holds KV in the capstone's cells: as the pipeline decides for a
    `hardware:` target (hardware.target_kv_memory), or by the device's kind without an entry."""
    return hardware.target_kv_memory(entry or {"kind": "gpu" if device == "cuda" else "cpu"})["model"]


def capstone_seeds(config: dict, tiny: bool) -> list[int]:
    """The workload draws of the pipeline's cells (seeds.simulation_seeds); --tiny keeps the first."""
    seeds = simulation_seeds(config)
    return seeds[:1] if tiny else seeds


def read_carry_from(cost_path: Path, machine_path: Path) -> tuple[CostModel, dict]:
    """The CPU fit and its profile's machine.json: a fit (never a model already carried over), whose
    machine fingerprint is the profile's, and a machine.json with the probe readings here_roofline reads."""
    try:
        cost = read_written(cost_path)
    except ValueError as exc:
        raise UsageError(f"--carry-from: {exc}") from None
    if "carry_over" in cost.meta or "machine_fingerprint" not in cost.meta:
        why = "was carried over to another machine" if "carry_over" in cost.meta else "names no machine_fingerprint"
        raise UsageError(f"--carry-from {str(cost_path)!r}: not a model fitted to a profile (a fit stage's "
                         f"results/fit/costmodel.json): it {why}")
    try:
        machine = parse_json(read_text_input(machine_path, "--machine-json", MAX_MACHINE_BYTES),
                             f"--machine-json {str(machine_path)!r}")
        hardware.here_roofline(machine)
        fingerprint = machine["machine"]["fingerprint"]
        roofline.architecture_of(machine["model"])
    except (KeyError, TypeError, ValueError) as exc:
        detail = str(exc) if isinstance(exc, ValueError) else f"--machine-json {str(machine_path)!r}: has no {exc}"
        raise UsageError(f"{detail}; it must be the machine.json of a profile "
                         "(results/profile/<fingerprint>/machine.json)") from None
    if fingerprint != cost.meta["machine_fingerprint"]:
        raise UsageError(f"--machine-json {str(machine_path)!r}: the profile of machine {fingerprint}, but "
                         f"--carry-from was fitted on machine {cost.meta['machine_fingerprint']}'s; pass "
                         f"results/profile/{cost.meta['machine_fingerprint']}/machine.json")
    return cost, machine


def prepare_out(out: Path) -> Path:
    """The output directory, created if missing: never a symlink (nothing is written through a link), and
    every file the check writes there replaceable (a regular file or none)."""
    if out.is_symlink():
        raise UsageError(f"--out {str(out)!r}: is a symlink; name the directory itself")
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {str(out)!r}: exists and is not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
        _check_writable(out, "--out")
        for name in OUTPUTS.values():
            _check_replaceable(out / name, "--out file")
    except InputError as exc:
        raise UsageError(str(exc)) from None
    except OSError as exc:
        raise UsageError(f"--out {str(out)!r}: cannot be created ({exc.strerror or exc})") from None
    return out


def prepare(args) -> Plan:
    """Every argument checked, cheapest first, before anything is measured; UsageError otherwise."""
    if (args.carry_from is None) != (args.machine_json is None):
        raise UsageError("--carry-from and --machine-json go together: the cost model fitted on the CPU and the "
                         "machine.json of the profile it was fitted to (the carry-over scales from its probes)")
    config = read_yaml(CONFIG_PATH, "config")
    entries = hardware_entries()
    entry = None
    if args.hardware is not None:
        entry = next((e for e in entries if e["name"] == args.hardware), None)
        if entry is None:
            raise UsageError(f"--hardware {args.hardware!r}: no such entry; the entries (config.yaml's hardware and "
                             f"config/gpus.yaml) are {', '.join(e['name'] for e in entries)}")
    cpu_cost = cpu_machine = None
    if args.carry_from is not None:
        cpu_cost, cpu_machine = read_carry_from(args.carry_from, args.machine_json)
        profiled = architecture.architecture({**config["model"], "tiny": args.tiny})
        fitted = roofline.architecture_of(cpu_machine["model"])
        if fitted != profiled:
            raise UsageError(f"--carry-from {str(args.carry_from)!r}: fitted on a model of another shape ({fitted}) "
                             f"than the one this check profiles ({profiled}{', --tiny' if args.tiny else ''})")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: torch sees no CUDA GPU on this machine (torch.cuda.is_available() is False); "
                         "use --device cpu")
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else probes.cpu_model()
    matched_by = "--hardware" if entry is not None else None
    if entry is None and args.device == "cuda":
        entry = match_entry(device_name, entries)
        matched_by = "device name" if entry is not None else None
    if entry is None and cpu_cost is not None:
        raise UsageError(f"--carry-from: no entry to carry over to: {device_name!r} matches none of the GPU entries "
                         f"({', '.join(e['name'] for e in entries if hardware.machine_kind(e) == 'gpu')}) by its "
                         "model and board; name one with --hardware")
    return Plan(prepare_out(args.out), args.device, args.tiny, config, device_name, entry, matched_by, cpu_cost,
                cpu_machine, args.carry_from, args.machine_json)


# -- the stages on the device ---------------------------------------------------------------------------

def threads_of(plan: Plan) -> int | None:
    """The torch threads the profile and the engine run at: TINY_THREADS with --tiny, else profile.threads."""
    return TINY_THREADS if plan.tiny else plan.config["profile"]["threads"]


def profile_and_fit(plan: Plan) -> tuple[CostModel, dict, dict]:
    """Stages 1 and 2: the profile's files and the fit's in the output directory, as the pipeline's
    profile and fit stages write them; (the fitted model, the profile's machine.json, the fit report)."""
    config, paths = plan.config, {key: plan.out / name for key, name in OUTPUTS.items()}
    model_cfg = {**config["model"], "device": plan.device}
    grid = "the tiny model over the quick grid" if plan.tiny else "GPT-2 over config.yaml's grid"
    say(f"profiling the engine's calls on {plan.device_name}: {grid}")
    run_profile(config["profile"], model_cfg, config["seed"], quick=plan.tiny, threads=threads_of(plan)).write(
        paths["points"], paths["samples"], paths["machine"])
    say("fitting the cost model to the profile")
    fit = run_fit(paths["points"], paths["samples"], paths["machine"], config["fit"], config["seed"],
                  paths["costmodel"], paths["fit_report"], paths["predicted"])
    return fit.cost_model, read_json(paths["machine"]), fit.report


def host_time(model, arch: dict, peak: dict, seed: int) -> dict:
    """Stage 3: the host's time per model call, a decode step of one sequence at HOST_TIME_CONTEXT cached
    tokens timed on the engine's pool (the profiler's call and timer), less its roofline floor at the
    probes' peaks: the work the GPU cannot do faster, which the roofline part of the carried terms
    already pays."""
    point = GridPoint("decode", 1, 1, HOST_TIME_CONTEXT)
    generator = torch.Generator().manual_seed(seed)
    pool = pool_for(model.config, [point], generator, model_device(model))
    call = point_call(model, pool, point, generator)
    with torch.inference_mode():
        timed = [seconds for _, seconds, _ in time_call(call, HOST_TIME_WARMUP, HOST_TIME_REPEATS, time.perf_counter())]
    floor_s, bound = roofline.floor(roofline.call_work(arch, "decode", 1, 1, HOST_TIME_CONTEXT),
                                    peak["bandwidth_gbs"], peak["gemm_gflops"])
    median = statistics.median(timed)
    deciles = statistics.quantiles(timed, n=10)
    default = hardware.DEFAULT_GPU_LAUNCH_OVERHEAD_MS / 1000.0
    host = max(median - floor_s, 0.0)
    return {"batch": 1, "context": HOST_TIME_CONTEXT, "calls": len(timed), "median_s": median,
            "p10_s": deciles[0], "p90_s": deciles[-1], "floor_s": floor_s, "bound": bound, "host_time_s": host,
            "default_s": default, "host_over_default": host / default}


def serve_replay(model, cost: CostModel, machine: dict, config: dict, tiny: bool, seed: int,
                 threads: int | None) -> dict:
    """Stage 4: one trace served in real time by the engine on the device and simulated on the measured
    model: the validation's trace at its first load fraction of the model's service rate, its policy,
    cap and the engine's KV slots (this project's engine reserves each slot's context)."""
    validation = {**config["validation"], "rates_fraction": config["validation"]["rates_fraction"][:1],
                  "trace_seconds": REPLAY_SECONDS[tiny], "min_requests": REPLAY_MIN_REQUESTS[tiny]}
    workload, sweep, memory = config["workload"], config["sweep"], {**config["memory"], "kv_memory": "slots"}
    policy, cap, chunk = validation["policy"], validation["cap"], sweep["chunk_size"]
    blocks = kv_blocks(machine, memory, cap)
    reference = reference_rps(cost, workload, cap, seed)
    fraction, rate, trace = next(validation_traces(workload, validation, reference, seed))
    say(f"replay: {len(trace)} requests at {rate:.3g} req/s ({fraction:g} x the measured service rate), "
        f"{policy} cap {cap}, served in real time")
    started = time.perf_counter()
    measured, steps = replay(trace, model, policy, cap, chunk, blocks, memory["block_size"], REPLAY_MAX_WALL_S[tiny],
                             seed, threads, chunk_budget(sweep))
    wall = time.perf_counter() - started
    simulated = simulate(trace, cost, policy, cap, chunk, blocks, memory["block_size"], sweep["horizon_factor"],
                         chunk_budget=chunk_budget(sweep))
    table = [{k: _finite(v) for k, v in row.items()} for row in compare_replay(measured, simulated).to_dict("records")]
    step_errors = predict_steps(steps, cost)["error_pct"].to_numpy(float) if len(steps) else []

    def diff(metric: str, stat: str):
        return next(row["diff_pct"] for row in table if row["metric"] == metric and row["stat"] == stat)

    return {"policy": policy, "cap": cap, "chunk_size": chunk, "load_fraction": fraction, "rate": rate,
            "requests": len(trace), "finished": int(measured.finished.sum()), "truncated": bool(measured.truncated),
            "simulated_stable": bool(simulated.stable), "wall_s": wall, "steps": len(steps),
            "step_error_pct_median": _finite(statistics.median(step_errors)) if len(step_errors) else None,
            "comparison": table, "ttft_p90_diff_pct": diff("ttft", "p90"), "tpot_mean_diff_pct": diff("tpot", "mean")}


def _finite(value):
    """A number for JSON: a NaN or infinity (a statistic of no request) becomes None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value.item() if hasattr(value, "item") else value


def carried_models(plan: Plan, measured_roofline: dict, host_s: float) -> tuple[CostModel, CostModel, dict]:
    """Stage 5's models: the CPU fit carried to the entry as the rule carry_over carries it, and to the
    rates this device's probes read (their medians, as here's side is taken) with the host time measured
    here as its launch overhead; (carried, probed, what each was carried from and to)."""
    arch = roofline.architecture_of(plan.cpu_machine["model"])
    here = hardware.here_roofline(plan.cpu_machine)
    target = {key: plan.entry[key] for key in CARRY_KEYS if key in plan.entry}
    probed_target = {"name": f"{plan.entry['name']} as measured", "kind": hardware.machine_kind(plan.entry),
                     "bandwidth_gbs": measured_roofline["seen_bandwidth_gbs"],
                     "gflops": measured_roofline["seen_gflops"]}
    if probed_target["kind"] == "gpu":
        probed_target.update(launch_overhead_ms=host_s * 1000.0, launch_overhead_basis="measured by this check")
    carried, _ = hardware.carry_over(plan.cpu_cost, arch, here, target)
    probed, _ = hardware.carry_over(plan.cpu_cost, arch, here, probed_target)
    return carried, probed, {"here": here, "target": target, "probed_target": probed_target,
                             "launch_overhead_s": carried.meta["carry_over"]["launch_overhead_s"]}


def compare_carried(plan: Plan, measured: CostModel, fit_report: dict, measured_roofline: dict, host_s: float,
                    capstone: dict) -> dict:
    """Stage 5 and the carried side of stage 6: the CPU fit carried over (carried_models) set against the
    model measured, term by term, decode batch by decode batch, call by call and cell by cell."""
    carried, probed, carried_to = carried_models(plan, measured_roofline, host_s)
    say(f"carried over from {plan.cpu_cost.name} to {plan.entry['name']}: the capstone on the carried model")
    carried_cells = compare.capstone_cells(carried, capstone["machine"], capstone["memory"], capstone["settings"],
                                           capstone["cells"])
    # the measured fit's decode table holds every profiled batch (fit.fit_decode_joint)
    batches = [batch for batch, _ in measured.decode_batch_fixed_s] or plan.config["profile"]["decode_batches"]
    return {"from": {"costmodel": str(plan.carry_from), "machine_json": str(plan.machine_json),
                     "name": plan.cpu_cost.name, "source": plan.cpu_cost.source,
                     "machine_fingerprint": plan.cpu_machine["machine"]["fingerprint"]},
            **carried_to,
            "terms": compare.term_rows(measured, carried, probed, fit_report["physical"]),
            "decode_batches": compare.decode_batch_rows(measured, carried, probed, batches),
            "calls": compare.call_rows(plan.cpu_cost, carried, measured),
            "capstone": compare.capstone_rows(capstone["measured"], carried_cells)}


def check_summary(plan: Plan, measured_roofline: dict, host: dict, replayed: dict, carried: dict | None) -> dict:
    """What the pipeline reads of a check (the contract in servingplan.plan.gpu_evidence): the device, the entry,
    the rates and host time measured, and each comparison's error summary (None without --carry-from)."""
    def errors(part: str, key: str = "error", of: str = "time"):
        return None if carried is None else compare.error_summary(carried[part], key, of)

    entry = plan.entry
    return {
        "device": {"kind": plan.device, "name": plan.device_name, "tiny": plan.tiny},
        "date": datetime.now(timezone.utc).date().isoformat(),
        "entry": None if entry is None else {
            **{key: entry.get(key) for key in ("name", "description", "bandwidth_gbs", "gflops")},
            "kind": hardware.machine_kind(entry), "matched_by": plan.matched_by},
        "roofline": {key: measured_roofline[key]
                     for key in ("bandwidth_gbs", "gflops", "seen_bandwidth_gbs", "seen_gflops")},
        "host_time_s": host["host_time_s"], "default_launch_overhead_s": host["default_s"],
        "carried_from": None if carried is None else {key: carried["from"][key]
                                                      for key in ("name", "machine_fingerprint")},
        "goal": carry_check.GOAL,
        "terms": errors("terms"), "decode_batches": errors("decode_batches"), "calls": errors("calls"),
        "capstone": None if carried is None else {"capacity": errors("capstone", "capacity_error", "capacity"),
                                                  "ttft": errors("capstone", "ttft_error")},
        "replay": {key: replayed[key] for key in ("ttft_p90_diff_pct", "tpot_mean_diff_pct")},
    }


def run_check(plan: Plan) -> dict:
    """Every stage on the device, then the comparisons; the document gpu_check.json holds."""
    started, stages = time.perf_counter(), {}
    config, seed = plan.config, int(plan.config["seed"])

    begun = time.perf_counter()
    measured, machine, fit_report = profile_and_fit(plan)
    stages["profile_and_fit_s"] = time.perf_counter() - begun
    peak = machine["roofline"]
    measured_roofline = {"bandwidth_gbs": peak["bandwidth_gbs"], "gflops": peak["gemm_gflops"],
                         "seen_bandwidth_gbs": peak["seen"]["bandwidth_gbs"],
                         "seen_gflops": peak["seen"]["gemm_gflops"], "readings": peak["seen"]["readings"],
                         "gemm_shape": peak["peak"]["gemm_shape"]}
    say(f"probes: {peak['bandwidth_gbs']:.4g} GB/s and {peak['gemm_gflops']:.4g} GFLOP/s float32 at their peaks")

    begun = time.perf_counter()
    model, _ = load_model(RANDOM_SOURCE if plan.tiny else config["model"]["source"], seed,
                          QUICK_CONFIG_OVERRIDES if plan.tiny else None, plan.device)
    host = host_time(model, roofline.architecture_of(machine["model"]), peak, seed)
    stages["host_time_s"] = time.perf_counter() - begun
    say(f"host time per call: {host['host_time_s'] * 1e3:.3g} ms (a decode step of {host['median_s'] * 1e3:.3g} ms "
        f"against a floor of {host['floor_s'] * 1e3:.3g} ms); the carry-over assumes {host['default_s'] * 1e3:g} ms")

    begun = time.perf_counter()
    replayed = serve_replay(model, measured, machine, config, plan.tiny, seed, threads_of(plan))
    stages["replay_s"] = time.perf_counter() - begun
    del model

    begun = time.perf_counter()
    settings = {key: config[key] for key in ("workload", "slo", "sweep", "capacity")}
    settings["seeds"] = capstone_seeds(config, plan.tiny)
    capstone = {"machine": machine, "settings": settings,
                "cells": [(policy, int(cap)) for policy in config["sweep"]["policies"]
                          for cap in config["sweep"]["caps"]],
                "memory": {**config["memory"], "kv_memory": planned_kv_memory(plan.entry, plan.device)}}
    say(f"capstone: p90 TTFT at {config['workload']['rate']:g} req/s and the capacity at the TTFT target, "
        f"{len(capstone['cells'])} configurations x {len(settings['seeds'])} seeds, on the measured model")
    capstone["measured"] = compare.capstone_cells(measured, machine, capstone["memory"], settings, capstone["cells"])
    carried = None if plan.cpu_cost is None else compare_carried(plan, measured, fit_report, measured_roofline,
                                                                 host["host_time_s"], capstone)
    stages["capstone_s"] = time.perf_counter() - begun

    document = {
        "schema_version": SCHEMA_VERSION, "summary": check_summary(plan, measured_roofline, host, replayed, carried),
        "machine": machine["machine"], "model": machine["model"], "roofline": measured_roofline,
        "settings": {"grid": "quick" if plan.tiny else "config", "profile": machine["settings"], "seed": seed,
                     "capstone_cells": [list(cell) for cell in capstone["cells"]], "capstone_seeds": settings["seeds"],
                     "capstone_kv_memory": capstone["memory"]["kv_memory"]},
        "fit": {key: fit_report[key] for key in ("heldout_mape", "mape_goal", "goal_met", "form", "r2")},
        "host_time": host, "replay": replayed, "capstone": {"measured": capstone["measured"]}, "carried": carried,
        "files": dict(OUTPUTS), "stages_s": stages, "wall_time_s": time.perf_counter() - started,
    }
    check_document(document, for_gpu_targets=False)
    return document


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        plan = prepare(args)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    document = run_check(plan)
    write_json(plan.out / OUTPUTS["check"], document)
    write_text(plan.out / OUTPUTS["markdown"], render_markdown(document))
    say(f"wrote {plan.out / OUTPUTS['check']} and {plan.out / OUTPUTS['markdown']} in {document['wall_time_s']:.0f} s")
    return 0
