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
import os
import sys
import time
from datetime import datetime
from pathlib import Path

import pandas as pd

from servingplan import costmodel
from servingplan.cli import users, vllm_result
from servingplan.io import MAX_NAME_BYTES, InputError, check_output_path, quiet_on_closed_pipe
from servingplan.report import coverage
from servingplan.seeds import over_seeds
from servingplan.simulate import workload
from servingplan.simulate import POLICIES, simulate
from servingplan.simulate.capacity import Criterion
from servingplan.simulate.closed_loop import simulate_closed_loop
from servingplan.simulate.metrics import SLO, finite_or_none, summarize
from servingplan.simulate.policies import chunks

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
TRACE_FIELDS = ("arrival", "prompt_tokens", "output_tokens")
# vLLM's default burstiness (Poisson) and the bounds of the flag: a gamma shape far outside them
# draws gaps no arrival process needs (and underflows), so it is refused
DEFAULT_BURSTINESS = 1.0
MIN_BURSTINESS = 1e-3
MAX_BURSTINESS = 1e6
MAX_CONCURRENCY = 1_000_000
MAX_METADATA = 50
# a run longer than this prints its progress (cells done / total) on a terminal
PROGRESS_AFTER_S = 2.0


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


def request_rate(text: str) -> float:
    """vLLM's --request-rate: a rate in requests/s, or inf (every request sent at t = 0)."""
    return math.inf if text.strip().lower() == "inf" else arrival_rate(text)


def burstiness_value(text: str) -> float:
    """vLLM's --burstiness: the gamma shape of the gaps between arrivals; inf means constant gaps."""
    if text.strip().lower() == "inf":
        return math.inf
    value = _number(text, float, "a burstiness", 0.0, inclusive=False, maximum=MAX_BURSTINESS)
    if value < MIN_BURSTINESS:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a burstiness >= {MIN_BURSTINESS:g} and <= "
                                         f"{MAX_BURSTINESS:g}, or inf")
    return value


def percentile_metric(text: str) -> str:
    if text not in vllm_result.PERCENTILE_METRICS:
        raise argparse.ArgumentTypeError(f"unknown metric {text!r}: allowed {', '.join(vllm_result.PERCENTILE_METRICS)}")
    return text


def metadata_item(text: str) -> tuple[str, str]:
    try:
        return vllm_result.metadata_pair(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def result_date(text: str) -> str:
    if not vllm_result.DATE_FORMAT.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text!r}: must be a date as vLLM writes it, YYYYMMDD-HHMMSS")
    try:
        datetime.strptime(text, "%Y%m%d-%H%M%S")
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: not a calendar date and time (YYYYMMDD-HHMMSS)") from None
    return text


def file_name(text: str) -> str:
    """A result file name: one path component, no directory (that is --result-dir)."""
    if not text or "/" in text or text in (".", "..") or "\0" in text:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a file name without '/' (the directory is --result-dir)")
    if len(os.fsencode(text)) > MAX_NAME_BYTES:
        raise argparse.ArgumentTypeError(f"{text[:40]!r}...: {len(os.fsencode(text))} bytes long, at most "
                                         f"{MAX_NAME_BYTES} allowed in a file name")
    return text


def percentile_value(text: str) -> float:
    value = _number(text, float, "a percentile", 0.0, inclusive=True)
    if value > 100:
        raise argparse.ArgumentTypeError(f"{text!r}: must be a percentile in [0, 100]")
    return value


