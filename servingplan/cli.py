"""The Exercise-2 command line: simulate policies over caps and rates and report latency and goodput.

    python scripts/serving_sim.py --policies continuous_chunked --rate 20 \\
        --slo-ttft-ms 2000 --slo-tpot-ms 12 --sweep-batch 4,8,16,24,32,48,64,128

Every cell (policy x cap x rate) is simulated once per seed; the table and the JSON rows give the
mean over seeds. Bad input ends the program with one line on stderr and exit code 2.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from servingplan import costmodel, workload
from servingplan.io import InputError, check_output_path, quiet_on_closed_pipe, write_json
from servingplan.metrics import SLO, finite_or_none, itl_values, per_request, percentile, summarize
from servingplan.seeds import over_seeds
from servingplan.sim import POLICIES, simulate
from servingplan.sim.policies import chunks

PROG = "serving_sim"
CURVE_BATCHES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128)
# vLLM's default max_num_seqs
DEFAULT_CAP = 256
# the source's prompt chunk
DEFAULT_CHUNK_SIZE = 512
REPORTED_PERCENTILES = (50, 90, 95, 99)
# Bounds that keep every run finite in time and memory, far above any useful value.
MAX_RATE = 1e6
MAX_CAP = 65536
MAX_TOKENS = workload.MAX_TRACE_TOKENS
MAX_KV_BLOCKS = 1 << 30
MAX_SEEDS = 100
MAX_SEED = 2**32 - 1
MAX_LIST_ITEMS = 100
MAX_NUM_REQUESTS = workload.MAX_TRACE_ROWS
MAX_LATENCY_MS = 1e9
# requests held in memory at once: every (seed, rate) trace is drawn before the first cell runs
MAX_TRACE_REQUESTS = 10_000_000
DEFAULT_SEEDS = 5
# vLLM's benchmark names (benchmarks/serve.py): goodput bounds, metrics and the percentile default
GOODPUT_KEYS = ("ttft", "tpot", "e2el")
VLLM_METRICS = ("ttft", "tpot", "itl", "e2el")
DEFAULT_METRIC_PERCENTILES = [99.0]
DEFAULT_RESULT_FILENAME = "serving_sim.json"
TRACE_FIELDS = ("arrival", "prompt_tokens", "output_tokens")


class UsageError(Exception):
    """Bad input found after parsing; its message is the whole error line."""


class _OneLineParser(argparse.ArgumentParser):
    def error(self, message):
        self.exit(2, f"{PROG}: error: {message}\n")


def _number(text: str, kind, what: str, minimum, inclusive: bool, maximum=None):
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    too_big = maximum is not None and value > maximum
    if not math.isfinite(value) or value < minimum or (value == minimum and not inclusive) or too_big:
        bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
        if maximum is not None:
            bound += f" and <= {maximum:g}"
        raise argparse.ArgumentTypeError(f"{text!r}: must be {what} {bound}")
    return value


def bounded_float(maximum: float):
    def parse(text: str) -> float:
        return _number(text, float, "a number", 0.0, inclusive=False, maximum=maximum)
    return parse


def bounded_int(maximum: int):
    def parse(text: str) -> int:
        return _number(text, int, "an integer", 1, inclusive=True, maximum=maximum)
    return parse


arrival_rate = bounded_float(MAX_RATE)
sequence_cap = bounded_int(MAX_CAP)


def percentile_value(text: str) -> float:
    value = _number(text, float, "a percentile", 0.0, inclusive=True)
    if value > 100:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a percentile in [0, 100]")
    return value


def list_of(item_type):
    """A comma-separated list of at most MAX_LIST_ITEMS items, each passing `item_type`."""
    def parse(text: str):
        items = text.split(",")
        if any(not item.strip() for item in items):
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list (empty item)")
        if len(items) > MAX_LIST_ITEMS:
            raise argparse.ArgumentTypeError(f"{len(items)} items: at most {MAX_LIST_ITEMS} allowed")
        return [item_type(item.strip()) for item in items]
    return parse


def policy_name(text: str) -> str:
    if text not in POLICIES:
        raise argparse.ArgumentTypeError(f"unknown policy {text!r}: allowed {', '.join(POLICIES)}")
    return text


def seed_list(text: str) -> list[int]:
    """'5' means seeds 0..4; '3,7' means exactly seeds 3 and 7."""
    if "," not in text:
        return list(range(_number(text, int, "a number of seeds", 1, inclusive=True, maximum=MAX_SEEDS)))
    return list_of(lambda s: _number(s, int, "an integer seed", 0, inclusive=True, maximum=MAX_SEED))(text)


def goodput_bound(text: str) -> tuple[str, float]:
    """One vLLM --goodput item, KEY:MILLISECONDS with KEY ttft, tpot or e2el."""
    key, colon, value = text.partition(":")
    if not colon or key not in GOODPUT_KEYS:
        raise argparse.ArgumentTypeError(f"{text!r}: must be KEY:MS with KEY one of {', '.join(GOODPUT_KEYS)}")
    return key, bounded_float(MAX_LATENCY_MS)(value)


def column_mapping(text: str) -> dict:
    """--trace-columns arrival=TIMESTAMP,prompt_tokens=ContextTokens,output_tokens=GeneratedTokens"""
    mapping = {}
    for item in text.split(","):
        key, equals, name = item.partition("=")
        if not equals or key.strip() not in TRACE_FIELDS or not name.strip():
            raise argparse.ArgumentTypeError(f"{item!r}: must be FIELD=COLUMN with FIELD one of {', '.join(TRACE_FIELDS)}")
        mapping[key.strip()] = name.strip()
    return mapping


class _Once(argparse._StoreAction):
    """An option with aliases (--num-requests/--num-prompts) given twice with different values is a
    contradiction, not a choice of the last."""
    def __call__(self, parser, namespace, values, option_string=None):
        previous = getattr(namespace, self.dest, None)
        if getattr(namespace, f"_{self.dest}_given", False) and previous != values:
            parser.error(f"argument {'/'.join(self.option_strings)}: given twice with different values "
                         f"({previous!r} and {values!r}): give one")
        setattr(namespace, f"_{self.dest}_given", True)
        super().__call__(parser, namespace, values, option_string)


def build_parser() -> argparse.ArgumentParser:
    p = _OneLineParser(prog=PROG, description="Simulate LLM serving policies on a workload and report "
                       "TTFT/TPOT/ITL percentiles, throughput and goodput (mean over seeds).")
    p.add_argument("--policies", type=list_of(policy_name), action="append",
                   help=f"policies, comma-separated or repeated; allowed: {', '.join(POLICIES)} "
                        "(default continuous_chunked)")
    p.add_argument("--rate", "--request-rate", dest="rate", type=arrival_rate, action=_Once,
                   help="arrival rate, requests/s (default: the workload's)")
    p.add_argument("--sweep-rate", type=list_of(arrival_rate), help="comma-separated arrival rates")
    p.add_argument("--max-num-seqs", type=sequence_cap, default=DEFAULT_CAP,
                   help=f"cap on running sequences when --sweep-batch is not given (default {DEFAULT_CAP})")
    p.add_argument("--sweep-batch", type=list_of(sequence_cap), help="comma-separated caps (max_num_seqs)")
    p.add_argument("--workload", default="exercise2",
                   help=f"preset ({', '.join(workload.PRESETS)}) or trace CSV with columns arrival_s, "
                        "prompt_tokens, output_tokens (default exercise2)")
    p.add_argument("--trace", help="replay a trace file (CSV, or JSONL as .jsonl/.ndjson) instead of --workload; "
                                   "rows with 0 tokens are skipped and counted")
    p.add_argument("--trace-layout", choices=list(workload.TRACE_LAYOUTS), default="servingplan",
                   help="column names and timestamp kind of --trace: servingplan (arrival_s, prompt_tokens, "
                        "output_tokens), azure (Azure LLM inference: TIMESTAMP, ContextTokens, GeneratedTokens), "
                        "burstgpt (Timestamp, Request tokens, Response tokens)")
    p.add_argument("--trace-columns", type=column_mapping,
                   help="override the layout's column names: arrival=...,prompt_tokens=...,output_tokens=...")
    p.add_argument("--trace-timestamps", choices=list(workload.TIMESTAMP_KINDS),
                   help="arrival column holds seconds or ISO 8601 datetimes (default: the layout's)")
    p.add_argument("--cost-model", default="exercise2",
                   help=f"preset ({', '.join(costmodel.PRESETS)}) or cost-model JSON (default exercise2)")
    p.add_argument("--chunk-size", type=bounded_int(MAX_TOKENS),
                   help=f"prompt tokens per step of the chunked policy; the decodes ride along (default "
                        f"{DEFAULT_CHUNK_SIZE})")
    p.add_argument("--max-num-batched-tokens", type=bounded_int(MAX_TOKENS),
                   help="instead of --chunk-size: vLLM's per-step token budget of the chunked policy, every "
                        "decoding sequence's token included; at least the largest cap")
    p.add_argument("--seeds", type=seed_list,
                   help=f"number of seeds (N means 0..N-1) or a comma-separated list of exactly the seeds to run "
                        f"(default {DEFAULT_SEEDS})")
    p.add_argument("--seed", type=lambda s: _number(s, int, "an integer seed", 0, inclusive=True, maximum=MAX_SEED),
                   help="run exactly this one seed (instead of --seeds)")
    p.add_argument("--num-requests", "--num-prompts", dest="num_requests", type=bounded_int(MAX_NUM_REQUESTS),
                   action=_Once,
                   help="requests per trace (default: the workload's)")
    p.add_argument("--slo-ttft-ms", type=bounded_float(MAX_LATENCY_MS), help="TTFT bound, ms")
    p.add_argument("--slo-ttft-pct", type=percentile_value, default=95.0, help="TTFT percentile (default 95)")
    p.add_argument("--slo-tpot-ms", type=bounded_float(MAX_LATENCY_MS), help="TPOT bound, ms")
    p.add_argument("--slo-tpot-pct", type=percentile_value, default=95.0, help="TPOT percentile (default 95)")
    p.add_argument("--slo-itl-ms", type=bounded_float(MAX_LATENCY_MS), help="inter-token latency bound, ms")
    p.add_argument("--slo-itl-pct", type=percentile_value, default=99.0, help="ITL percentile (default 99)")
    p.add_argument("--kv-blocks", type=bounded_int(MAX_KV_BLOCKS), help="KV cache size in blocks (default unlimited)")
    p.add_argument("--block-size", type=bounded_int(MAX_TOKENS), default=16, help="tokens per KV block (default 16)")
    p.add_argument("--print-curve", action="store_true",
                   help="print the cost model's decode step latency and throughput per batch size and exit")
    p.add_argument("--curve-context", type=bounded_int(MAX_TOKENS), default=2000,
                   help="per-sequence context of --print-curve (default 2000)")
    p.add_argument("--json", action="store_true", help="print JSON rows instead of a table")
    p.add_argument("--goodput", nargs="+", type=goodput_bound, metavar="KEY:MS",
                   help="vLLM's per-request goodput bounds, e.g. ttft:2000 tpot:12 e2el:30000 (ms); ttft and "
                        "tpot are the same bounds as --slo-ttft-ms and --slo-tpot-ms")
    p.add_argument("--metric-percentiles", type=list_of(percentile_value),
                   help="comma-separated percentiles of the vLLM-named keys p<q>_<metric>_ms (default 99)")
    p.add_argument("--save-result", action="store_true",
                   help="also write the rows, with vLLM's result keys, as JSON into --result-dir")
    p.add_argument("--result-dir", default=".", help="directory of --save-result (default: here)")
    p.add_argument("--result-filename", default=DEFAULT_RESULT_FILENAME,
                   help=f"file name of --save-result (default {DEFAULT_RESULT_FILENAME})")
    p.add_argument("--save-detailed", action="store_true",
                   help="with --save-result: add every request's lengths, TTFT, TPOT, E2E, ITLs and error")
    return p


def load_cost_model(spec: str) -> costmodel.CostModel:
    allowed = f"allowed: a preset ({', '.join(costmodel.PRESETS)}) or a cost-model JSON file"
    if spec not in costmodel.PRESETS and not Path(spec).exists():
        raise UsageError(f"--cost-model {spec!r}: no such preset or file; {allowed}")
    try:
        return costmodel.load(spec)
    except (ValueError, KeyError, TypeError, OSError) as exc:
        raise UsageError(f"--cost-model {spec!r}: {_reason(exc)}; {allowed}") from None


def load_traces(args) -> list[tuple[int, float, workload.Trace]]:
    """(seed, rate, trace) for every seed and rate; a trace file is one fixed trace, so one seed."""
    rates = args.sweep_rate or ([args.rate] if args.rate else [])
    if args.trace:
        return _file_traces(args, rates)
    if args.workload in workload.PRESETS:
        spec = dict(workload.PRESETS[args.workload])
        if args.num_requests:
            spec["num_requests"] = args.num_requests
        rates = rates or [float(spec["rate"])]
        seeds = seeds_from(args)
        held = spec["num_requests"] * len(seeds) * len(rates)
        if held > MAX_TRACE_REQUESTS:
            raise UsageError(f"--num-requests x seeds x rates = {spec['num_requests']} x {len(seeds)} x "
                             f"{len(rates)} = {held:,} requests: at most {MAX_TRACE_REQUESTS:,} allowed")
        return [(seed, rate, workload.generate({**spec, "rate": rate}, seed))
                for rate in rates for seed in seeds]
    if not Path(args.workload).exists():
        raise UsageError(f"--workload {args.workload!r}: no such preset or file; allowed: a preset "
                         f"({', '.join(workload.PRESETS)}) or a trace CSV")
    if args.seeds is not None or args.seed is not None:
        raise UsageError(f"--seeds/--seed with --workload {args.workload!r}: a trace file is one fixed trace; "
                         "seeds draw the presets' synthetic traces only")
    try:
        trace = workload.load_trace_csv(args.workload)
    except (ValueError, KeyError, OSError) as exc:
        raise UsageError(f"--workload {args.workload!r}: {_reason(exc)}; allowed: a CSV with columns "
                         "arrival_s, prompt_tokens, output_tokens") from None
    trace = _first(trace, args.num_requests)
    if len(trace) == 0:
        raise UsageError(f"--workload {args.workload!r}: the trace has no requests")
    return _at_rates(trace, f"--workload {args.workload!r}", rates)


def _first(trace: workload.Trace, n: int | None) -> workload.Trace:
    """The first n requests of a file's trace (all when n is not given)."""
    if not n:
        return trace
    return workload.Trace(trace.arrival_s[:n], trace.prompt_tokens[:n], trace.output_tokens[:n])


