"""The two engines compared on the same workload and targets, as data the report only words
(results/llamacpp/engines.json):

    engine_comparison(torch_cost, llama_cost, torch_validation, llama_validation, workload, slo, validation,
                      sweep, memory, seed) -> dict

- calls: each fitted cost model's time for the same calls: a decode step at batch 1 and at the validated
  cap (every sequence at the workload's mean context halfway through a reply), and a prefill of 128, 256
  and 512 tokens and of the workload's mean prompt; the ratio llama.cpp / torch of each (below one:
  llama.cpp is faster at that call).
- serving: the workload at the load both engines were validated at: the highest of validation.rates_fraction
  up to JUDGED_LOAD (the loads the validation goal is judged at) times the slower engine's service rate
  (validation_replay.reference_rps, each engine's cost model at the cap; today's rate, workload.rate,
  may be beyond both, and a run that does not keep up has no latency to compare), simulated on each
  engine's cost model with its own scheduler at the validated cap (torch: validation.policy; llama.cpp: the `llamacpp` policy
  with llamacpp.n_batch), over the same seeds: the SLO's TTFT percentile and mean TPOT (the mean over seeds),
  whether the TTFT meets slo.ttft_ms and the mean TPOT slo.tpot_ms, and whether the run kept up.
- validation: each engine's worst gap on p90 TTFT and mean TPOT between its simulator and its real server
  (torch: its cost model as fitted, the same figure the validation section leads with), and whether every
  figure met the validation goal.
- server_terms: llama-server's own steps against the benchmark tool's (servingplan.llamacpp.server_terms), as
  the llama.cpp validation carries them: the llama.cpp cost model is its fit with the terms that show a
  difference applied.
- choice: the engine to serve with here: the one meeting more of the two targets in simulation; on a tie,
  the one that kept up, then the one with the lower simulated TTFT; `because` names what decides it (its prefill or its decode
  being faster, from the calls), and `trust` whether that engine's own validation met its goal.
"""
from __future__ import annotations

import numpy as np

from servingplan.simulate import simulate
from servingplan.simulate.metrics import percentile, request_columns
from servingplan.simulate.policies import chunk_budget
from servingplan.simulate.workload import generate
from servingplan.validate.validation import JUDGED_LOAD

ENGINES = ("torch", "llamacpp")
PREFILL_LENGTHS = (128, 256, 512)
# the draws of today's workload each engine is simulated on
SEEDS = 3


def mean_shapes(workload: dict, seed: int) -> tuple[float, float]:
    """The workload's mean prompt and its mean context halfway through a reply."""
    trace = generate(workload, seed)
    prompts, outputs = trace.prompt_tokens.astype(float), trace.output_tokens.astype(float)
    return float(prompts.mean()), float((prompts + outputs / 2).mean())


def calls(costs: dict, cap: int, prompt: float, context: float) -> list[dict]:
    rows = []
    for batch in sorted({1, cap}):
        rows.append({"kind": "decode", "batch": batch, "tokens": None, "mean_prompt": False,
                     **{name: cost.decode_time(batch, batch * context, context) for name, cost in costs.items()}})
    for tokens, mean in [(length, False) for length in PREFILL_LENGTHS] + [(round(prompt), True)]:
        rows.append({"kind": "prefill", "batch": 1, "tokens": int(tokens), "mean_prompt": mean,
                     **{name: cost.prefill_time(int(tokens)) for name, cost in costs.items()}})
    for row in rows:
        row["llamacpp_over_torch"] = row["llamacpp"] / row["torch"]
    return rows


def serving(cost, policy: str, cap: int, chunk: int, workload: dict, slo: dict, sweep: dict, seed: int,
            budget: str, n_ubatch: int | None = None) -> dict:
    """The workload at today's rate on one engine's cost model and scheduler: its TTFT percentile of the SLO
    and mean TPOT (each the mean over SEEDS draws), None where a run did not keep up."""
    runs = [simulate(generate(workload, seed + i), cost, policy, cap, chunk, horizon_factor=sweep["horizon_factor"],
                     chunk_budget=budget, n_ubatch=n_ubatch) for i in range(SEEDS)]
    kept_up = all(run.stable for run in runs)
    ttft, tpot = [], []
    for run in runs:
        frame = request_columns(run)
        ttft.append(percentile(np.asarray(frame["ttft_s"]) * 1e3, slo["ttft_percentile"]))
        tpot.append(float(np.nanmean(np.asarray(frame["tpot_s"]) * 1e3)))
    ttft_ms = float(np.mean(ttft)) if kept_up else None
    tpot_ms = float(np.mean(tpot)) if kept_up else None
    return {"policy": policy, "cap": cap, "chunk": chunk, "kept_up": kept_up, "ttft_ms": ttft_ms, "tpot_mean_ms": tpot_ms,
            "meets_ttft": ttft_ms is not None and ttft_ms <= slo["ttft_ms"],
            "meets_tpot": tpot_ms is not None and tpot_ms <= slo["tpot_ms"]}