def list_of(item_type):
    """A comma-separated list of at most MAX_LIST_ITEMS distinct items, each passing `item_type` (a rate,
    cap or seed given twice would run its cells twice and count them as two seeds)."""
    def parse(text: str):
        items = text.split(",")
        if any(not item.strip() for item in items):
            raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list (empty item)")
        if len(items) > MAX_LIST_ITEMS:
            raise argparse.ArgumentTypeError(f"{len(items)} items: at most {MAX_LIST_ITEMS} allowed")
        values = [item_type(item.strip()) for item in items]
        twice = [item.strip() for item, value in zip(items, values) if values.count(value) > 1]
        if twice:
            raise argparse.ArgumentTypeError(f"{text!r}: {twice[0]!r} given twice; each item must differ")
        return values
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
    p.add_argument("--rate", "--request-rate", dest="rate", type=request_rate, action=_Once,
                   help="arrival rate, requests/s, or inf to send every request at t=0 (default: the workload's)")
    p.add_argument("--sweep-rate", type=list_of(request_rate), help="comma-separated arrival rates (inf allowed)")
    p.add_argument("--burstiness", type=burstiness_value,
                   help="gamma shape of the gaps between a preset's arrivals, drawn as vLLM's benchmark client draws "
                        "them (scale 1/(rate*burstiness); 1 = Poisson, <1 burstier, inf = constant gaps); default: "
                        "the preset's Poisson draw")
    p.add_argument("--max-concurrency", type=bounded_int(MAX_CONCURRENCY),
                   help="closed loop, as vLLM's client: at most N requests in flight, the next sent when one finishes; "
                        "latencies count from the send, the wait for a slot is client_queue_time")
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
    p.add_argument("--capacity-users", type=bounded_int(MAX_CONCURRENCY), metavar="MAX",
                   help="also find, per policy and cap, the most concurrent users (closed loop, each sending its next "
                        "request when its reply ends) for which the SLO holds in every seed, searched up to MAX")
    p.add_argument("--percentile-metrics", type=list_of(percentile_metric),
                   help=f"comma-separated metrics whose statistics the result file holds: "
                        f"{', '.join(vllm_result.PERCENTILE_METRICS)} (default "
                        f"{','.join(vllm_result.DEFAULT_PERCENTILE_METRICS)}, as vLLM)")
    p.add_argument("--save-result", action="store_true",
                   help="write each run (policy, cap, rate, seed) as vLLM's flat result JSON into --result-dir, "
                        "named {label}-{rate}qps[-concurrency{N}]-{model}-{date}.json")
    p.add_argument("--append-result", action="store_true",
                   help="add each run's result as one more JSON line to its file (vLLM's --append-result)")
    p.add_argument("--result-dir", default=".", help="directory of --save-result (default: here)")
    p.add_argument("--result-filename", type=file_name,
                   help="one file for every run instead of vLLM's name per run (several runs need --append-result)")
    p.add_argument("--result-date", type=result_date,
                   help="the date in the results and their file names, YYYYMMDD-HHMMSS (default: now)")
    p.add_argument("--label", type=file_name,
                   help=f"prefix of the result labels and file names, followed by -POLICY-capCAP-seedSEED (default "
                        f"{vllm_result.BACKEND})")
    p.add_argument("--metadata", nargs="+", type=metadata_item, metavar="KEY=VALUE",
                   help="key-value pairs saved in every result, e.g. --metadata version=1 machine=laptop")
    p.add_argument("--save-detailed", action="store_true",
                   help="with --save-result: add every request's lengths, start, TTFT, ITLs, latency, queue time and "
                        "error as top-level lists")
    p.add_argument("--max-context", type=bounded_int(MAX_TOKENS),
                   help="with --trace: most tokens (prompt + reply) a request may hold, as the pipeline's "
                        "trace.max_context")
    p.add_argument("--too-long", choices=list(workload.TOO_LONG_POLICIES),
                   help="with --max-context: refuse the trace, skip the longer requests or clip them (default refuse)")
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
    if (args.max_context is not None or args.too_long is not None) and not args.trace:
        raise UsageError("--max-context/--too-long: fit the requests of a --trace file; give --trace")
    if args.too_long is not None and args.max_context is None:
        raise UsageError(f"--too-long {args.too_long}: needs --max-context")
    if args.burstiness is not None and (args.trace or args.workload not in workload.PRESETS):
        raise UsageError(f"--burstiness {args.burstiness:g}: draws a preset's arrivals; a trace file keeps its own")
    if args.trace:
        return _file_traces(args, rates)
    if args.workload in workload.PRESETS:
        spec = dict(workload.PRESETS[args.workload])
        if args.num_requests:
            spec["num_requests"] = args.num_requests
        if args.burstiness is not None:
            spec["burstiness"] = args.burstiness
        rates = rates or [float(spec["rate"])]
        seeds = seeds_from(args)
        held = spec["num_requests"] * len(seeds) * len(rates)
        if held > MAX_TRACE_REQUESTS:
            raise UsageError(f"--num-requests x seeds x rates = {spec['num_requests']} x {len(seeds)} x "
                             f"{len(rates)} = {held:,} requests: at most {MAX_TRACE_REQUESTS:,} allowed")
        try:
            return [(seed, rate, workload.generate({**spec, "rate": rate}, seed))
                    for rate in rates for seed in seeds]
        except ValueError as exc:  # a rate spreading the requests past the span a simulation replays
            flag = "--sweep-rate" if args.sweep_rate else "--request-rate"
            raise UsageError(f"{flag}: {_reason(exc)}") from None
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
        loaded = workload.load_trace(args.trace, args.trace_layout, args.trace_columns, args.trace_timestamps,
                                     max_context=args.max_context, too_long=args.too_long or "refuse")
    except (ValueError, OSError) as exc:
        # the loader names the pipeline's key; on the command line it is the flag
        raise UsageError(f"--trace {args.trace!r}: {_reason(exc).replace('set too_long to', 'give --too-long')}") from None
    trace = _first(loaded.trace, args.num_requests)
    args.trace_summary = {"path": args.trace, "layout": loaded.layout, "rows": loaded.rows,
                          "skipped_zero_token_rows": loaded.skipped_zero_tokens, "requests": len(trace),
                          "too_long": loaded.too_long, "too_long_requests": loaded.too_long_requests}
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


