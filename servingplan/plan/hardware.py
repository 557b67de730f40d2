"""Carry the fitted step-time model over to a machine the pipeline did not run on, by the roofline.

Every term of the cost model (servingplan.costmodel) is the time of some work: a decode call's
weight read, one sequence's matrix products, one cached token's attention, and so on. The bytes it
moves and the FLOPs it does come from servingplan.roofline, the one work model the profiler and the
fit use too. Its roofline time (floor) on a machine is max(bytes / bandwidth, FLOPs / float32 rate).
A term's time here is its floor here plus the time it took above it. How that excess travels depends
on the target's kind (CARRY_RULES):

    cpu:  term_target = max(floor_target + (term_here - floor_here) / core_speedup, floor_target)
    gpu:  term_target = max(term_here * floor_target / floor_here, floor_target, launch overhead)

On a CPU target only the roofline share of a term moves with the target's bandwidth and FLOP rate; the
time above the floor (the Python loop, the dispatcher, kernels that fall short of the probes: a batch-1
decode step here runs at a third of its floor's bandwidth) is carried as it was, divided by the
target's `core_speedup` (how much faster one of its cores runs this machine's host work; default 1,
as fast as here). The carry-over check measures that rule: this machine at 1 thread reads 1.5 times
less bandwidth and 1.8 times less FLOP rate, yet its batch-1 to batch-8 decode steps took 0.98 to 1.06
times as long as at 2 threads; keeping each term's efficiency instead put them 38 to 49% too slow, and
6 of 18 capacity cells within 15% against 16 of 18 with this rule (docs/benchmarks.md).

On a GPU target that excess is not host time carried over: the host's share is the launch overhead
below, paid per model call, and the kernels are assumed to reach the same share of the target's
roofline as this machine's reached of its probes (the term keeps its efficiency). A GPU check
(servingplan.gpu_check) measures both on a real GPU.

Here's floor uses the rates the profiled calls ran at: the median of the probe readings taken through
the profile (machine.json roofline.seen), not their peak. On this shared machine two cores drew 31 to
64 GB/s of bandwidth from one reading to the next while one core drew 28 to 34; the profiled times are
medians over rounds, so they ran at the typical reading. Scaled from the peak, a profile that caught
one quiet minute would carry its calls over as if they had used twice the bandwidth they saw.

The max is the target's own floor: a term fitted faster than this machine's floor (an imported model,
or probes read differently) would otherwise carry its impossible speed over; each row records
whether it was clamped. A GPU target (`kind: gpu`) also pays the host's time per model call, which no
roofline sees: eager PyTorch launches each of a forward pass's kernels from Python, one after another
(LAUNCH_OVERHEAD_BASIS). A decode step or prefill call there never takes less than
`launch_overhead_ms`, so its fixed terms (and each decode-batch table value) are floored at it too.
A GPU check measures that host time; with config gpu_check, a GPU target that sets no
launch_overhead_ms of its own pays the measured one, and says so (launch_overhead_origin).

The result is an estimate from the roofline, not a measurement (CARRY_OVER_LEAVES_OUT says what it
leaves out, by kind).

`carry_over` is pure; the pipeline's rule carry_over writes a target's model, and the planner's cells
run on it as on this machine's (rules/simulate.smk, rules/plan.smk, machine wildcard).
"""
from __future__ import annotations

from servingplan import roofline
from servingplan.costmodel import CostModel

# The machine id of the machine the pipeline runs on, beside the `hardware` targets' names: no target
# may take it.
HERE = "here"
MACHINE_KINDS = ("cpu", "gpu")
# The default host time of one forward pass of the model on a GPU target, in ms (config:
# hardware[].launch_overhead_ms). GPT-2 small's forward in eager PyTorch (transformers' GPT2 blocks)
# runs about 20 operators per layer (LayerNorm x 2, the four products, the KV-cache update, attention,
# GELU's tanh form as several elementwise kernels, two residual adds), so about 250 kernels for 12
# layers with the embeddings, final LayerNorm and LM head; at about 10 µs of host time each (Python
# module calls, the dispatcher and the CUDA launch itself) that is 2.5 ms, whatever the GPU's speed. A
# server that captures the forward in a CUDA graph (vLLM's default) pays a fraction of it: set the key
# to what such an engine measures.
DEFAULT_GPU_LAUNCH_OVERHEAD_MS = 2.5
LAUNCH_OVERHEAD_BASIS = ("about 250 kernels per GPT-2 small forward pass in eager PyTorch, about 10 µs of host "
                         "time each (Python, dispatcher, CUDA launch)")
