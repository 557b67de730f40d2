"""Replay a Poisson trace against a real llama-server with the streaming client, and (given a cost model)
simulate the same trace under the `llamacpp` policy, side by side.

    python scripts/llamacpp_replay.py --model model.gguf --rate 0.5 --requests 30 --np 8 \
        --ctx 6144 -b 2048 -ub 512 --threads 2 [--costmodel results/fit/costmodel.json] --out replay.json

The trace is servingplan.simulate.workload's (the capstone's prompt and output distributions unless --prompt-* /
--output-* are given), at `--rate` requests/s. Prompts are random token ids (--vocab). The JSON holds the
settings, one row per request (arrival, sent, token times, error) and the client's summary (TTFT, TPOT,
ITL, E2E in ms); with --costmodel also the simulator's summary of the same trace. `--server-log` keeps
llama-server's log at `-lv 5 --log-timestamps`, which servingplan.llamacpp.server_log reads into steps.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from servingplan.cli.main import MAX_TOKENS, bounded_int  # noqa: E402
from servingplan.llamacpp.client import random_prompts, run_trace, summarize  # noqa: E402
from servingplan.llamacpp.server import FLOAT32_KV, STEP_LOG_ARGS, LlamaServer  # noqa: E402
from servingplan.simulate import workload  # noqa: E402


def make_trace(args):
    spec = {**workload.CAPSTONE, "num_requests": args.requests, "rate": args.rate}
    if args.prompt_min is not None:
        spec["prompt"] = {"dist": "uniform", "min": args.prompt_min, "max": args.prompt_max}
    if args.output_len is not None:
        spec["output"] = {"dist": "uniform", "min": args.output_len, "max": args.output_len}
    return workload.generate(spec, args.seed)


def simulated(trace, args) -> dict:
    from servingplan.costmodel import CostModel
    from servingplan.simulate import metrics
    from servingplan.simulate import simulate
    cost = CostModel.from_dict(json.loads(Path(args.costmodel).read_text()))
    result = simulate(trace, cost, "llamacpp", args.np, chunk_size=args.n_batch, record_tokens=True,
                      n_ubatch=args.n_ubatch)
    return metrics.summarize(result)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, required=True, help="GGUF file (servingplan.llamacpp.gguf_model)")
    p.add_argument("--url", help="an already running llama-server (loopback) instead of starting one")
    p.add_argument("--rate", type=float, required=True)
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-min", type=int)
    p.add_argument("--prompt-max", type=int)
    p.add_argument("--output-len", type=int)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--np", type=int, default=8)
    p.add_argument("--ctx", type=int, default=6144)
    # both reach the simulation too (--costmodel), so they are held to the CLI's token bounds
    p.add_argument("-b", "--n-batch", type=bounded_int(MAX_TOKENS), default=2048)
    p.add_argument("-ub", "--n-ubatch", type=bounded_int(MAX_TOKENS), default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--costmodel", type=Path)
    p.add_argument("--server-log", type=Path)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if (args.prompt_min is None) != (args.prompt_max is None):
        p.error("--prompt-min and --prompt-max go together")

    trace = make_trace(args)
    prompts = random_prompts(trace.prompt_tokens, args.vocab, args.seed)
    outputs = [int(n) for n in trace.output_tokens]
    if args.url:
        results = run_trace(args.url, trace.arrival_s, prompts, outputs, timeout_s=args.timeout)
    else:
        with LlamaServer(args.model, threads=args.threads, n_parallel=args.np, ctx=args.ctx, n_batch=args.n_batch,
                         n_ubatch=args.n_ubatch, verbosity=5 if args.server_log else None,
                         log_file=args.server_log,
                         extra_args=FLOAT32_KV + (STEP_LOG_ARGS if args.server_log else ())) as server:
            results = run_trace(server.url, trace.arrival_s, prompts, outputs, timeout_s=args.timeout)
    out = {
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "measured": summarize(results),
        "requests": [{"index": r.index, "arrival_s": r.arrival_s, "sent_s": r.sent_s,
                      "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                      "token_times_s": r.token_times_s, "error": r.error} for r in results],
    }
    if args.costmodel:
        out["simulated"] = simulated(trace, args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1, default=float))
    return out


if __name__ == "__main__":
    main()