def _at_rates(trace: workload.Trace, label: str, rates) -> list[tuple[int, float, workload.Trace]]:
    """A file's trace at its own pace (rate = requests / span) or rescaled to each of `rates`."""
    if not rates:
        return [(0, trace.mean_rate_rps or math.inf, trace)]
    if trace.mean_rate_rps is None:
        raise UsageError(f"{label}: all arrivals at one time (within {workload.MIN_TRACE_SPAN_S:g} s), so --rate "
                         "cannot rescale it")
    if len(trace) * len(rates) > MAX_TRACE_REQUESTS:
        raise UsageError(f"{label}: {len(trace):,} requests x {len(rates)} rates: at most "
                         f"{MAX_TRACE_REQUESTS:,} requests allowed")
    try:
        return [(0, rate, trace.with_rate(rate)) for rate in rates]
    except ValueError as exc:
        raise UsageError(f"{label}: {_reason(exc)}") from None


def _file_traces(args, rates) -> list[tuple[int, float, workload.Trace]]:
    """--trace: the file's requests at their own pace (rate = requests / span) or rescaled to each rate."""
    if args.workload != "exercise2":
        raise UsageError(f"--trace and --workload {args.workload!r} both name the traffic: give one")
    if args.seeds is not None or args.seed is not None:
        raise UsageError(f"--seeds/--seed with --trace {args.trace!r}: a trace file is one fixed trace; "
                         "seeds draw the presets' synthetic traces only")
    if not Path(args.trace).exists():
        raise UsageError(f"--trace {args.trace!r}: no such file")
    try:
        loaded = workload.load_trace(args.trace, args.trace_layout, args.trace_columns, args.trace_timestamps)
    except (ValueError, OSError) as exc:
        raise UsageError(f"--trace {args.trace!r}: {_reason(exc)}") from None
    trace = _first(loaded.trace, args.num_requests)
    args.trace_summary = {"path": args.trace, "layout": loaded.layout, "rows": loaded.rows,
                          "skipped_zero_token_rows": loaded.skipped_zero_tokens, "requests": len(trace)}
    if len(trace) == 0:
        raise UsageError(f"--trace {args.trace!r}: no request left ({loaded.rows} rows, "
                         f"{loaded.skipped_zero_tokens} with 0 tokens skipped)")
    return _at_rates(trace, f"--trace {args.trace!r}", rates)


