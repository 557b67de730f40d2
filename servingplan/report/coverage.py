"""How many of the requests a run simulates lie outside the shapes the cost model was profiled on.

The fit records the range it was measured over in the cost model's meta.profiled_range
(servingplan/fit/step_model.py): the prompt lengths of its prefill points and the contexts (prompt +
cached tokens) of all its points. A request whose prompt lies outside the prompt range, or whose
context (prompt + reply) runs past the longest profiled context, is simulated with step times the fit
extrapolates. The command line warns with the count (servingplan/cli/main.py); the pipeline writes it to
results/plan/coverage.json (rule coverage) and the report's workload section states it.
"""
from __future__ import annotations

from servingplan.simulate.workload import MAX_TRACE_TOKENS, generate

RANGE_KEYS = ("prompt_tokens", "context_tokens")


def profiled_range(meta: dict, max_tokens: int = MAX_TRACE_TOKENS) -> dict | None:
    """The cost model's profiled range as {key: [low, high]}, or None when it records none (a cost
    model written by hand or imported from elsewhere). A malformed range raises ValueError naming it."""
    profiled = meta.get("profiled_range")
    if profiled is None:
        return None
    ranges = {}
    for key in RANGE_KEYS:
        pair = profiled.get(key) if isinstance(profiled, dict) else None
        if not (isinstance(pair, list) and len(pair) == 2 and all(type(v) is int for v in pair)
                and 0 <= pair[0] <= pair[1] <= max_tokens):
            raise ValueError(f"meta.profiled_range.{key} = {pair!r}: must be [low, high], integers with "
                             f"0 <= low <= high <= {max_tokens}")
        ranges[key] = pair
    return ranges


def outside_counts(traces, ranges: dict) -> dict:
    """Over every request of `traces`: how many have a prompt outside the profiled prompt range, a
    context past the longest profiled context, and either (each request counted once)."""
    (prompt_lo, prompt_hi), context_hi = ranges["prompt_tokens"], ranges["context_tokens"][1]
    requests = prompt_outside = context_outside = outside = 0
    longest_prompt = longest_context = 0
    for trace in traces:
        prompts = trace.prompt_tokens
        contexts = trace.prompt_tokens + trace.output_tokens
        prompt_out = (prompts < prompt_lo) | (prompts > prompt_hi)
        context_out = contexts > context_hi
        requests += len(trace)
        prompt_outside += int(prompt_out.sum())
        context_outside += int(context_out.sum())
        outside += int((prompt_out | context_out).sum())
        if len(trace):
            longest_prompt = max(longest_prompt, int(prompts.max()))
            longest_context = max(longest_context, int(contexts.max()))
    return {"requests": requests, "outside": outside, "prompt_outside": prompt_outside,
            "context_outside": context_outside, "longest_prompt_tokens": longest_prompt,
            "longest_context_tokens": longest_context}


def coverage(workload: dict, seeds: list[int], cost) -> dict:
    """results/plan/coverage.json: the cost model's profiled range and, over the workload's draws the
    simulations replay (one per seed), the requests outside it (None when the cost model records no
    range: then nothing can be said either way)."""
    traces = [generate(workload, seed) for seed in seeds]
    ranges = profiled_range(cost.meta)
    counts = outside_counts(traces, ranges) if ranges else {"requests": sum(len(t) for t in traces), "outside": None}
    return {"cost_model": cost.name, "profiled_range": ranges, "draws": len(traces), **counts}
