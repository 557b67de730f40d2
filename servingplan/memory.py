"""Memory: model weights plus KV cache, by the way the machine's serving engine holds the KV.

Two engines hold KV two ways, and one definition (KV_MEMORY_MODELS) drives both the simulation's
admission (kv_blocks: the pool a simulated replica may fill) and the memory verdict (memory_plan):
- paged (vLLM, SGLang, TGI): one pool of blocks sized to what the budget leaves beside the weights (and
  beside the serving runtime, where it was measured). Weights plus pool fit the budget by construction;
  a pool too small for the load shows up as preemptions, in latency and capacity.
- slots (this project's engine, llama.cpp's server): each of the cap sequences holds a slot of the
  longest context, reserved up front. The simulation admits no more than those slots can hold (a pool of
  cap slots never runs out: no sequence is longer than max_context), and memory is weights plus cap slots.
"""
from __future__ import annotations

import math

GB = 1e9  # the budget is in decimal gigabytes

KV_MEMORY_MODELS = ("paged", "slots")
# what a simulation's KV pool is sized by: the KV model, and the budget (paged) or the slots' context (slots);
# the memory keys the simulation rules pass their jobs (rules/common.smk)
SIM_MEMORY_KEYS = ("block_size", "budget_gb", "kv_memory", "max_context")


def kv_bytes_per_token(n_layer: int, n_embd: int, dtype_bytes: int = 4) -> int:
    """One key and one value vector per layer."""
    return 2 * n_layer * n_embd * dtype_bytes


def kv_blocks_for_budget(budget_bytes: float, weight_bytes: float, kv_per_token: float, block_size: int) -> int:
    """Paged KV blocks that fit beside the weights; 0 if the weights alone exceed the budget."""
    return max(0, int((budget_bytes - weight_bytes) // (kv_per_token * block_size)))


def kv_memory_model(memory_cfg: dict) -> str:
    """The machine's KV model from its memory section (`kv_memory`, set per machine by the rules)."""
    model = memory_cfg.get("kv_memory")
    if model not in KV_MEMORY_MODELS:
        raise ValueError(f"memory.kv_memory={model!r}: allowed {', '.join(KV_MEMORY_MODELS)}")
    return model


def slot_blocks(memory_cfg: dict) -> int:
    """Blocks of one slot: the longest context, rounded up to whole blocks."""
    return math.ceil(memory_cfg["max_context"] / memory_cfg["block_size"])


def paged_pool_blocks(machine: dict, memory_cfg: dict, runtime_bytes: float | None = None) -> int:
    """A paged engine's pool: the blocks the budget leaves beside the measured weights (machine.json's
    memory) and the serving runtime where it was measured."""
    mem = machine["memory"]
    return kv_blocks_for_budget(memory_cfg["budget_gb"] * GB - (runtime_bytes or 0.0), mem["param_bytes"],
                                mem["kv_bytes_per_token"], memory_cfg["block_size"])


def kv_blocks(machine: dict, memory_cfg: dict, cap: int, runtime_bytes: float | None = None) -> int:
    """The KV blocks a simulated replica at `cap` may hold, by the machine's KV model: the paged pool, or
    cap slots of the longest context."""
    if kv_memory_model(memory_cfg) == "paged":
        return paged_pool_blocks(machine, memory_cfg, runtime_bytes)
    return int(cap) * slot_blocks(memory_cfg)


def reserved_tokens_per_seq(max_context: int, block_size: int) -> int:
    return math.ceil(max_context / block_size) * block_size


def largest_cap(budget_bytes: float, weight_bytes: float, kv_per_token: float, max_context: int,
                block_size: int) -> int:
    """Most concurrent sequences whose full-context KV reservation fits beside the weights."""
    per_seq = reserved_tokens_per_seq(max_context, block_size) * kv_per_token
    return max(0, int((budget_bytes - weight_bytes) // per_seq))


def largest_cap_in_memory(machine: dict, memory_cfg: dict, shortest_prompt: int,
                          runtime_bytes: float | None = None) -> dict:
    """The largest cap memory allows under the machine's KV model, and what bounds it. Slots: the most
    slots of the longest context beside the weights. Paged: every cap fits (the pool is the budget's);
    above the pool's blocks over the fewest blocks any sequence holds (its prompt's) the pool, not the
    cap, bounds how many run, so a larger cap changes nothing."""
    mem = machine["memory"]
    if kv_memory_model(memory_cfg) == "slots":
        return {"cap": largest_cap(memory_cfg["budget_gb"] * GB, mem["param_bytes"], mem["kv_bytes_per_token"],
                                   memory_cfg["max_context"], memory_cfg["block_size"]), "bound": "slots"}
    fewest = max(1, math.ceil(shortest_prompt / memory_cfg["block_size"]))
    return {"cap": paged_pool_blocks(machine, memory_cfg, runtime_bytes) // fewest, "bound": "pool"}


def memory_plan(cap: int, weight_bytes: float, kv_per_token: float, memory_cfg: dict,
                peak_kv_blocks: int | None = None, pool_blocks: int | None = None,
                runtime_bytes: float | None = None) -> dict:
    """Weights + KV for `cap` sequences: reserved for the maximum context, as used at the simulation's
    peak (blocks actually held), and as the machine's KV model judges it (`judged_bytes`, `fits`): the
    paged pool (`pool_blocks`, what kv_blocks gave the simulation) or cap slots, which is the reservation.
    `runtime_bytes`, the measured serving runtime where there is one, is reported beside, not in them."""
    model = kv_memory_model(memory_cfg)
    max_context, block_size = memory_cfg["max_context"], memory_cfg["block_size"]
    budget_bytes = memory_cfg["budget_gb"] * GB
    reserved = cap * reserved_tokens_per_seq(max_context, block_size) * kv_per_token
    used = None if peak_kv_blocks is None else peak_kv_blocks * block_size * kv_per_token
    if model == "paged":
        if pool_blocks is None:
            raise ValueError("memory_plan: a paged KV model is judged on its pool's blocks (pool_blocks)")
        judged = weight_bytes + pool_blocks * block_size * kv_per_token
    else:
        judged = weight_bytes + reserved
    return {
        "max_num_seqs": cap,
        "kv_memory": model,
        "weights_bytes": weight_bytes,
        "kv_reserved_bytes": reserved,
        "kv_used_peak_bytes": used,
        "total_reserved_bytes": weight_bytes + reserved,
        "total_used_peak_bytes": None if used is None else weight_bytes + used,
        "pool_blocks": pool_blocks,
        "judged_bytes": judged,
        "runtime_bytes": runtime_bytes,
        "budget_bytes": budget_bytes,
        # a paged pool of no block serves nothing: the weights (and runtime) leave no room for KV
        "fits": judged <= budget_bytes and (model == "slots" or bool(pool_blocks)),
        "fits_reserved": weight_bytes + reserved <= budget_bytes,
        "fits_used": None if used is None else weight_bytes + used <= budget_bytes,
        "largest_cap_in_budget": largest_cap(budget_bytes, weight_bytes, kv_per_token, max_context, block_size),
    }
