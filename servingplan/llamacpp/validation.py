"""Validate the simulator against a real llama-server, in two jobs as for the torch engine
(servingplan.validate.validation_replay, servingplan.validate.validation):

The cost model both read is llama-server's: the fit with the server terms measured against the tool applied
(servingplan.llamacpp.server_terms; `cost` below).

    run_llamacpp_replay(gguf, cost, profile_points, profile_meta, workload, validation, llamacpp_cfg, memory,
                        seed, log_dir) -> dict
        serve the torch validation's Poisson traces (validation_replay.validation_traces, at the load
        fractions of validation.rates_fraction of the llama.cpp cost model's service rate) in real time
        against llama-server over HTTP with the streaming client, one fresh server per trace; and the
        lowest load once more at llamacpp.split_n_batch, a batch small enough to split prompts. Each
        run keeps the server's own step log, read into steps (servingplan.llamacpp.server_log). The
        profile's own points at the shapes a run serves are re-timed with the tool that profiled them
        (BenchRetimer): the evidence of how fast the machine ran those shapes while it served. They
        are read before the run (its prompts' point), in its idle gaps (every request sent so far
        finished and the next one far enough off for a tool run: the shapes the server's log shows
        so far, as the torch replay reads in its engine's gaps) and right after it, with the server
        stopped, until each kind it served has READINGS_PER_KIND readings. A run at a high load has
        few gaps: its evidence is what was read around it.
    run_llamacpp_comparison(replayed, cost, validation, memory, sweep, terms) -> dict
        simulate every served trace under the `llamacpp` policy on the llama.cpp cost model, as fitted (with
        the server terms, which the meta carries)
        and as corrected by that evidence (servingplan.validate.validation.corrections, the torch validation's
        rule: a kind of step is corrected only where the server's own steps of that kind agree with it),
        and set the requests (p90 TTFT, mean TPOT, ..., with the torch validation's bootstrap intervals:
        servingplan.engine.replay.compare; its goal: servingplan.validate.validation.agreement) and the steps
        (each logged step's time against the cost model's time for what it held) side by side.

The server runs with -np = validation.cap, -b / -ub = llamacpp.n_batch / n_ubatch, -c = cap x
memory.max_context (every slot can hold the longest request), --cache-ram 0, a KV cache per slot (-no-kvu)
and in float32 as profiled, and llamacpp.threads. Prompts are random token ids (no two share a prefix, so slots go by
LRU as simulated). Editing the simulator reruns only the comparison.
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pandas as pd

from servingplan.engine.replay import compare
from servingplan.llamacpp.server_log import ServerLogError, check_rule, read_steps
from servingplan.pipeline import terminal
from servingplan.simulate.llamacpp_slots import micro_batches, priced
from servingplan.simulate.simulator import SimResult
from servingplan.simulate.workload import Trace
from servingplan.validate.validation import (MIN_STEPS_PER_BATCH, STEP_GOAL_PCT, agreement, corrected_cost,
                                             corrections, direction)

POLICY = "llamacpp"
# readings of each kind of step a run served by the time it is judged (each a llama-batched-bench run)
READINGS_PER_KIND = 2
# the cost model each run is simulated on: as fitted, and as corrected by the shape-matched evidence
MODELS = ("as_fitted", "corrected")


def say(message: str) -> None:
    print(f"llama.cpp validate: {message}", file=terminal(), flush=True)


def server_context(validation: dict, memory: dict) -> int:
    return int(validation["cap"]) * int(memory["max_context"])


def planned_runs(workload: dict, validation: dict, llamacpp_cfg: dict, reference_rps: float, seed: int) -> list[dict]:
    """The runs to serve: every load of the torch validation at n_batch, then its lowest load again at
    split_n_batch."""
    from servingplan.validate.validation_replay import validation_traces   # imports torch: the replay job alone needs it
    runs = []
    for fraction, rate, trace in validation_traces(workload, validation, reference_rps, seed):
        runs.append({"name": f"load {fraction:g}", "load_fraction": fraction, "rate": rate, "trace": trace,
                     "n_batch": int(llamacpp_cfg["n_batch"]), "n_ubatch": int(llamacpp_cfg["n_ubatch"])})
    lowest = min(runs, key=lambda run: run["load_fraction"])
    split = int(llamacpp_cfg["split_n_batch"])
    runs.append({**lowest, "name": f"load {lowest['load_fraction']:g}, n_batch {split}", "n_batch": split,
                 "n_ubatch": min(split, int(llamacpp_cfg["n_ubatch"]))})
    return runs


def bench_retimer(profile_points: pd.DataFrame, profile_meta: dict, cap: int, gguf):
    """validation_replay.ShapeRetimer whose reading of a point runs llama-batched-bench on it exactly as the
    profile did (servingplan.llamacpp.profile.run_bench, with the profile's settings: threads, n_batch,
    n_ubatch, warm-up and repeats): the median of the run's timed calls. What a reading needs of an idle
    gap is its tool run's wall time: the calls and a decode point's untimed prompt at the slowest speed
    seen, and the longest start-up seen (the process, the model's load); before one run has been seen,
    no gap is long enough."""
    import math

    from servingplan.llamacpp import build
    from servingplan.llamacpp.profile import run_bench
    from servingplan.profile.measure import GridPoint
    from servingplan.validate.validation_replay import ShapeRetimer, nearest   # imports torch: the replay job alone needs it

    settings = profile_meta["settings"]
    calls = int(settings["warmup"]) + int(settings["repeats"])

    class BenchRetimer(ShapeRetimer):
        startup_s = math.inf

        def untimed_s(self, point) -> float:
            """The profiled time of a decode point's prompt, prefilled once before its steps (-pps)."""
            if point.kind != "decode" or not self.prefill_lengths:
                return 0.0
            return self.profiled[GridPoint("prefill", 1, nearest(self.prefill_lengths, point.cached), 0)]

        def profiled_run_s(self, point) -> float:
            """A tool run's time beyond its start-up, at the profile's speed: its calls and untimed prompt."""
            return self.profiled[point] * calls + self.untimed_s(point)

        def expected_s(self, point) -> float:
            return self.startup_s + self.profiled_run_s(point) * self.slowest

        def time_point(self, point):
            begun = time.perf_counter()
            seconds = float(np.median(run_bench(point, settings, Path(gguf), build.binary("llama-batched-bench"))))
            ended = time.perf_counter()
            ratio = seconds / self.profiled[point]
            startup = max(0.0, ended - begun - self.profiled_run_s(point) * ratio)
            self.startup_s = startup if math.isinf(self.startup_s) else max(self.startup_s, startup)
            return ended - self.started, seconds

    return BenchRetimer(profile_points, cap)


class LogSoFar:
    """The steps a running server has logged so far (none while its log holds no whole step yet), and what
    reading them costs: the log is read whole each time, megabytes by a low-load run's end (a third of a
    second), so an idle gap must hold that as well as a tool run. The cost is the log's size at the
    slowest rate per byte seen."""

    def __init__(self, path: Path):
        self.path = path
        self.seconds_per_byte = 0.0

    def expected_s(self) -> float:
        try:
            return self.path.stat().st_size * self.seconds_per_byte
        except OSError:
            return 0.0

    def steps(self) -> list:
        begun = time.perf_counter()
        try:
            text = self.path.read_text(errors="replace")
            steps = read_steps(text)
        except (OSError, ServerLogError):
            return []
        self.seconds_per_byte = max(self.seconds_per_byte, (time.perf_counter() - begun) / max(len(text), 1))
        return steps


def served_shapes(steps) -> list[dict]:
    """A run's logged steps in the form ShapeRetimer matches: decode batch, longest context, prompt chunks."""
    return [{"batch": len(step.decodes), "ctx_max": max((context for _, context in step.decodes), default=0),
             "prefill_calls": [(tokens, cached) for _, tokens, cached in step.prefills]} for step in steps]


def run_llamacpp_replay(gguf, cost, profile_points: pd.DataFrame, profile_meta: dict, workload: dict,
                        validation: dict, llamacpp_cfg: dict, memory: dict, seed: int, log_dir,
                        tiny: bool = False) -> dict:
    from servingplan.architecture import GPT2_SMALL
    from servingplan.llamacpp.client import random_prompts, run_trace
    from servingplan.llamacpp.gguf_model import TINY_OVERRIDES
    from servingplan.llamacpp.server import FLOAT32_KV, STEP_LOG_ARGS, LlamaServer
    from servingplan.profile.machine import resolve_threads
    from servingplan.validate.validation_replay import IDLE_MARGIN, reference_rps

    cap = int(validation["cap"])
    retimer = bench_retimer(profile_points, profile_meta, cap, gguf)
    vocab_size = (TINY_OVERRIDES if tiny else GPT2_SMALL)["vocab_size"]
    reference = reference_rps(cost, workload, cap, seed)
    say(f"load reference: the llama.cpp cost model serves {reference:.3g} req/s at cap {cap}")
    threads = resolve_threads(llamacpp_cfg.get("threads"))
    log_dir = Path(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    served = []
    for number, run in enumerate(planned_runs(workload, validation, llamacpp_cfg, reference, seed), 1):
        trace: Trace = run["trace"]
        label = f"run {number}"
        say(f"run {number} ({run['name']}): {len(trace)} requests at {run['rate']:.3g} req/s, -b {run['n_batch']}")
        prompts = random_prompts(trace.prompt_tokens, vocab_size, seed + number)
        log_file = log_dir / f"server_run{number}.log"
        # the evidence of the machine's speed while the run served: its prompts' shape read before it
        # (where its prefill time will be: its first calls hold at most n_batch tokens), the shapes it
        # served read in its idle gaps, and after it every kind it served up to READINGS_PER_KIND readings
        first_calls = [{"batch": 0, "ctx_max": 0, "prefill_calls": [(min(int(n), run["n_batch"]), 0)]}
                       for n in trace.prompt_tokens]
        for point in retimer.uncovered_kinds(first_calls, label):
            retimer.retime(point, label)

        log_so_far = LogSoFar(log_file)

        def use_gap(gap_s: float, label=label, log_so_far=log_so_far) -> None:
            # only a gap that holds reading the log and a tool run, each with the margin that keeps the
            # next request from waiting
            deadline = time.perf_counter() + gap_s
            if gap_s < IDLE_MARGIN * (log_so_far.expected_s() + retimer.startup_s):
                return
            shapes = served_shapes(log_so_far.steps())
            retimer.retime_within(retimer.unmatched(shapes, label), label, deadline - time.perf_counter(),
                                  IDLE_MARGIN)
            retimer.retime_within(retimer.least_timed(shapes, label), label, deadline - time.perf_counter(),
                                  IDLE_MARGIN)

        with LlamaServer(gguf, threads=threads, n_parallel=cap, ctx=server_context(validation, memory),
                         n_batch=run["n_batch"], n_ubatch=run["n_ubatch"], verbosity=5, log_file=log_file,
                         extra_args=FLOAT32_KV + STEP_LOG_ARGS) as server:
            results = run_trace(server.url, trace.arrival_s, prompts, [int(n) for n in trace.output_tokens],
                                timeout_s=float(validation["max_wall_s"]), while_idle=use_gap)
        steps = read_steps(log_file.read_text(errors="replace"))
        check = check_rule(steps)
        failed = [r for r in results if not r.ok]
        if failed:
            say(f"run {number}: {len(failed)} of {len(results)} requests failed ({failed[0].error})")
        during = sum(row["label"] == label for row in retimer.rows)
        kinds = retimer.uncovered_kinds(served_shapes(steps), label, READINGS_PER_KIND)
        say(f"run {number}: {during} re-timings before and during it; {len(kinds)} more of the shapes it served "
            f"now, so that each kind has {READINGS_PER_KIND}")
        for point in kinds:
            retimer.retime(point, label)
        served.append({
            "number": number, "name": run["name"], "load_fraction": run["load_fraction"], "rate": run["rate"],
            "n_batch": run["n_batch"], "n_ubatch": run["n_ubatch"],
            "trace": {"arrival_s": trace.arrival_s.tolist(), "prompt_tokens": trace.prompt_tokens.tolist(),
                      "output_tokens": trace.output_tokens.tolist()},
            "requests": [{"sent_s": r.sent_s, "first_token_s": r.token_times_s[0] if r.ok else None,
                          "completion_s": r.token_times_s[-1] if r.ok else None,
                          "tokens": r.output_tokens, "error": r.error} for r in results],
            "steps": [{"start_s": s.start_s, "duration_s": s.duration_s, "decodes": [list(d) for d in s.decodes],
                       "prefills": [list(p) for p in s.prefills]} for s in steps],
            "batch_rule": check,
        })
    return {"settings": {"policy": POLICY, "max_num_seqs": cap, "threads": threads,
                         "ctx": server_context(validation, memory), "n_ubatch": int(llamacpp_cfg["n_ubatch"])},
            "service_rate_rps": reference, "runs": served, "retimed": retimer.rows}


def measured_result(run: dict) -> SimResult:
    """A served run's request timeline as a SimResult (what compare reads): a request that failed has no
    first token and no completion."""
    trace = run["trace"]
    n = len(trace["arrival_s"])
    first = np.array([np.nan if r["first_token_s"] is None else r["first_token_s"] for r in run["requests"]], float)
    done = np.array([np.nan if r["completion_s"] is None else r["completion_s"] for r in run["requests"]], float)
    outputs = np.array(trace["output_tokens"], dtype=np.int64)
    return SimResult(
        arrival_s=np.array(trace["arrival_s"], float), prompt_tokens=np.array(trace["prompt_tokens"], dtype=np.int64),
        output_tokens=outputs, scheduled_s=np.full(n, np.nan), first_token_s=first, completion_s=done,
        generated=np.where(np.isnan(done), 0, outputs), preemptions=np.zeros(n, dtype=np.int64),
        recomputed_tokens=np.zeros(n, dtype=np.int64), rejected=np.zeros(n, dtype=bool), token_spans=None,
        end_s=float(np.nanmax(done)) if np.isfinite(done).any() else 0.0, truncated=bool(np.isnan(done).any()),
        steps=len(run["steps"]), events=0, peak_running=0, peak_kv_blocks=0, peak_kv_tokens=0,
        backlog_growth_s=None, policy=POLICY, max_num_seqs=0, chunk_size=int(run["n_batch"]),
        meta={"errors": {i: r["error"] for i, r in enumerate(run["requests"]) if r["error"]}})


def step_table(run: dict, cost) -> tuple[pd.DataFrame, list]:
    """One row per logged step: its decode batch, KV read, prompt tokens, how many micro-batches the server
    cut it into (llamacpp_slots.micro_batches, from the slots it held), measured and predicted time (priced
    over those micro-batches, as the simulator prices its steps); and each step's micro-batches, which
    with_corrected prices again."""
    rows, batches = [], []
    for step in run["steps"]:
        decodes = [(slot, context) for slot, context in step["decodes"]]
        chunks = [(slot, tokens, cached) for slot, tokens, cached in step["prefills"]]
        prompt = int(sum(tokens for _, tokens, _ in chunks))
        batches.append(micro_batches(decodes, chunks, run["n_ubatch"]))
        rows.append({"run": run["name"], "batch": len(decodes), "ctx_sum": int(sum(c for _, c in decodes)),
                     "prompt_tokens": prompt, "n_prefill_calls": len(chunks), "tokens": len(decodes) + prompt,
                     "micro_batches": len(batches[-1]), "duration_s": step["duration_s"],
                     "predicted_s": priced(cost, batches[-1])})
    frame = pd.DataFrame(rows, columns=["run", "batch", "ctx_sum", "prompt_tokens", "n_prefill_calls", "tokens",
                                        "micro_batches", "duration_s", "predicted_s"])
    frame["error_pct"] = 100.0 * (frame["predicted_s"] - frame["duration_s"]) / frame["duration_s"]
    return frame, batches


def with_corrected(frame: pd.DataFrame, batches: list, cost, applied: list[dict]) -> pd.DataFrame:
    """step_table's frame with each step's time on the cost model as corrected for its kind (`applied`:
    servingplan.validate.validation.corrections): decode terms x its batch size's factor, prefill terms x the
    prefill factor, over the same micro-batches."""
    decode = {row["batch"]: row["applied_factor"] for row in applied if row["kind"] == "decode"}
    prefill = next((row["applied_factor"] for row in applied if row["kind"] == "prefill"), 1.0)
    corrected = [priced(cost.slowed(decode.get(batch, 1.0), prefill), step)
                 for batch, step in zip(frame["batch"], batches)]
    frame = frame.copy()
    frame.insert(frame.columns.get_loc("predicted_s") + 1, "corrected_s", pd.Series(corrected, index=frame.index,
                                                                                     dtype=float))
    frame["corrected_error_pct"] = 100.0 * (frame["corrected_s"] - frame["duration_s"]) / frame["duration_s"]
    return frame


def steps_by_kind(steps: pd.DataFrame) -> pd.DataFrame:
    """Logged steps grouped by what they held: decode-only steps per batch size, and steps carrying
    prompt tokens (alone, or fused with decodes); median measured and predicted time, median error."""
    if steps.empty:
        return pd.DataFrame()
    kind = np.where(steps["n_prefill_calls"] == 0, "decode",
                    np.where(steps["batch"] == 0, "prompt", "decode+prompt"))
    grouped = steps.assign(kind=kind, batch=np.where(kind == "decode", steps["batch"], 0)).groupby(["kind", "batch"])
    table = pd.DataFrame({"steps": grouped.size(),
                          "measured_ms": grouped["duration_s"].median() * 1e3,
                          "predicted_ms": grouped["predicted_s"].median() * 1e3,
                          "median_error_pct": grouped["error_pct"].median(),
                          "median_corrected_error_pct": grouped["corrected_error_pct"].median()}).reset_index()
    table["judged"] = table["steps"] >= MIN_STEPS_PER_BATCH
    table["within_goal"] = table["median_error_pct"].abs() <= STEP_GOAL_PCT
    return table


def run_llamacpp_comparison(replayed: dict, cost, validation: dict, memory: dict, sweep: dict,
                            terms: dict) -> dict:
    """Simulate each served run under the `llamacpp` policy, on the cost model as fitted and as corrected
    by the evidence re-timed around it, and set it against the server (see the module docstring):
    comparison (requests, a row per model), steps, steps_by_kind and meta (the headline, and the corrections:
    one row per run and kind of step, applied or why not)."""
    settings = replayed["settings"]
    cap = settings["max_num_seqs"]
    blocks = settings["ctx"] // memory["block_size"]
    retimed = pd.DataFrame(replayed["retimed"])
    tables, steps, runs, applied_all = [], [], [], []
    for run in replayed["runs"]:
        trace = Trace(np.array(run["trace"]["arrival_s"], float), np.array(run["trace"]["prompt_tokens"], np.int64),
                      np.array(run["trace"]["output_tokens"], np.int64))
        measured = measured_result(run)
        frame, batches = step_table(run, cost)
        applied = corrections(frame, retimed, f"run {run['number']}")
        corrected, decode_factor, prefill_factor = corrected_cost(cost, applied)
        label = {"run": run["name"], "load_fraction": run["load_fraction"], "rate": run["rate"],
                 "n_batch": run["n_batch"]}
        stable = {}
        for name, model in zip(MODELS, (cost, corrected)):
            simulated = simulate_run(trace, model, cap, run["n_batch"], run["n_ubatch"], blocks, memory, sweep)
            tables.append(compare(measured, simulated).assign(**label, model=name))
            stable[name] = bool(simulated.stable)
        steps.append(with_corrected(frame, batches, cost, applied))
        applied_all += [{**row, "run": run["name"]} for row in applied]
        runs.append({**label, "requests": len(trace), "finished": int(measured.finished.sum()),
                     "simulated_stable": stable, "batch_rule": run["batch_rule"],
                     "speed_ratio": {"decode": decode_factor, "prefill": prefill_factor},
                     "split_prompts": int(sum(1 for s in run["steps"] for _, _, cached in s["prefills"] if cached))})
    comparison = pd.concat(tables, ignore_index=True)
    comparison["agrees"] = agreement(comparison, validation["goal_pct"])
    all_steps = pd.concat(steps, ignore_index=True)
    by_kind = pd.concat([steps_by_kind(frame).assign(run=frame["run"].iloc[0]) for frame in steps if len(frame)],
                        ignore_index=True) if any(len(f) for f in steps) else pd.DataFrame()
    corrections_table = pd.DataFrame(applied_all)
    return {"comparison": comparison, "steps": all_steps, "steps_by_kind": by_kind,
            "meta": {"policy": POLICY, **settings, "service_rate_rps": replayed["service_rate_rps"], "runs": runs,
                     "headline": headline(comparison, validation), "steps_by_kind": by_kind.to_dict("records"),
                     "server_terms": terms["kinds"],
                     "corrections": corrections_table.to_dict("records")}}


def simulate_run(trace: Trace, cost, cap: int, n_batch: int, n_ubatch: int, blocks: int, memory: dict,
                 sweep: dict) -> SimResult:
    from servingplan.simulate import simulate
    return simulate(trace, cost, POLICY, cap, n_batch, blocks, memory["block_size"], sweep["horizon_factor"],
                    n_ubatch=n_ubatch)


def headline(comparison: pd.DataFrame, validation: dict) -> dict:
    """Per cost model (as fitted, as corrected) and run: p90 TTFT and mean TPOT measured (with the 90%
    interval), simulated, the gap and whether it agrees (inside the interval or within validation.goal_pct),
    and the gaps' direction. The goal is judged on the corrected model, as the torch validation judges it:
    the fit is what the profile measured, the correction what the machine ran at while the server served."""
    out = {"goal_pct": validation["goal_pct"]}
    for name in MODELS:
        rows = comparison[comparison["model"] == name]
        judged = rows[((rows["metric"] == "ttft") & (rows["stat"] == "p90"))
                      | ((rows["metric"] == "tpot") & (rows["stat"] == "mean"))]
        out[name] = {
            "rows": [{key: (float(value) if isinstance(value, (float, np.floating)) else value)
                      for key, value in row.items()} for row in
                     judged[["run", "load_fraction", "n_batch", "metric", "stat", "n", "measured_ms", "measured_lo_ms",
                             "measured_hi_ms", "simulated_ms", "diff_pct", "agrees"]].to_dict("records")],
            "agree": int(judged["agrees"].sum()), "judged": int(len(judged)),
            "met": bool(len(judged)) and bool(judged["agrees"].all()),
            "direction": {metric: direction(judged.loc[judged["metric"] == metric, "diff_pct"].tolist())
                          for metric in ("ttft", "tpot")}}
    out["met"] = out["corrected"]["met"]
    return out
