"""Carry the fitted step-time model over to a machine the pipeline did not run on, by the roofline.

Every term of the cost model (servingplan.costmodel) is the time of some work: a decode call's
weight read, one sequence's matrix products, one cached token's attention, and so on. From the
model's shape (servingplan.architecture) each term gets the bytes it moves and the FLOPs it does.
Its roofline time on a machine is max(bytes / bandwidth, FLOPs / float32 rate); the resource that
gives the larger time bounds it. A term is carried over to a target machine by the ratio of its
roofline time there to its roofline time here (this machine's roofline probes, machine.json), which
keeps the share of the roofline the term reached here (its efficiency) unchanged:

    term_target = term_here * roofline_target / roofline_here

A term bound by memory on both machines scales with bandwidth alone, one bound by compute with the
float32 rate alone. The result is an estimate from the roofline, not a measurement: it assumes the
target's kernels reach the same share of its peak as this machine's reached of its probes.

`carry_over` is pure; `target_plan` re-runs the planner's cells on the carried-over model.
"""
from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

from servingplan import architecture, planner
from servingplan.costmodel import CostModel

GB = 1e9
GFLOP = 1e9


@dataclass(frozen=True)
class Work:
    """What one unit of a cost-model term moves and computes."""
    bytes: float
    flops: float


def term_work(arch: dict) -> dict[str, Work]:
    """Bytes and FLOPs behind one unit of each cost-model term (per call, per sequence, per token, ...)
    of a GPT-2 shaped model in float32. Weights are read once per call; every weight except the
    position table takes part in one multiply-add per token (2 FLOPs), the tied LM head included; a
    token's keys and values are written when it is computed and read once per decode step that
    attends to it; attention does 2 FLOPs per channel for the scores and 2 for the weighted values,
    and writes one float32 score per head for each pair of tokens."""
    weights = float(architecture.weight_bytes(arch))
    per_token_flops = 2.0 * (architecture.weight_count(arch) - arch["n_positions"] * arch["n_embd"])
    kv = float(architecture.kv_bytes_per_token(arch))
    pair_flops = 4.0 * arch["n_embd"] * arch["n_layer"]
    pair_bytes = float(architecture.FLOAT32_BYTES * arch["n_head"] * arch["n_layer"])
    return {
        "decode_fixed_s": Work(weights, 0.0),
        "decode_per_seq_s": Work(kv, per_token_flops),
        "decode_per_ctx_token_s": Work(kv, pair_flops),
        "prefill_fixed_s": Work(weights, 0.0),
        "prefill_per_token_s": Work(kv, per_token_flops),
        "prefill_per_token_sq_s": Work(pair_bytes, pair_flops),
        "prefill_per_token_ctx_s": Work(pair_bytes, pair_flops),
    }


def batch_work(arch: dict, batch: int) -> Work:
    """A whole batch-dependent decode part f(B): the weights once, B sequences' products and KV writes."""
    work = term_work(arch)
    return Work(work["decode_fixed_s"].bytes + batch * work["decode_per_seq_s"].bytes,
                batch * work["decode_per_seq_s"].flops)


def roofline(work: Work, bandwidth_gbs: float, gflops: float) -> tuple[float, str]:
    """(seconds, bound): the roofline time of `work` and the resource that sets it."""
    memory_s, compute_s = work.bytes / (bandwidth_gbs * GB), work.flops / (gflops * GFLOP)
    return (memory_s, "memory") if memory_s >= compute_s else (compute_s, "compute")


def _carry(name: str, seconds: float, work: Work, here: dict, target: dict, batch: int | None = None) -> dict:
    here_s, here_bound = roofline(work, here["bandwidth_gbs"], here["gflops"])
    target_s, target_bound = roofline(work, target["bandwidth_gbs"], target["gflops"])
    scale = target_s / here_s
    return {"term": name, "batch": batch, "bytes": work.bytes, "flops": work.flops,
            "bound_here": here_bound, "bound_target": target_bound,
            "roofline_here_s": here_s, "roofline_target_s": target_s, "scale": scale,
            "seconds_here": seconds, "seconds_target": seconds * scale}