def simulate_run(args, cost, trace: workload.Trace, rate: float, policy: str, cap: int,
                 step_budget: tuple[int, str], record_tokens: bool):
    """One run: the open loop of the simulator, or the closed loop (servingplan.simulate.closed_loop) under
    --max-concurrency and at an infinite rate, where every request is sent at t = 0 and the run drains."""
    chunk_size, chunk_budget = step_budget
    options = dict(kv_blocks=args.kv_blocks, block_size=args.block_size, record_tokens=record_tokens,
                   chunk_budget=chunk_budget)
    if args.max_concurrency is not None or math.isinf(rate):
        return simulate_closed_loop(trace, cost, policy, cap, args.max_concurrency, chunk_size, **options)
    return simulate(trace, cost, policy, cap, chunk_size, **options)


class Progress:
    """Runs done / total on stderr, on a terminal only and once the work has lasted PROGRESS_AFTER_S."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled, self.shown = total, enabled, False
        self.started = time.monotonic()

    def update(self, done: int) -> None:
        if self.enabled and (self.shown or time.monotonic() - self.started >= PROGRESS_AFTER_S):
            self.shown = True
            print(f"\r{PROG}: {done}/{self.total} runs simulated", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.shown:
            print(file=sys.stderr, flush=True)


def row_percentile_metrics(args) -> list[str]:
    """The metrics of the rows' vLLM keys: every request-level one, and the client queue when closed-loop."""
    return list(vllm_result.PERCENTILE_METRICS[:4]) + (["client_queue_time"] if args.max_concurrency else [])


def run_cells(args, cost, traces, slo, step_budget: tuple[int, str], vllm_keys: bool = False,
              on_run=None, progress: Progress | None = None) -> list[dict]:
    """One row per (policy, cap, rate): the mean over seeds of each summary figure, and with
    `vllm_keys` the same under vLLM's result names. `step_budget` is the chunking policies' (chunk
    size, what it counts). `on_run(policy, cap, rate, seed, result, summary)` sees every run."""
    rates = sorted({rate for _, rate, _ in traces})
    record_tokens = slo.itl_ms is not None or vllm_keys or on_run is not None
    percentiles = args.metric_percentiles or DEFAULT_METRIC_PERCENTILES
    goodput = any(bound is not None for bound in (slo.ttft_ms, slo.tpot_ms, slo.itl_ms, slo.e2el_ms))
    rows, done = [], 0
    for policy in chosen_policies(args):
        for cap in chosen_caps(args):
            for rate in rates:
                summaries, figures = [], []
                for seed, r, trace in traces:
                    if r != rate:
                        continue
                    result = simulate_run(args, cost, trace, rate, policy, cap, step_budget, record_tokens)
                    summaries.append(summarize(result, slo))
                    if vllm_keys:
                        figures.append(run_figures(args, result, summaries[-1], percentiles, goodput))
                    if on_run is not None:
                        on_run(policy, cap, rate, seed, result, summaries[-1])
                    done += 1
                    if progress is not None:
                        progress.update(done)
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
                rows.append(row)
    return rows


# the figures of a run, not its setup: what a row averages over seeds
_SETUP_KEYS = ("date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
               "request_rate", "burstiness", "max_concurrency", "stable")