# How each kind carries a term's time above its floor here (see the module docstring).
CARRY_RULES = {"cpu": "roofline share", "gpu": "efficiency"}
# The default core_speedup of a CPU target: its cores run this machine's host work as fast as these.
DEFAULT_CORE_SPEEDUP = 1.0
CARRY_OVER_LEAVES_OUT = {
    "cpu": ("the target's roofline share reached at another share of its peak than this machine's of its probes",
            "the target's cores running the time above the floor (the Python loop, the dispatcher, kernels short "
            "of their peak) other than its stated core speed-up",
            "caches, vector units and thread counts that change how much of that time more cores take off"),
    "gpu": ("the target's kernels reaching a different share of its peak than this machine's did of its probes",
            "the host CPU of the target, its Python loop and scheduler beyond the stated launch overhead",
            "transfers between host and device (token ids in, logits out) and their synchronisation",
            "kernel fusion, CUDA graphs or other engines that change the work per call"),
}


def machine_kind(target: dict) -> str:
    return target.get("kind", "cpu")


def core_speedup(target: dict) -> float:
    """How many times faster one core of a CPU `target` runs this machine's time above the floor: its
    core_speedup, else DEFAULT_CORE_SPEEDUP (the config refuses the key on a GPU target)."""
    given = target.get("core_speedup")
    return DEFAULT_CORE_SPEEDUP if given is None else float(given)


def launch_overhead_s(target: dict) -> float:
    """Host time per model call on `target`: its launch_overhead_ms, else the default of its kind (none
    for a CPU, whose host loop is part of the terms measured and carried over)."""
    default = DEFAULT_GPU_LAUNCH_OVERHEAD_MS if machine_kind(target) == "gpu" else 0.0
    given = target.get("launch_overhead_ms")
    return (default if given is None else float(given)) / 1000.0


def launch_overhead_origin(target: dict) -> tuple[str | None, str | None]:
    """(source, basis) of the host time per model call `target` pays: "measured" with the basis a GPU
    check states (the rule carry_over fills in launch_overhead_ms and launch_overhead_basis from config
    gpu_check for a GPU target that sets neither: servingplan.plan.gpu_evidence), "configured" (its own
    launch_overhead_ms) or "default" (LAUNCH_OVERHEAD_BASIS); (None, None) when it pays none."""
    if not launch_overhead_s(target):
        return None, None
    if target.get("launch_overhead_basis"):
        return "measured", target["launch_overhead_basis"]
    if target.get("launch_overhead_ms") is not None:
        return "configured", "as configured (hardware[].launch_overhead_ms)"
    return "default", LAUNCH_OVERHEAD_BASIS


# the terms paid once per model call: the ones a per-call launch overhead floors
PER_CALL_TERMS = ("decode_fixed_s", "prefill_fixed_s", "decode_batch_fixed_s")
ROUNDING = 1e-9


def _carry(name: str, seconds: float, work: roofline.Work, here: dict, target: dict,
           batch: int | None = None) -> dict:
    here_s, here_bound = roofline.floor(work, here["bandwidth_gbs"], here["gflops"])
    target_s, target_bound = roofline.floor(work, target["bandwidth_gbs"], target["gflops"])
    scale = target_s / here_s
    overhead = launch_overhead_s(target) if name in PER_CALL_TERMS else 0.0
    source, basis = launch_overhead_origin(target) if overhead else (None, None)
    floor_target = max(target_s, overhead)
    rule = CARRY_RULES[machine_kind(target)]
    above_floor = seconds - here_s
    if rule == "roofline share":
        scaled = target_s + above_floor / core_speedup(target)
    else:
        scaled = seconds * scale
    carried = max(scaled, floor_target)
    # a term the fit held at this machine's floor scales to the target's floor up to rounding: not a clamp
    clamped = scaled < floor_target * (1 - ROUNDING)
    clamped_to = ("launch overhead" if overhead > target_s else "roofline") if clamped else None
    return {"term": name, "batch": batch, "bytes": work.bytes, "flops": work.flops,
            "bound_here": here_bound, "bound_target": target_bound,
            "roofline_here_s": here_s, "roofline_target_s": target_s, "scale": scale, "rule": rule,
            "efficiency_here": here_s / seconds if seconds > 0 else None, "above_floor_here_s": above_floor,
            "launch_overhead_s": overhead, "launch_overhead_source": source, "launch_overhead_basis": basis,
            "floor_target_s": floor_target,
            "seconds_here": seconds, "seconds_scaled": scaled, "seconds_target": carried,
            "ratio": carried / seconds if seconds > 0 else None,
            "clamped": clamped_to is not None, "clamped_to": clamped_to}


