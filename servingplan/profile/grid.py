"""The grid of the carry-over check's 1-thread profile (rules/check.smk): the profile's own grid, thinned.

The check needs a step-time model of this machine at 1 thread good enough to search capacities with,
not the profile's full resolution: its points take about twice as long at 1 thread, and the whole grid
in four rounds would add about nine minutes to a run whose measurements must run alone. So the check
profiles a spread of the profile's own shapes (thinned), every endpoint kept (the peak probes' shapes
depend on the largest decode batch and prompt, and a thinned grid must keep them), in CHECK_ROUNDS
rounds; points whose rounds disagree still get extra rounds (measure.remeasure_until_settled), within
CHECK_REMEASURE_ROUNDS grid-sizes of measurements. The fit then has the same terms to find, at the same
ends of every axis: five prompt lengths (the fit holds one out and fits three uncached terms to the
rest), six decode batches (the per-batch table) and three decode contexts. Two contexts would identify
the per-token term, which is linear in the context, but the fit's held-out points are drawn from the
decode points at random: with two a batch loses both of its points, and in a cold run of c4a5cbb the
held-out error read 15.7%, 24% at batch 8, whose table entry had no point left. What the check leaves
out, since no carried term reads it: batched prefill (informative only: the engine prefills one
sequence per call, and the fit fits no term to it), and of the cached-prefill points all but those of
the shortest chunk, whose cached depths still span the profile's (the cached-context term is the only
one they add to the uncached prompts, and one chunk length at every depth identifies it).

Two costs the check sheds that the profile keeps, each measured (docs/benchmarks.md): the untimed
warm-up call before each point's timed calls (at 1 thread, over 52 (point, round) sets, the median of
the first three calls was the median of the three after them: ratio 1.000; only a shape's very first
call ran slow, which a median of three leaves out), and a prefill reference of the profile's 256 tokens
(0.63 s a call at 1 thread, a fifth of the check's time in speed readings): the check's prefill
reference is CHECK_REFERENCE_PREFILL tokens, or the profile's if shorter. The references need not be
grid points: they trace the speed, they are not fitted. Imports nothing heavy: the Snakefile calls it
while parsing.
"""
from __future__ import annotations

import math

# at most this many values per axis of the check's grid
CHECK_PREFILL_LENGTHS = 5
CHECK_DECODE_BATCHES = 6
CHECK_DECODE_CONTEXTS = 3
CHECK_ROUNDS = 2
CHECK_WARMUP = 0
CHECK_REFERENCE_PREFILL = 64
# re-measurement may add at most this many grid-sizes of measurements (the profile's: 2)
CHECK_REMEASURE_ROUNDS = 1
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


def ragged_contexts(batch: int, context: int) -> list[int]:
    """Per-sequence contexts of a profiled decode batch: the longest holds `context` entries and the
    others are spread evenly down to half of it, so the batch is padded and masked like the engine's
    ragged batches (its cost depends on the longest: every row is padded to it)."""
    if batch == 1:
        return [context]
    low = max(1, context // 2)
    return [round(context + (low - context) * i / (batch - 1)) for i in range(batch)]


def check_references(profile: dict) -> dict:
    """The check's reference shapes, threads and estimator: what its 1-thread profile traces its speed
    with, and what the profile of `profile` reads in its own window for the check to compare
    (servingplan.profile.measure.WindowReadings)."""
    return {"threads": 1, "reference_decode": list(profile["reference_decode"]),
            "reference_prefill": min(int(profile["reference_prefill"]), CHECK_REFERENCE_PREFILL),
            "warmup": CHECK_WARMUP, "repeats": int(profile["repeats"])}


def check_profile(profile: dict) -> dict:
    """The 1-thread check's profile settings: `profile` at 1 thread, over its grid thinned (see the module
    docstring), in at most CHECK_ROUNDS rounds."""
    return {**profile, **check_references(profile), "rounds": min(int(profile["rounds"]), CHECK_ROUNDS),
            "remeasure_rounds": CHECK_REMEASURE_ROUNDS, "prefill_batches": [],
            "cached_prefill": shortest_chunk_points(profile.get("cached_prefill", CACHED_PREFILL_POINTS)),
            "prefill_lengths": thinned(profile["prefill_lengths"], CHECK_PREFILL_LENGTHS),
            "decode_batches": thinned(profile["decode_batches"], CHECK_DECODE_BATCHES),
            "decode_contexts": thinned(profile["decode_contexts"], CHECK_DECODE_CONTEXTS)}
