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

`carry_over` is pure; the pipeline's rule carry_over writes a target's model, and the planner's cells
run on it as on this machine's (rules/simulate.smk, rules/plan.smk, machine wildcard).
"""
from __future__ import annotations

from dataclasses import dataclass

from servingplan import architecture
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
