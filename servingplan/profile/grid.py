"""The grid of the carry-over check's 1-thread profile (rules/check.smk): the profile's own grid, thinned.

The check needs a step-time model of this machine at 1 thread good enough to search capacities with,
not the profile's full resolution: its points take about twice as long at 1 thread, and the whole grid
in four rounds would add about nine minutes to a run whose measurements must run alone. So the check
profiles a spread of the profile's own shapes (thinned), every endpoint and the speed references kept (the peak
probes' shapes depend on the largest decode batch and prompt, and a thinned grid must keep them), in
CHECK_ROUNDS rounds; points whose rounds disagree still get extra rounds (measure.remeasure_until_settled).
The fit then has the same terms to find, at the same ends of every axis. Two kinds of point the check
leaves out, since no carried term reads them: batched prefill (informative only: the engine prefills one
sequence per call, and the fit fits no term to it), and of the cached-prefill points all but those of the
shortest chunk, whose cached depths still span the profile's (the cached-context term is the only one
they add to the uncached prompts, and one chunk length at every depth identifies it). At 1 thread those
points were about a third of the check's calls by time. Imports nothing heavy: the Snakefile calls it
while parsing.
"""
from __future__ import annotations

import math

# at most this many values per axis of the check's grid
CHECK_PREFILL_LENGTHS = 6
CHECK_DECODE_BATCHES = 6
CHECK_DECODE_CONTEXTS = 3
CHECK_ROUNDS = 2
# (chunk tokens, tokens of the same prompt already cached) of the profile's cached-prefill points, unless
# its config names them (profile.cached_prefill): enough spread in chunk x cached to fit the cached-context term
CACHED_PREFILL_POINTS = ((128, 256), (256, 256), (128, 512), (256, 512))


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


def shortest_chunk_points(points) -> list[list[int]]:
    """The (chunk, cached) points of the shortest chunk length among `points`, at every cached depth."""
    shortest = min(int(chunk) for chunk, _ in points)
    return [[int(chunk), int(cached)] for chunk, cached in points if int(chunk) == shortest]


def check_profile(profile: dict) -> dict:
    """The 1-thread check's profile settings: `profile` at 1 thread, over its grid thinned (see the module
    docstring), in at most CHECK_ROUNDS rounds."""
    batch, context = profile["reference_decode"]
    return {**profile, "threads": 1, "rounds": min(int(profile["rounds"]), CHECK_ROUNDS), "prefill_batches": [],
            "cached_prefill": shortest_chunk_points(profile.get("cached_prefill", CACHED_PREFILL_POINTS)),
            "prefill_lengths": thinned(profile["prefill_lengths"], CHECK_PREFILL_LENGTHS, [profile["reference_prefill"]]),
            "decode_batches": thinned(profile["decode_batches"], CHECK_DECODE_BATCHES, [batch]),
            "decode_contexts": thinned(profile["decode_contexts"], CHECK_DECODE_CONTEXTS, [context])}