def carry_over(cost: CostModel, arch: dict, here: dict, target: dict) -> tuple[CostModel, list[dict]]:
    """`cost` carried from the machine of roofline `here` to `target` (each a dict with bandwidth_gbs
    and gflops), and one row per term: its bytes and FLOPs, the resource bounding it on each machine,
    and the scale factor applied. The speed band and the rest of `cost.meta` stay as measured here."""
    work = term_work(arch)
    coefficients = {"decode_fixed_s": cost.decode_fixed_s, "decode_per_seq_s": cost.decode_per_seq_s,
                    "decode_per_ctx_token_s": cost.decode_per_ctx_token_s, "prefill_fixed_s": cost.prefill_fixed_s,
                    "prefill_per_token_s": cost.prefill_per_token_s,
                    "prefill_per_token_sq_s": cost.prefill_per_token_sq_s,
                    "prefill_per_token_ctx_s": cost.prefill_per_token_ctx_s}
    terms = [_carry(name, seconds, work[name], here, target) for name, seconds in coefficients.items()]
    table = [_carry("decode_batch_fixed_s", seconds, batch_work(arch, batch), here, target, batch)
             for batch, seconds in cost.decode_batch_fixed_s]
    scaled = {t["term"]: t["seconds_target"] for t in terms}
    model = CostModel(**scaled, ctx_mode=cost.ctx_mode, name=f"{cost.name} carried to {target['name']}",
                      source=f"roofline estimate for {target['name']} from {cost.name}", meta=dict(cost.meta),
                      decode_batch_fixed_s=tuple((t["batch"], t["seconds_target"]) for t in table))
    return model, terms + table


def here_roofline(machine: dict) -> dict:
    """This machine's roofline: the bandwidth and GEMM probes its profile measured."""
    probes = machine["roofline"]
    return {"name": "this machine", "bandwidth_gbs": float(probes["bandwidth_gbs"]),
            "gflops": float(probes["gemm_gflops"])}


def target_plan(cost: CostModel, machine: dict, model_cfg: dict, target: dict, cells: list[tuple[str, int]],
                workload: dict, slo: dict, sweep: dict, memory: dict, seeds: list[int], capacity: dict,
                cost_cfg: dict) -> dict:
    """What the recommendation needs for one target machine, price aside: the carried-over model with
    its per-term scale factors, and per (policy, cap) cell the latency at today's rate and the capacity
    target rate, the capacity (TTFT target and keeping up, with the speed band) and the fleet and
    speed-up searches, all from the planner's own cell functions with the same seeds."""
    here = here_roofline(machine)
    scaled, terms = carry_over(cost, architecture.architecture(model_cfg), here, target)
    today_only = {**sweep, "rates": [workload["rate"]]}
    args = (workload, slo, sweep, memory, seeds)
    latency = pd.concat([planner.sweep_cell(scaled, machine, p, c, workload, slo, today_only, memory, seeds)
                         for p, c in cells], ignore_index=True)
    capacity_rows = [row for p, c in cells
                     for row in planner.capacity_rows(planner.capacity_cell(scaled, machine, p, c, *args, capacity,
                                                                            criteria=("ttft_slo", "stable")))]
    # the speed-up's interval over the speed band is not reported for a target: one search, not three
    fleets = [planner.fleet_cell(scaled, machine, p, c, *args, capacity, cost_cfg, speedup_band=False)
              for p, c in cells]
    return {"target": dict(target), "here": here, "terms": terms, "costmodel": scaled.to_dict(),
            # an undefined figure (an unstable run's percentile) as null, so the file is plain JSON
            "latency": latency.astype(object).where(latency.notna(), None).to_dict(orient="records"),
            "capacity": capacity_rows, "fleet": fleets}


def target_verdicts(plan: dict, target: dict, machine: dict, cost_cfg: dict, slo: dict, workload: dict,
                    memory_cfg: dict, seeds: list[int]) -> dict:
    """The recommendation for `target` (its config entry) from its `target_plan`, at the target's own
    price per hour (the config's cost.price_per_hour when it states none); memory by this machine's
    arithmetic, which the model's shape sets, with the KV peak of the target's own simulations. The memory
    the engine measured while serving here is not part of it: that is this machine's process (its runtime
    and allocator), which no target shares, and a measurement that varies run to run."""
    if plan["target"]["name"] != target["name"]:
        raise ValueError(f"hardware plan of {plan['target']['name']!r} given for target {target['name']!r}")
    price_given = target.get("price_per_hour") is not None
    priced = {**cost_cfg, "price_per_hour": target["price_per_hour"] if price_given else cost_cfg["price_per_hour"]}
    latency = pd.DataFrame(plan["latency"])
    memory, _ = planner.memory_table(machine, latency, memory_cfg, workload["rate"])
    recommendation = planner.recommend(latency, pd.DataFrame(plan["capacity"]), memory, plan["fleet"], priced, slo,
                                       workload, seeds, step_model=CostModel.from_dict(plan["costmodel"]),
                                       machine=machine)
    return {"name": target["name"], "description": target.get("description", ""),
            "bandwidth_gbs": plan["target"]["bandwidth_gbs"], "gflops": plan["target"]["gflops"],
            "price_per_hour": priced["price_per_hour"], "price_given": price_given,
            "here": plan["here"], "terms": plan["terms"], "recommendation": recommendation}