def run_figures(args, result, summary: dict, percentiles, goodput: bool) -> dict:
    """One run's figures under vLLM's result keys (the numbers of its result file, without the lists)."""
    full = vllm_result.run_result(result, summary, rate=0.0, burstiness=1.0, max_concurrency=None, num_prompts=0,
                                  model_id="", label="", date="", metadata={}, percentiles=percentiles,
                                  percentile_metrics=row_percentile_metrics(args), goodput=goodput, detailed=False,
                                  extra={})
    return {k: (math.nan if v is None else v) for k, v in full.items() if k not in _SETUP_KEYS}


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
    """Every bound given, each with the percentile the run must hold it at."""
    parts = [f"{name} p{pct:g} <= {bound:g} ms" for name, bound, pct in
             (("TTFT", slo.ttft_ms, slo.ttft_percentile), ("TPOT", slo.tpot_ms, slo.tpot_percentile),
              ("ITL", slo.itl_ms, slo.itl_percentile), ("E2EL", slo.e2el_ms, slo.e2el_percentile))
             if bound is not None]
    return ", ".join(parts) if parts else "none (every finished request is good)"


def format_curve(cost: costmodel.CostModel, context: int) -> str:
    lines = [f"decode step of {cost.name} at {context} tokens of context per sequence",
             f"{'B':>4}  {'step_ms':>8}  {'tok/s':>7}"]
    for row in costmodel.decode_curve(cost, CURVE_BATCHES, context):
        lines.append(f"{row['batch']:>4}  {row['step_ms']:>8.2f}  {row['tokens_per_s']:>7.0f}")
    return "\n".join(lines)


def result_plan(args, cost, traces) -> tuple[str, int]:
    """Check the --save-result options before any work: (date, runs) of the files to write."""
    saving = args.save_result or args.append_result
    for flag, given in (("--save-detailed", args.save_detailed), ("--result-filename", args.result_filename),
                        ("--result-date", args.result_date), ("--label", args.label), ("--metadata", args.metadata),
                        ("--percentile-metrics", args.percentile_metrics)):
        if given and not saving:
            raise UsageError(f"{flag}: shapes the result file; needs --save-result or --append-result")
    keys = [key for key, _ in args.metadata or []]
    if len(keys) > MAX_METADATA or len(set(keys)) < len(keys):
        raise UsageError(f"--metadata {' '.join(keys)}: at most {MAX_METADATA} pairs, each key once")
    taken = set(vllm_result.RESULT_KEYS) & set(keys)
    if taken:
        raise UsageError(f"--metadata {', '.join(sorted(taken))}: a result key of vLLM's; choose another key")
    if "client_queue_time" in (args.percentile_metrics or []) and args.max_concurrency is None:
        raise UsageError("--percentile-metrics client_queue_time: a request waits for a slot only under "
                         "--max-concurrency")
    runs = len(chosen_policies(args)) * len(chosen_caps(args)) * len(traces)
    if saving and args.result_filename and runs > 1 and not args.append_result:
        raise UsageError(f"--result-filename {args.result_filename!r}: {runs} runs (policies x caps x rates x seeds) "
                         "into one file need --append-result")
    date = args.result_date or datetime.now().strftime("%Y%m%d-%H%M%S")
    if saving:
        # before any simulation: a path that cannot be written must not cost a run
        for policy in chosen_policies(args):
            for cap in chosen_caps(args):
                for seed, rate, _ in traces:
                    try:
                        check_output_path(args.result_dir, result_name(args, cost, policy, cap, rate, seed, date),
                                          "--result-filename" if args.result_filename else "result file", "--result-dir")
                    except InputError as exc:
                        raise UsageError(f"--save-result: {exc}") from None
    return date, runs


def result_label(args, policy: str, cap: int, seed: int) -> str:
    return f"{args.label or vllm_result.BACKEND}-{policy}-cap{cap}-seed{seed}"


def result_name(args, cost, policy: str, cap: int, rate: float, seed: int, date: str) -> str:
    """The file a run's result goes to: --result-filename, or vLLM's name for the run."""
    return args.result_filename or vllm_result.result_filename(result_label(args, policy, cap, seed), rate,
                                                               args.max_concurrency, cost.name, date)


def outside_profile(cost: costmodel.CostModel, traces) -> str | None:
    """A warning when requests lie outside the prompt lengths or contexts the cost model was profiled
    on (its meta.profiled_range, which the fit writes): its times there are extrapolated."""
    try:
        ranges = coverage.profiled_range(cost.meta, MAX_TOKENS)
    except ValueError as exc:
        raise UsageError(f"--cost-model {cost.name!r}: {exc}") from None
    if ranges is None:
        return None
    counts = coverage.outside_counts([trace for _, _, trace in traces], ranges)
    if not counts["outside"]:
        return None
    (prompt_lo, prompt_hi), context_hi = ranges["prompt_tokens"], ranges["context_tokens"][1]
    return (f"{PROG}: warning: {counts['outside']} of {counts['requests']} simulated requests lie outside the profiled "
            f"range of cost model {cost.name!r} (prompt {prompt_lo}..{prompt_hi} tokens, context up to {context_hi} "
            "tokens); their step times are extrapolated")