def _reason(exc: Exception) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__


def chosen_policies(args) -> list[str]:
    return list(dict.fromkeys(p for group in (args.policies or [["continuous_chunked"]]) for p in group))


def chosen_caps(args) -> list[int]:
    return args.sweep_batch or [args.max_num_seqs]


def chunk_budget_from(args) -> tuple[int, str]:
    """(tokens, what they count) per step of a chunking policy, from --chunk-size or --max-num-batched-tokens."""
    policies, caps = chosen_policies(args), chosen_caps(args)
    budget = args.max_num_batched_tokens
    if budget is None:
        return (args.chunk_size or DEFAULT_CHUNK_SIZE), "prompt_tokens"
    if args.chunk_size is not None:
        raise UsageError(f"--chunk-size {args.chunk_size} and --max-num-batched-tokens {budget} both set the "
                         "chunked policy's step budget: give one")
    if not any(chunks(p) for p in policies):
        raise UsageError(f"--max-num-batched-tokens {budget}: budgets the steps of a chunking policy "
                         f"({', '.join(p for p in POLICIES if chunks(p))}), and none was chosen")
    if budget < max(caps):
        raise UsageError(f"--max-num-batched-tokens {budget}: must be >= the largest cap ({max(caps)}), as in "
                         "vLLM, so the decodes of a full batch leave room for prompt tokens")
    return budget, "step_tokens"