def carry_over(cost: CostModel, arch: dict, here: dict, target: dict) -> tuple[CostModel, list[dict]]:
    """`cost` carried from the machine of roofline `here` to `target` (each a dict with bandwidth_gbs
    and gflops; the target's optional kind and launch_overhead_ms as in config `hardware`), and one row
    per term: its bytes and FLOPs, the resource bounding it on each machine, the scale factor, the
    target's floor (roofline, or launch overhead for a per-call term) and whether the term was clamped
    to it. The speed band and the rest of `cost.meta` stay as measured here; meta.carry_over states the
    target's kind, the launch overhead assumed and what the estimate leaves out."""
    work = roofline.term_work(arch)
    terms = [_carry(name, getattr(cost, name), work[name], here, target) for name in roofline.TERMS]
    table = [_carry("decode_batch_fixed_s", seconds, roofline.batch_work(arch, batch), here, target, batch)
             for batch, seconds in cost.decode_batch_fixed_s]
    scaled = {t["term"]: t["seconds_target"] for t in terms}
    model = CostModel(**scaled, ctx_mode=cost.ctx_mode, name=f"{cost.name} carried to {target['name']}",
                      source=f"roofline estimate for {target['name']} from {cost.name}",
                      meta={**cost.meta, "carry_over": carry_over_notes(target, terms + table)},
                      decode_batch_fixed_s=tuple((t["batch"], t["seconds_target"]) for t in table))
    return model, terms + table


def carry_over_notes(target: dict, rows: list[dict]) -> dict:
    """What a carried-over model assumes and leaves out (its meta.carry_over), from the target's config
    entry and the rows `carry_over` gives: the target's kind, the launch overhead assumed with its source
    and basis, the terms clamped to the target's floor, and what the estimate leaves out. The overhead is
    read off the rows, the per-call terms it floored: the rule carry_over may have carried to the config
    entry with a GPU check's measured host time filled in (launch_overhead_origin), which the entry a later
    caller holds (the planner's) does not state."""
    per_call = next(row for row in rows if row["term"] in PER_CALL_TERMS)
    kind = machine_kind(target)
    return {"target_kind": kind, "rule": CARRY_RULES[kind],
            "core_speedup": core_speedup(target) if kind == "cpu" else None,
            "core_speedup_configured": target.get("core_speedup") is not None,
            "launch_overhead_s": per_call["launch_overhead_s"],
            "launch_overhead_source": per_call["launch_overhead_source"],
            "launch_overhead_basis": per_call["launch_overhead_basis"],
            "clamped_terms": [row["term"] if row["batch"] is None else f"{row['term']}[{row['batch']}]"
                              for row in rows if row["clamped"]],
            "leaves_out": list(CARRY_OVER_LEAVES_OUT[kind])}


def here_roofline(machine: dict) -> dict:
    """The roofline a profile's calls ran at, which the carry-over scales from: the median of its probe
    readings (machine.json roofline.seen), with the peaks and the number of readings beside it."""
    probes = machine["roofline"]
    seen = probes["seen"]
    return {"name": "this machine", "bandwidth_gbs": float(seen["bandwidth_gbs"]),
            "gflops": float(seen["gemm_gflops"]), "readings": int(seen["readings"]),
            "peak_bandwidth_gbs": float(probes["bandwidth_gbs"]), "peak_gflops": float(probes["gemm_gflops"])}


def kv_memory_of(config: dict, machine: str) -> dict:
    """How `machine`'s serving engine holds KV (servingplan/memory.py) and why: its config entry's
    `kv_memory` when given; else slots for this machine (the project's engine, and llama.cpp's server,
    reserve every slot's context), paged for a GPU target (vLLM's pool there) and slots for a CPU target
    (llama.cpp's server there)."""
    if machine == HERE:
        configured = config["memory"].get("kv_memory")
        return {"model": configured, "basis": "configured"} if configured else {"model": "slots",
                                                                                 "basis": "default_this_engine"}
    return target_kv_memory(next(t for t in config.get("hardware", []) if t["name"] == machine))


def target_kv_memory(target: dict) -> dict:
    """kv_memory_of for a `hardware` entry."""
    if target.get("kv_memory"):
        return {"model": target["kv_memory"], "basis": "configured"}
    if target.get("kind", "cpu") == "gpu":
        return {"model": "paged", "basis": "default_gpu"}
    return {"model": "slots", "basis": "default_cpu"}


def memory_for(config: dict, machine: str) -> dict:
    """The memory section as `machine`'s simulations and verdicts read it: with its KV model (kv_memory_of)
    as `kv_memory`."""
    return {**config["memory"], "kv_memory": kv_memory_of(config, machine)["model"]}
