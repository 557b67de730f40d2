"""Serving memory measured where the decision is: the peak resident memory of a process serving one
(policy, cap) at the worst case that cap allows.

The worst case is `cap` sequences each holding the configured max context (memory.max_context tokens,
prompt and reply together; at most the model's n_positions). The probe runs what the engine runs for
it, with the engine's own pieces:
- the engine's KV pool for `cap` slots of that context, every slot filled (all its pages resident);
- the largest of the prefill calls the policy's own Scheduler issues while `cap` such prompts are
  admitted (a whole prompt, or its chunks under chunked prefill), through the engine's prefill_step.
  Every buffer a prefill call allocates grows with its new tokens and with the entries it attends over
  (cached + new), so a call no larger than another in both never needs more memory than it: only the
  calls no other call exceeds in both are run (largest_calls), two or three instead of dozens at a
  large cap under chunked prefill;
- a decode step of the whole batch at the full context, through the engine's decode_step (the step
  that copies the batch's cache, the largest transient of serving).
Filling the other slots by copying the first instead of prefilling each one costs seconds instead of
minutes at large caps and leaves the same bytes resident; the per-call transients are those of one
call, since the engine runs its calls one after another.

The peak is the kernel's high-water mark of the process's resident set (VmHWM), reset after the model
is loaded (Linux: /proc/self/clear_refs), so it is the serving's peak with the weights resident, not
the loading's; where the reset is unavailable it is the process's whole-life peak (ru_maxrss), load
included, which can only overstate it. One process serves one (policy, cap): a process's high-water mark
never falls, and the glibc setting the engine runs under (configure_allocator) keeps freed memory in
the process, so an earlier configuration would leak into a later one's reading.
"""
from __future__ import annotations

import gc
import resource
import sys
from pathlib import Path

import torch

from servingplan.device import model_device
from servingplan.serving.kvpool import KVPool, decode_step, prefill_step
from servingplan.sim.scheduler import BlockManager, Scheduler, Seq

# reply tokens of each probe sequence: the first comes from its prefill, the last is never stored
PROBE_OUTPUT_TOKENS = 2
# decode steps of the whole batch at the full context: every one has the same shape, so one shows the peak
PROBE_DECODE_STEPS = 1


def reset_peak() -> bool:
    """Reset this process's resident high-water mark to its current resident set (Linux >= 4.0)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """The process's resident high-water mark: VmHWM where the kernel reports it, else ru_maxrss."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss: KiB on Linux, bytes on macOS
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def prefill_calls(policy: str, cap: int, prompt: int, chunk_size: int, chunk_budget: str, block_size: int) -> list:
    """Every distinct (tokens, cached) prefill call the policy's Scheduler issues while `cap` sequences
    of `prompt` tokens are admitted and prefilled, in the order first issued."""
    scheduler = Scheduler(policy, cap, chunk_size, BlockManager(None, block_size), chunk_budget)
    seqs = [Seq(i, prompt, PROBE_OUTPUT_TOKENS) for i in range(cap)]
    for seq in seqs:
        scheduler.add(seq)
    calls: list = []
    # each step prefills at least one token of some prompt, so cap * prompt steps bound the loop
    for _ in range(cap * prompt + 1):
        if all(seq.prefilled >= seq.prefill_target for seq in seqs):
            break
        step = scheduler.schedule()
        for call in step.prefill_calls():
            if call not in calls:
                calls.append(call)
        scheduler.complete(step)
    return calls


def largest_calls(calls: list) -> list:
    """The (tokens, cached) calls of `calls` that no other call matches or exceeds in both new tokens and
    entries attended (cached + tokens), in their order in `calls`."""
    unique = list(dict.fromkeys(calls))

    def covered(call, other):
        return other != call and other[0] >= call[0] and sum(other) >= sum(call)
    return [call for call in unique if not any(covered(call, other) for other in unique)]


@torch.inference_mode()
def serve_worst_case(model, policy: str, cap: int, max_context: int, chunk_size: int, chunk_budget: str,
                     block_size: int) -> dict:
    """Run the worst case of (policy, cap) and return the contract row of serving_memory.json:
    {policy, cap, peak_rss_bytes, sequences, context_tokens}. Call it in a fresh process, after the
    model is loaded."""
    config = model.config
    context = min(int(max_context), int(config.n_positions))
    prompt = context - PROBE_OUTPUT_TOKENS
    if prompt < 1:
        raise ValueError(f"memory.max_context={max_context}: leaves no prompt token beside "
                         f"{PROBE_OUTPUT_TOKENS} reply tokens")
    device = model_device(model)
    gc.collect()
    reset_peak()
    # the entries a sequence of `context` tokens stores: its last token is never fed back
    pool = KVPool(config, cap, context - 1, device)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(config.vocab_size, (1, prompt), generator=generator)
    for tokens, cached in largest_calls(prefill_calls(policy, cap, prompt, chunk_size, chunk_budget, block_size)):
        prefill_step(model, pool, 0, ids[:, cached:cached + tokens].to(device), cached)
    # every slot's pages written (the calls skipped would have written slot 0's first entries)
    for tensor in (pool.keys, pool.values):
        tensor[:, 1:].copy_(tensor[:, :1].expand_as(tensor[:, 1:]))
        tensor[:, :1].add_(0.0)
    # the reply's decode: each sequence holds its prompt, then prompt + 1 entries, up to context - 1
    for step in range(PROBE_DECODE_STEPS):
        lengths = torch.full((cap,), min(prompt + step, context - 2), dtype=torch.long)
        decode_step(model, pool, lengths, torch.randint(config.vocab_size, (cap, 1), generator=generator))
    return {"policy": policy, "cap": int(cap), "peak_rss_bytes": int(peak_rss_bytes()), "sequences": int(cap),
            "context_tokens": int(context)}


def collect(rows: list[dict], machine: dict | None) -> dict:
    """serving_memory.json: one row per (policy, cap) probed, sorted, and the profiler's own peak
    (machine.json's memory.peak_rss_bytes: what measuring cost, not what serving needs; None when the
    cost model was imported and nothing was profiled here)."""
    profiler = ((machine or {}).get("memory") or {}).get("peak_rss_bytes")
    return {"rows": sorted(rows, key=lambda row: (row["policy"], row["cap"])),
            "profiler_peak_rss_bytes": int(profiler) if profiler is not None else None}