def seeds_from(args) -> list[int]:
    if args.seed is not None and args.seeds is not None:
        raise UsageError(f"--seed {args.seed} and --seeds both choose seeds: give one")
    if args.seed is not None:
        return [args.seed]
    return args.seeds if args.seeds is not None else list(range(DEFAULT_SEEDS))


def slo_from(args) -> SLO:
    goodput = {}
    for key, bound in args.goodput or []:
        if key in goodput:
            raise UsageError(f"--goodput {key}: given twice")
        goodput[key] = bound
    for key, bound in (("ttft", args.slo_ttft_ms), ("tpot", args.slo_tpot_ms)):
        if key in goodput and bound is not None:
            raise UsageError(f"--goodput {key}:{goodput[key]:g} and --slo-{key}-ms {bound:g} both bound {key.upper()}: "
                             "give one")
    return SLO(ttft_ms=goodput.get("ttft", args.slo_ttft_ms), ttft_percentile=args.slo_ttft_pct,
               tpot_ms=goodput.get("tpot", args.slo_tpot_ms), tpot_percentile=args.slo_tpot_pct,
               itl_ms=args.slo_itl_ms, itl_percentile=args.slo_itl_pct, e2el_ms=goodput.get("e2el"))


def percentile_word(q: float) -> str:
    """vLLM's spelling of a percentile in a key: 99 -> '99', 99.9 -> '99.9'."""
    return str(int(q)) if int(q) == q else str(q)


