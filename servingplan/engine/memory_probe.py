"""Serving memory measured where the decision is: the peak resident memory of a process serving one
(policy, cap) at the worst case that cap allows, measured at a few caps in one process, and a line
through them for every other cap.

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
- a decode step of the whole batch at the full context, through the engine's decode_step.
Filling the other slots by copying the first instead of prefilling each one costs seconds instead of
minutes at large caps and leaves the same bytes resident; the per-call transients are those of one
call, since the engine runs its calls one after another.

The peak is the kernel's high-water mark of the process's resident set (VmHWM), reset after the model
is loaded (Linux: /proc/self/clear_refs), so it is the serving's peak with the weights resident, not
the loading's; where the reset is unavailable it is the process's whole-life peak (ru_maxrss), load
included, which can only overstate it. A process's high-water mark never falls, and the glibc setting
the engine runs under (configure_allocator) keeps freed memory in the process, so one process serves
one (policy, cap): the stage loads the model once and forks a child per probe (probe_forked), which
serves (at one thread: GNU OpenMP is not fork-safe, see probe_forked), reads its own peak, hands it back
through a pipe and exits. A child maps the parent's anonymous
pages (the weights, the heap) at the fork, but its file-backed pages (the libraries' code and data)
only once it touches them, where a fresh process that loaded the model has them all resident: the
child first maps every file page the parent has resident (mapped_file_pages, map_pages), so its
reading is what a fresh serving process reads.

With the engine writing KV in place, memory is about linear in the cap: the weights and the runtime,
plus per sequence its KV slot and its share of a step's activations. Each policy's line is fitted to
its own measured caps (fit_caps: the smallest, a middle and the largest swept cap; chunked prefill
holds smaller prefill activations than a whole prompt's) and checked at one more cap (the check,
predicted against measured). resident_at gives any (policy, cap): measured where it was, else the line.

Two policies whose schedulers issue the same largest prefill calls at a cap (static and continuous:
one whole prompt each) run the very same probe: the same pool, the same calls, the same decode step.
It runs once, and both rows carry its reading, each naming the policy whose probe ran (`probe_policy`).
Children run side by side, as many as the job's threads (each at one thread): a reading is the
child's own high-water mark, which a sibling's memory does not raise.
"""
from __future__ import annotations

import ctypes
import gc
import json
import math
import os
import resource
import sys
from pathlib import Path

import numpy as np

from servingplan.simulate.scheduler import BlockManager, Scheduler, Seq

# reply tokens of each probe sequence: the first comes from its prefill, the last is never stored
PROBE_OUTPUT_TOKENS = 2
# decode steps of the whole batch at the full context: every one has the same shape, so one shows the peak
PROBE_DECODE_STEPS = 1
# madvise: fault in a range's pages for reading (Linux >= 5.14), as touching each page would
MADV_POPULATE_READ = 22
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


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


def worst_case_context(model_config, max_context: int) -> tuple[int, int]:
    """(context, prompt) tokens of a probe sequence: the configured max context, at most the model's
    n_positions, and its prompt beside PROBE_OUTPUT_TOKENS reply tokens."""
    context = min(int(max_context), int(model_config.n_positions))
    prompt = context - PROBE_OUTPUT_TOKENS
    if prompt < 1:
        raise ValueError(f"memory.max_context={max_context}: leaves no prompt token beside "
                         f"{PROBE_OUTPUT_TOKENS} reply tokens")
    return context, prompt


def worst_case_calls(model_config, policy: str, cap: int, max_context: int, chunk_size: int, chunk_budget: str,
                     block_size: int) -> list:
    """The prefill calls the worst case of (policy, cap) runs: the largest of those its Scheduler issues."""
    _, prompt = worst_case_context(model_config, max_context)
    return largest_calls(prefill_calls(policy, cap, prompt, chunk_size, chunk_budget, block_size))