def torch_gaps(meta: dict) -> dict:
    fitted = meta["headline"]["as_fitted"]
    return {"ttft_p90_worst_pct": fitted["worst_abs_ttft_p90_diff_pct"],
            "tpot_mean_worst_pct": fitted["worst_abs_tpot_mean_diff_pct"], "met": bool(fitted["met"]),
            "met_corrected": bool(meta["headline"]["met"])}


def llama_gaps(meta: dict) -> dict:
    fitted = meta["headline"]["as_fitted"]
    rows = fitted["rows"]

    def worst(metric):
        values = [abs(row["diff_pct"]) for row in rows if row["metric"] == metric and row["diff_pct"] is not None]
        return max(values) if values else None

    return {"ttft_p90_worst_pct": worst("ttft"), "tpot_mean_worst_pct": worst("tpot"),
            "met": bool(fitted["met"]), "met_corrected": bool(meta["headline"]["corrected"]["met"])}


def engine_comparison(torch_cost, llama_cost, torch_validation: dict, llama_validation: dict, workload: dict,
                      slo: dict, validation: dict, sweep: dict, llamacpp: dict, seed: int) -> dict:
    today = workload["rate"]
    from servingplan.validate.validation_replay import reference_rps   # imports torch: only this job's import pays it
    cap = int(validation["cap"])
    prompt, context = mean_shapes(workload, seed)
    costs = {"torch": torch_cost, "llamacpp": llama_cost}
    call_rows = calls(costs, cap, prompt, context)
    service = {name: reference_rps(cost, workload, cap, seed) for name, cost in costs.items()}
    judged = [f for f in validation["rates_fraction"] if f <= JUDGED_LOAD + 1e-9]
    load = max(judged) if judged else JUDGED_LOAD
    rate = load * min(service.values())
    workload = {**workload, "rate": rate}
    served = {"torch": serving(torch_cost, validation["policy"], cap, sweep["chunk_size"], workload, slo, sweep, seed,
                               chunk_budget(sweep)),
              "llamacpp": serving(llama_cost, "llamacpp", cap, int(llamacpp["n_batch"]), workload, slo, sweep, seed,
                                  chunk_budget(sweep), int(llamacpp["n_ubatch"]))}
    gaps = {"torch": torch_gaps(torch_validation), "llamacpp": llama_gaps(llama_validation)}

    def score(name):
        run = served[name]
        ttft = run["ttft_ms"] if run["ttft_ms"] is not None else float("inf")
        return (-(run["meets_ttft"] + run["meets_tpot"]), -run["kept_up"], ttft)

    chosen = min(ENGINES, key=score)
    other = next(name for name in ENGINES if name != chosen)
    decode_cap = next(row for row in call_rows if row["kind"] == "decode" and row["batch"] == cap)
    mean_prefill = call_rows[-1]
    faster_decode = "llamacpp" if decode_cap["llamacpp_over_torch"] < 1 else "torch"
    faster_prefill = "llamacpp" if mean_prefill["llamacpp_over_torch"] < 1 else "torch"
    because = ("both" if faster_decode == faster_prefill == chosen else
               "prefill" if faster_prefill == chosen else "decode" if faster_decode == chosen else "neither")
    return {"cap": cap, "rate": rate, "load_fraction": load, "service_rate_rps": service,
            "todays_rate": float(today), "mean_prompt_tokens": prompt, "mean_context_tokens": context,
            "slo": {"ttft_ms": slo["ttft_ms"], "ttft_percentile": slo["ttft_percentile"], "tpot_ms": slo["tpot_ms"]},
            "calls": call_rows, "serving": served, "validation": gaps,
            "server_terms": llama_validation["server_terms"],
            "choice": {"engine": chosen, "other": other, "because": because, "faster_decode": faster_decode,
                       "faster_prefill": faster_prefill, "trust": gaps[chosen]["met"],
                       "meets": served[chosen]["meets_ttft"] + served[chosen]["meets_tpot"],
                       "other_meets": served[other]["meets_ttft"] + served[other]["meets_tpot"]}}