def vllm_figures(result, summary: dict, percentiles) -> dict:
    """One run's figures under vLLM's result keys. Unfinished requests count as infinitely late, so
    a run that did not keep up shows no latency statistic and no goodput (None)."""
    frame = per_request(result)
    finished = frame["finished"].to_numpy()
    n_in, n_out = frame["prompt_tokens"].to_numpy(), frame["output_tokens"].to_numpy()
    duration = summary["duration_s"]
    stable = summary["stable"]
    completed = int(finished.sum())
    out = {"completed": completed, "total_input_tokens": int(n_in[finished].sum()),
           "total_output_tokens": int(n_out[finished].sum()), "duration": duration,
           "request_throughput": completed / duration if duration > 0 else None,
           "output_throughput": summary["throughput_tok_s"],
           "total_token_throughput": (int(n_in[finished].sum()) + int(n_out[finished].sum())) / duration
           if duration > 0 else None,
           "request_goodput": summary["goodput_rps"] if stable else None}
    series = {"ttft": np.where(np.isnan(frame["ttft_s"]), math.inf, frame["ttft_s"]),
              "tpot": np.where(finished, frame["tpot_s"], math.inf)[n_out >= 2],
              "itl": itl_values(result),
              "e2el": np.where(finished, frame["e2e_s"], math.inf)}
    for name, values in series.items():
        defined = stable and values.size > 0
        ms = values * 1e3
        out[f"mean_{name}_ms"] = finite_or_none(np.mean(ms)) if defined else None
        out[f"median_{name}_ms"] = finite_or_none(percentile(ms, 50)) if defined else None
        out[f"std_{name}_ms"] = finite_or_none(np.std(ms)) if defined else None
        for q in percentiles:
            out[f"p{percentile_word(q)}_{name}_ms"] = finite_or_none(percentile(ms, q)) if defined else None
    return out


