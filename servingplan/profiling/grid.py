"""The grid of the carry-over check's 1-thread profile (rules/check.smk): the profile's own grid, thinned.

The check needs a step-time model of this machine at 1 thread good enough to search capacities with,
not the profile's full resolution: its points take about twice as long at 1 thread, and the whole grid
in four rounds would add about nine minutes to a run whose measurements must run alone. So the check
profiles a spread of the profile's own shapes (thinned), every endpoint and the speed references kept (the peak
probes' shapes depend on the largest decode batch and prompt, and a thinned grid must keep them), in
CHECK_ROUNDS rounds; points whose rounds disagree still get extra rounds (measure.remeasure_until_settled).
The fit then has the same terms to find, at the same ends of every axis. Imports nothing heavy: the
Snakefile calls it while parsing.
"""
from __future__ import annotations

import math

# at most this many values per axis of the check's grid
CHECK_PREFILL_LENGTHS = 6
CHECK_DECODE_BATCHES = 6
CHECK_DECODE_CONTEXTS = 3
CHECK_ROUNDS = 2


def thinned(values: list, at_most: int, keep=()) -> list:
    """At most `at_most` of `values` (distinct, sorted): for each of `at_most` targets spread evenly on a
    log scale from the smallest value to the largest (the grid's axes span decades: batches 1 to 32,
    prompts 16 to 512), the value nearest it on that scale; both ends so stay. Plus the values of `keep`
    among `values`, which may make it longer: a kept value is never dropped."""
    ordered = sorted(set(values))
    if len(ordered) <= at_most:
        return ordered
    low, high = math.log(ordered[0]), math.log(ordered[-1])
    targets = [low + (high - low) * i / (at_most - 1) for i in range(at_most)]
    chosen = {min(ordered, key=lambda value: abs(math.log(value) - target)) for target in targets}
    return sorted(chosen | (set(keep) & set(ordered)))


def check_profile(profile: dict) -> dict:
    """The 1-thread check's profile settings: `profile` at 1 thread, over its grid thinned (see the module
    docstring), in at most CHECK_ROUNDS rounds."""
    batch, context = profile["reference_decode"]
    return {**profile, "threads": 1, "rounds": min(int(profile["rounds"]), CHECK_ROUNDS),
            "prefill_lengths": thinned(profile["prefill_lengths"], CHECK_PREFILL_LENGTHS, [profile["reference_prefill"]]),
            "decode_batches": thinned(profile["decode_batches"], CHECK_DECODE_BATCHES, [batch]),
            "decode_contexts": thinned(profile["decode_contexts"], CHECK_DECODE_CONTEXTS, [context])}
