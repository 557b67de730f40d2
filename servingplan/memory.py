"""Memory: model weights plus KV cache, reserved for the worst case or as the simulation used it."""
from __future__ import annotations

import math

GB = 1e9  # the budget is in decimal gigabytes


def kv_bytes_per_token(n_layer: int, n_embd: int, dtype_bytes: int = 4) -> int:
    """One key and one value vector per layer."""
    return 2 * n_layer * n_embd * dtype_bytes


def kv_blocks_for_budget(budget_bytes: float, weight_bytes: float, kv_per_token: float, block_size: int) -> int:
    """Paged KV blocks that fit beside the weights; 0 if the weights alone exceed the budget."""
    return max(0, int((budget_bytes - weight_bytes) // (kv_per_token * block_size)))


def kv_blocks(machine: dict, memory_cfg: dict) -> int:
    """Paged KV blocks the memory budget leaves beside the measured weights (machine.json's memory)."""
    mem = machine["memory"]
    return kv_blocks_for_budget(memory_cfg["budget_gb"] * GB, mem["param_bytes"], mem["kv_bytes_per_token"],
                                memory_cfg["block_size"])


def reserved_tokens_per_seq(max_context: int, block_size: int) -> int:
    return math.ceil(max_context / block_size) * block_size


def largest_cap(budget_bytes: float, weight_bytes: float, kv_per_token: float, max_context: int,
                block_size: int) -> int:
    """Most concurrent sequences whose full-context KV reservation fits beside the weights."""
    per_seq = reserved_tokens_per_seq(max_context, block_size) * kv_per_token
    return max(0, int((budget_bytes - weight_bytes) // per_seq))


def memory_plan(cap: int, weight_bytes: float, kv_per_token: float, max_context: int, block_size: int,
                budget_bytes: float, peak_kv_blocks: int | None = None) -> dict:
    """Weights + KV for `cap` sequences: reserved for the maximum context, and as used at the
    simulation's peak (paged blocks actually held)."""
    reserved = cap * reserved_tokens_per_seq(max_context, block_size) * kv_per_token
    used = None if peak_kv_blocks is None else peak_kv_blocks * block_size * kv_per_token
    return {
        "max_num_seqs": cap,
        "weights_bytes": weight_bytes,
        "kv_reserved_bytes": reserved,
        "kv_used_peak_bytes": used,
        "total_reserved_bytes": weight_bytes + reserved,
        "total_used_peak_bytes": None if used is None else weight_bytes + used,
        "budget_bytes": budget_bytes,
        "fits_reserved": weight_bytes + reserved <= budget_bytes,
        "fits_used": None if used is None else weight_bytes + used <= budget_bytes,
        "largest_cap_in_budget": largest_cap(budget_bytes, weight_bytes, kv_per_token, max_context, block_size),
    }