def detailed(seed: int, result) -> dict:
    """Every request of one run, as vLLM's --save-detailed lists them (seconds; None = never reached)."""
    frame = per_request(result)
    errors = ["does not fit in the KV cache" if rejected else "" if done else "unfinished"
              for rejected, done in zip(frame["rejected"], frame["finished"])]
    times = result.token_spans
    return {"seed": seed, "input_lens": frame["prompt_tokens"].tolist(), "output_lens": frame["output_tokens"].tolist(),
            "ttfts": [finite_or_none(v) for v in frame["ttft_s"]], "tpots": [finite_or_none(v) for v in frame["tpot_s"]],
            "e2els": [finite_or_none(v) for v in frame["e2e_s"]],
            "itls": [np.diff(result.token_times(i)).tolist() for i in range(len(times))], "errors": errors}


def run_cells(args, cost, traces, slo, step_budget: tuple[int, str], vllm_keys: bool = False) -> list[dict]:
    """One row per (policy, cap, rate): the mean over seeds of each summary figure, and with
    `vllm_keys` the same under vLLM's result names (plus `detailed` per seed with --save-detailed).
    `step_budget` is the chunking policies' (chunk size, what it counts)."""
    chunk_size, chunk_budget = step_budget
    rates = sorted({rate for _, rate, _ in traces})
    record_tokens = slo.itl_ms is not None or vllm_keys
    percentiles = args.metric_percentiles or DEFAULT_METRIC_PERCENTILES
    rows = []
    for policy in chosen_policies(args):
        for cap in chosen_caps(args):
            for rate in rates:
                summaries, figures, details = [], [], []
                for seed, r, trace in traces:
                    if r != rate:
                        continue
                    result = simulate(trace, cost, policy, cap, chunk_size, kv_blocks=args.kv_blocks,
                                      block_size=args.block_size, record_tokens=record_tokens,
                                      chunk_budget=chunk_budget)
                    summaries.append(summarize(result, slo))
                    if vllm_keys:
                        figures.append(vllm_figures(result, summaries[-1], percentiles))
                    if args.save_detailed:
                        details.append(detailed(seed, result))
                cell = {"policy": policy, "max_num_seqs": cap, "rate": rate}
                # the shares count seeds: a per-seed 0/1 whose mean over seeds is the share
                agg = over_seeds(pd.DataFrame([{**cell, **s, "stable_share": float(s["stable"]),
                                                "slo_holds_share": float(s["slo_holds"])} for s in summaries]),
                                 list(cell), spread=True).iloc[0]
                row = {**cell, "seeds": len(summaries), "stable": bool(agg["stable"]),
                       "stable_share": agg["stable_share"], "slo_holds_share": agg["slo_holds_share"]}
                metrics = ["ttft_ms", "tpot_ms"] + (["itl_ms"] if slo.itl_ms is not None else [])
                for metric in metrics:
                    for q in REPORTED_PERCENTILES:
                        row[f"{metric}_p{q}"] = agg[f"{metric}_p{q}"]
                for key in ("goodput_rps", "attainment", "throughput_tok_s", "preemptions", "goodput_rps_std"):
                    row[key] = agg[key]
                row["peak_running"] = int(agg["peak_running_max"])
                if vllm_keys:
                    means = over_seeds(pd.DataFrame([{**cell, **f} for f in figures]), list(cell)).iloc[0]
                    row.update({key: means[key] for key in figures[0]})
                if details:
                    row["detailed"] = details
                rows.append(row)
    return rows