def users_capacity(args, cost, traces, slo: SLO, step_budget: tuple[int, str]) -> dict:
    """servingplan.cli.users.capacity_users for every (policy, cap), on each seed's requests."""
    by_seed = {}
    for seed, _, trace in traces:
        by_seed.setdefault(seed, trace)
    return {(policy, cap): users.capacity_users(list(by_seed.values()), list(by_seed), cost, policy, cap, step_budget[0],
                                                Criterion(slo), args.capacity_users, args.kv_blocks, args.block_size,
                                                step_budget[1])
            for policy in chosen_policies(args) for cap in chosen_caps(args)}


def _users(seed: dict) -> str:
    held = f"seed {seed['seed']}: {seed['lower']}"
    return held + ("+" if seed["censored"] == "above_max" else "")


@quiet_on_closed_pipe
def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cost = load_cost_model(args.cost_model)
        if args.print_curve:
            print(format_curve(cost, args.curve_context))
            return 0
        slo = slo_from(args)
        step_budget = chunk_budget_from(args)
        traces = load_traces(args)
        date, runs = result_plan(args, cost, traces)
        if args.capacity_users and slo == SLO(ttft_percentile=args.slo_ttft_pct, tpot_percentile=args.slo_tpot_pct,
                                              itl_percentile=args.slo_itl_pct):
            raise UsageError(f"--capacity-users {args.capacity_users}: needs an SLO bound to hold (--slo-ttft-ms, "
                             "--slo-tpot-ms, --slo-itl-ms or --goodput)")
        warning = outside_profile(cost, traces)
    except UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    if warning:
        print(warning, file=sys.stderr)
    saved = []

    def keep_result(policy, cap, rate, seed, result, summary):
        label = result_label(args, policy, cap, seed)
        saved.append((Path(args.result_dir) / result_name(args, cost, policy, cap, rate, seed, date), vllm_result.run_result(
            result, summary, rate=rate, burstiness=args.burstiness or DEFAULT_BURSTINESS,
            max_concurrency=args.max_concurrency, num_prompts=len(result.arrival_s), model_id=cost.name, label=label,
            date=date, metadata=dict(args.metadata or []),
            percentiles=args.metric_percentiles or DEFAULT_METRIC_PERCENTILES,
            percentile_metrics=args.percentile_metrics or list(vllm_result.DEFAULT_PERCENTILE_METRICS),
            goodput=bool(args.goodput), detailed=args.save_detailed,
            extra={"policy": policy, "max_num_seqs": cap, "seed": seed, "workload": args.trace or args.workload,
                   "chunk_budget": {"tokens": step_budget[0], "counts": step_budget[1]},
                   **({"trace": args.trace_summary} if args.trace else {})})))

    saving = args.save_result or args.append_result
    progress = Progress(runs, enabled=sys.stderr.isatty() and not args.json)
    try:
        rows = run_cells(args, cost, traces, slo, step_budget, vllm_keys=args.json,
                         on_run=keep_result if saving else None, progress=progress)
    finally:
        progress.close()
    for path, result in saved:
        vllm_result.save(path, result, append=args.append_result)
    if args.capacity_users:
        users_found = users_capacity(args, cost, traces, slo, step_budget)
        for row in rows:
            row["capacity_users"] = users_found[(row["policy"], row["max_num_seqs"])]["capacity_users"]
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
                  "simulated" + (f", {summary['too_long_requests']} longer than --max-context "
                                 f"{'skipped' if summary['too_long'] == 'skip' else 'clipped'}"
                                 if summary['too_long_requests'] else ""))
        if args.capacity_users:
            for (policy, cap), found in users_found.items():
                print(f"Most concurrent users holding the SLO in every seed: {policy} cap {cap} -> "
                      f"{found['capacity_users']} users ({', '.join(_users(s) for s in found['per_seed'])}; "
                      f"searched up to {args.capacity_users})")
        if saved:
            print(f"Saved {len(saved)} vLLM result{'s' if len(saved) > 1 else ''} in {args.result_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