def serve_worst_case(model, policy: str, cap: int, max_context: int, chunk_size: int, chunk_budget: str,
                     block_size: int) -> dict:
    """Run the worst case of (policy, cap) and return the contract row of serving_memory.json:
    {policy, cap, peak_rss_bytes, sequences, context_tokens}. Call it in a fresh process (or a forked
    child, probe_forked), after the model is loaded."""
    # imported here, not with the module: the planner reads resident_at without loading torch
    import torch

    from servingplan.device import model_device
    from servingplan.profile.kvpool import KVPool, decode_step, prefill_step
    with torch.inference_mode():
        config = model.config
        context, prompt = worst_case_context(config, max_context)
        device = model_device(model)
        gc.collect()
        reset_peak()
        # the entries a sequence of `context` tokens stores: its last token is never fed back
        pool = KVPool(config, cap, context - 1, device)
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(config.vocab_size, (1, prompt), generator=generator)
        for tokens, cached in worst_case_calls(config, policy, cap, max_context, chunk_size, chunk_budget, block_size):
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


def fit_caps(caps) -> tuple[list[int], int | None]:
    """The caps measured to fit the line, and the one measured to check it: the smallest, the middle
    and the largest swept cap (both ends alone below four caps), and of the rest the one nearest, on a
    log scale, the middle of the two largest fitted caps, where a line through them strays furthest
    from a measured point (None when no cap is left)."""
    swept = sorted({int(cap) for cap in caps})
    fitted = sorted({swept[0], swept[len(swept) // 2], swept[-1]} if len(swept) >= 4 else {swept[0], swept[-1]})
    rest = [cap for cap in swept if cap not in fitted]
    if not rest:
        return fitted, None
    middle = math.sqrt(fitted[-1] * fitted[-2]) if len(fitted) > 1 else fitted[0]
    return fitted, min(rest, key=lambda cap: (abs(math.log(cap / middle)), cap))


def mapped_file_pages() -> list[tuple[int, int]]:
    """(address, bytes) of every run of this process's file-backed, readable pages mapped now (Linux's
    /proc/self/pagemap; none where it cannot be read): those a forked child does not map until it
    touches them."""
    runs = []
    try:
        with open("/proc/self/maps") as maps, open("/proc/self/pagemap", "rb") as pagemap:
            for line in maps.read().splitlines():
                fields = line.split(maxsplit=5)
                if len(fields) < 6 or not fields[5].startswith("/") or not fields[1].startswith("r"):
                    continue
                start, end = (int(bound, 16) for bound in fields[0].split("-"))
                pagemap.seek(start // PAGE_BYTES * 8)
                entries = np.frombuffer(pagemap.read((end - start) // PAGE_BYTES * 8), dtype=np.uint64)
                present = np.concatenate(([0], (entries >> np.uint64(63)).astype(np.int8), [0]))
                edges = np.flatnonzero(np.diff(present))
                runs += [(start + int(a) * PAGE_BYTES, int(b - a) * PAGE_BYTES) for a, b in zip(edges[::2], edges[1::2])]
    except OSError:
        return []
    return runs


def map_pages(runs: list[tuple[int, int]]) -> None:
    """Map (fault in for reading) the pages of `runs` in this process: madvise where the kernel has
    MADV_POPULATE_READ, else a read of each page."""
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    for start, length in runs:
        if madvise(start, length, MADV_POPULATE_READ) != 0:
            for address in range(start, start + length, PAGE_BYTES):
                ctypes.string_at(address, 1)


def start_probe(model, policy: str, cap: int, max_context: int, chunk_size: int, chunk_budget: str,
                block_size: int, parent_pages: list[tuple[int, int]]) -> tuple[int, int]:
    """Fork a child of this process that first maps `parent_pages` (this process's mapped_file_pages,
    read once before the first fork) so that it holds what this process holds, then serves the worst
    case of (policy, cap), writes its row to a pipe and exits. Returns (pid, the pipe's read end) for
    finish_probe; this process serves nothing, so every child starts from the same memory."""
    read_end, write_end = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        os.close(read_end)
        status = 0
        try:
            # GNU OpenMP is not fork-safe: a child that enters a parallel region with more than one thread
            # waits forever on the parent's team, whose threads it does not have (seen: a probe hung in
            # LayerNorm after the parent had run torch at two threads). At one thread torch runs no
            # parallel region. A step's per-thread scratch is kilobytes beside the KV pool's gigabytes:
            # at cap 8 the forked one-thread reading matched a fresh process at the engine's threads.
            import torch
            torch.set_num_threads(1)
            map_pages(parent_pages)
            reply = serve_worst_case(model, policy, cap, max_context, chunk_size, chunk_budget, block_size)
        except BaseException as error:  # noqa: BLE001 - the parent raises it
            reply, status = {"error": f"{type(error).__name__}: {error}"}, 1
        with os.fdopen(write_end, "w") as pipe:
            pipe.write(json.dumps(reply))
        os._exit(status)
    os.close(write_end)
    return pid, read_end


def finish_probe(started: tuple[int, int], policy: str, cap: int) -> dict:
    """The row a child of start_probe hands back, once it has exited; RuntimeError with the child's
    error, or its wait status, when it gave none."""
    pid, read_end = started
    with os.fdopen(read_end) as pipe:
        text = pipe.read()
    _, wait_status = os.waitpid(pid, 0)
    reply = json.loads(text) if text else {"error": f"the probe ended without a reading (wait status {wait_status})"}
    if "error" in reply or wait_status != 0:
        raise RuntimeError(f"serving memory probe {policy} cap {cap}: {reply.get('error', f'wait status {wait_status}')}")
    return reply


def probe_forked(model, policy: str, cap: int, max_context: int, chunk_size: int, chunk_budget: str,
                 block_size: int, parent_pages: list[tuple[int, int]]) -> dict:
    """serve_worst_case in a child of this process (start_probe), its row once it has exited."""
    started = start_probe(model, policy, cap, max_context, chunk_size, chunk_budget, block_size, parent_pages)
    return finish_probe(started, policy, cap)


def probe_all(model, cases: list[tuple[str, int]], max_context: int, chunk_size: int, chunk_budget: str,
              block_size: int, parent_pages: list[tuple[int, int]], workers: int) -> list[dict]:
    """The row of each (policy, cap) of `cases`, in order, from forked children (start_probe), at most
    `workers` of them serving at once. A failing probe starts no further child, and its error is raised
    once every child started has been waited for."""
    rows: list = [None] * len(cases)
    running: list = []
    errors: list = []

    def finish_oldest():
        index, started = running.pop(0)
        try:
            rows[index] = finish_probe(started, *cases[index])
        except RuntimeError as error:
            errors.append(error)
    for index, (policy, cap) in enumerate(cases):
        if len(running) >= max(1, int(workers)):
            finish_oldest()
        if errors:
            break
        running.append((index, start_probe(model, policy, cap, max_context, chunk_size, chunk_budget, block_size,
                                           parent_pages)))
    while running:
        finish_oldest()
    if errors:
        raise errors[0]
    return rows


def fit_line(points: list[tuple[int, float]]) -> dict:
    """The least-squares line bytes = intercept + slope x cap through (cap, bytes) points (a level line
    through a single point)."""
    caps = np.array([cap for cap, _ in points], dtype=float)
    values = np.array([value for _, value in points], dtype=float)
    slope = 0.0 if np.ptp(caps) == 0 else float(np.polyfit(caps, values, 1)[0])
    return {"intercept_bytes": float(values.mean() - slope * caps.mean()), "slope_bytes_per_cap": slope}


def serving_memory_file(rows: list[dict], fitted: list[int], check: int | None, machine: dict | None) -> dict:
    """serving_memory.json: the measured rows (sorted by policy and cap, each with its use: fit or
    check), each policy's line fitted to its rows at the `fitted` caps, the check at cap `check`
    (predicted, measured, error in % of measured; None without a check cap) and the profiler's own peak
    (machine.json's memory.peak_rss_bytes: what measuring cost, not what serving needs; None when the
    cost model was imported and nothing was profiled here)."""
    rows = sorted(({**row, "use": "fit" if row["cap"] in fitted else "check"} for row in rows),
                  key=lambda row: (row["policy"], row["cap"]))
    policies = sorted({row["policy"] for row in rows})
    lines = {policy: fit_line([(row["cap"], row["peak_rss_bytes"]) for row in rows
                               if row["policy"] == policy and row["use"] == "fit"]) for policy in policies}
    checked = []
    for row in rows:
        if row["use"] == "check":
            line = lines[row["policy"]]
            predicted = line["intercept_bytes"] + line["slope_bytes_per_cap"] * row["cap"]
            checked.append({"policy": row["policy"], "cap": row["cap"], "predicted_bytes": predicted,
                            "measured_bytes": float(row["peak_rss_bytes"]),
                            "error_pct": 100.0 * (predicted - row["peak_rss_bytes"]) / row["peak_rss_bytes"]})
    profiler = ((machine or {}).get("memory") or {}).get("peak_rss_bytes")
    return {"rows": rows,
            "model": {"form": "intercept + slope x cap, per policy", "caps": list(fitted), "policies": lines},
            "check": {"cap": check, "rows": checked,
                      "max_abs_error_pct": max(abs(c["error_pct"]) for c in checked)} if checked else None,
            "method": "one process loads the model; a forked child serves each distinct probe and reads its own peak",
            "profiler_peak_rss_bytes": int(profiler) if profiler is not None else None}


def measure(model, policies, caps, max_context: int, chunk_size: int, chunk_budget: str, block_size: int,
            machine: dict | None, workers: int = 1) -> dict:
    """serving_memory.json for `policies` over the swept `caps`: every policy at the fitted caps and the
    check cap (fit_caps). A probe runs once for every distinct (cap, worst-case prefill calls): a policy
    whose calls at a cap are another's takes that probe's reading (probe_policy). Each probe is a child
    of this process (probe_all), `workers` at once."""
    fitted, check = fit_caps(caps)
    probe_caps = [*fitted, *([check] if check is not None else [])]
    probes: dict = {}   # (cap, calls) -> the (policy, cap) whose probe serves it
    served_by = {}
    for policy in policies:
        for cap in probe_caps:
            key = (cap, tuple(worst_case_calls(model.config, policy, cap, max_context, chunk_size, chunk_budget,
                                               block_size)))
            served_by[(policy, cap)] = probes.setdefault(key, (policy, cap))
    cases = list(dict.fromkeys(served_by.values()))
    readings = dict(zip(cases, probe_all(model, cases, max_context, chunk_size, chunk_budget, block_size,
                                         mapped_file_pages(), workers)))
    rows = [{**readings[served_by[(policy, cap)]], "policy": policy, "probe_policy": served_by[(policy, cap)][0]}
            for policy, cap in served_by]
    return serving_memory_file(rows, fitted, check, machine)


def resident_at(serving_memory: dict, policy: str, cap: int) -> dict:
    """The serving process's resident memory at (policy, cap >= 1) from serving_memory.json:
    {"bytes", "basis"}, basis "measured" where a probe served that (policy, cap), else "model" (the
    policy's fitted line). KeyError where the file has neither for the policy."""
    if int(cap) < 1:
        raise ValueError(f"serving memory at cap {cap}: a cap is at least 1")
    for row in serving_memory.get("rows", []):
        if row["policy"] == policy and int(row["cap"]) == int(cap):
            return {"bytes": float(row["peak_rss_bytes"]), "basis": "measured"}
    line = ((serving_memory.get("model") or {}).get("policies") or {}).get(policy)
    if line is None:
        raise KeyError(f"serving memory: {policy} at cap {cap} was neither measured nor modelled")
    return {"bytes": float(line["intercept_bytes"] + line["slope_bytes_per_cap"] * int(cap)), "basis": "model"}


def runtime_bytes(serving_memory: dict, weight_bytes: float) -> float:
    """The serving runtime beside the weights and the KV: each policy's fitted line at cap 0 (its
    intercept: the process with no sequence), less the weights; the largest over the policies, so a
    paged pool sized beside it fits whichever policy serves."""
    lines = ((serving_memory.get("model") or {}).get("policies") or {}).values()
    if not lines:
        raise KeyError("serving memory: no policy's line was fitted, so the runtime is unknown")
    return max(0.0, max(float(line["intercept_bytes"]) for line in lines) - float(weight_bytes))


def measured_runtime(path, machine: dict) -> float | None:
    """runtime_bytes of the serving_memory.json at `path` (a job's optional input), None without one."""
    if not path:
        return None
    return runtime_bytes(json.loads(Path(path).read_text()), machine["memory"]["param_bytes"])