def _fmt(value, digits: int, scale: float = 1.0, unit: str = "") -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value * scale:.{digits}f}{unit}"


def _of_seeds(share, seeds: int) -> str:
    return "-" if math.isnan(share) else f"{round(share * seeds)}/{seeds}"


def describe_step_budget(step_budget: tuple[int, str]) -> str:
    tokens, counts = step_budget
    if counts == "step_tokens":
        return (f"Chunked prefill: at most {tokens} tokens per step, one per decoding sequence included "
                "(--max-num-batched-tokens, vLLM's meaning).")
    return f"Chunked prefill: at most {tokens} prompt tokens per step, the decodes riding along (--chunk-size)."


def format_table(rows: list[dict], slo: SLO, step_budget: tuple[int, str]) -> str:
    has_itl = any("itl_ms_p99" in r for r in rows)
    columns = [("policy", lambda r: r["policy"]), ("cap", lambda r: str(r["max_num_seqs"])),
               ("rate", lambda r: f"{r['rate']:g}"), ("seeds", lambda r: str(r["seeds"])),
               ("stable", lambda r: _of_seeds(r["stable_share"], r["seeds"]))]
    for q in (50, 95, 99):
        columns.append((f"ttft_p{q}_ms", lambda r, q=q: _fmt(r[f"ttft_ms_p{q}"], 0)))
    for q in (50, 95, 99):
        columns.append((f"tpot_p{q}_ms", lambda r, q=q: _fmt(r[f"tpot_ms_p{q}"], 2)))
    if has_itl:
        columns.append(("itl_p99_ms", lambda r: _fmt(r.get("itl_ms_p99"), 2)))
    columns += [("tok/s", lambda r: _fmt(r["throughput_tok_s"], 0)),
                ("goodput_rps", lambda r: _fmt(r["goodput_rps"], 2)),
                ("goodput_std", lambda r: _fmt(r["goodput_rps_std"], 2)),
                ("attain", lambda r: _fmt(r["attainment"], 1, 100, "%")),
                ("slo_holds", lambda r: _of_seeds(r["slo_holds_share"], r["seeds"])),
                ("preempt", lambda r: _fmt(r["preemptions"], 0)),
                ("peak_run", lambda r: str(r["peak_running"]))]
    cells = [[name for name, _ in columns]] + [[get(r) for _, get in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    lines.insert(1, "-" * len(lines[0]))
    lines.append("")
    lines.append(f"SLO: {describe_slo(slo)}. Latencies and goodput are means over seeds; "
                 "- = undefined (a seed's queue grew, so there is no steady state to measure, or no request has the figure); "
                 "peak_run = most sequences running at once (any seed).")
    if any(chunks(r["policy"]) for r in rows):
        lines.append(describe_step_budget(step_budget))
    stable = [r for r in rows if r["stable"]]
    if stable:
        best = max(stable, key=lambda r: r["goodput_rps"] or 0.0)
        lines.append(f"Highest goodput (stable in every seed): {best['policy']} cap {best['max_num_seqs']} at rate "
                     f"{best['rate']:g} -> {_fmt(best['goodput_rps'], 2)} good requests/s")
    elif rows:
        lines.append("Highest goodput: none, no configuration kept up in every seed (its queue grows)")
    return "\n".join(lines)


def describe_slo(slo: SLO) -> str:
    parts = [f"{name} p{pct:g} <= {bound:g} ms" for name, bound, pct in
             (("TTFT", slo.ttft_ms, slo.ttft_percentile), ("TPOT", slo.tpot_ms, slo.tpot_percentile),
              ("ITL", slo.itl_ms, slo.itl_percentile)) if bound is not None]
    return ", ".join(parts) if parts else "none (every finished request is good)"


def format_curve(cost: costmodel.CostModel, context: int) -> str:
    lines = [f"decode step of {cost.name} at {context} tokens of context per sequence",
             f"{'B':>4}  {'step_ms':>8}  {'tok/s':>7}"]
    for row in costmodel.decode_curve(cost, CURVE_BATCHES, context):
        lines.append(f"{row['batch']:>4}  {row['step_ms']:>8.2f}  {row['tokens_per_s']:>7.0f}")
    return "\n".join(lines)


@quiet_on_closed_pipe
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cost = load_cost_model(args.cost_model)
        if args.print_curve:
            print(format_curve(cost, args.curve_context))
            return 0
        slo = slo_from(args)
        if args.save_detailed and not args.save_result:
            raise UsageError("--save-detailed: needs --save-result")
        if args.save_result:
            # before any simulation: a path that cannot be written must not cost a run
            try:
                result_path = check_output_path(args.result_dir, args.result_filename, "--result-filename")
            except InputError as exc:
                raise UsageError(f"--save-result: {exc}") from None
        step_budget = chunk_budget_from(args)
        rows = run_cells(args, cost, load_traces(args), slo, step_budget, vllm_keys=args.json or args.save_result)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    if args.save_result:
        write_json(result_path, {
            "backend": "servingplan-sim", "cost_model": cost.name, "workload": args.workload,
            "num_prompts": args.num_requests, "seeds": seeds_from(args) if args.workload in workload.PRESETS else [0],
            "metric_percentiles": args.metric_percentiles or DEFAULT_METRIC_PERCENTILES,
            "slo": {k: v for k, v in vars(slo).items() if v is not None},
            "chunk_budget": {"tokens": step_budget[0], "counts": step_budget[1]},
            "trace": getattr(args, "trace_summary", None),
            "results": [{k: finite_or_none(v) if isinstance(v, float) else v for k, v in row.items()} for row in rows]})
    if args.json:
        # JSON has no infinity (a trace whose requests all arrive at once has an infinite rate)
        print(json.dumps([{k: finite_or_none(v) if isinstance(v, float) else v for k, v in row.items()}
                          for row in rows], indent=1))
    else:
        print(format_table(rows, slo, step_budget))
        summary = getattr(args, "trace_summary", None)
        if summary:
            print(f"Trace {summary['path']} ({summary['layout']} layout): {summary['rows']} rows, "
                  f"{summary['skipped_zero_token_rows']} with 0 tokens skipped, {summary['requests']} requests "
                  "simulated")
    return 0
