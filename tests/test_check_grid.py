"""The carry-over check's 1-thread profile grid (servingplan/profile/grid.py): the profile's grid thinned
on a log scale, its ends and speed references kept, at 1 thread, in at most CHECK_ROUNDS rounds."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from servingplan.profile import grid


def test_the_default_grid_thins_to_powers_of_two_and_keeps_the_references():
    profile = {"threads": 0, "rounds": 4, "reference_decode": [4, 256], "reference_prefill": 256,
               "prefill_lengths": [16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512],
               "decode_batches": [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32], "decode_contexts": [64, 256, 512, 768],
               "repeats": 3}
    check = grid.check_profile(profile)
    assert check["prefill_lengths"] == [16, 32, 64, 128, 256, 512]
    assert check["decode_batches"] == [1, 2, 4, 8, 16, 32]
    assert check["decode_contexts"] == [64, 256, 768]
    assert (check["threads"], check["rounds"], check["repeats"]) == (1, 2, 3)
    # no batched prefill (no carried term reads it); cached prefill at the shortest chunk, every depth
    assert check["prefill_batches"] == []
    assert check["cached_prefill"] == [[128, 256], [128, 512]]


def test_the_checks_grid_still_has_a_point_for_every_carried_term():
    """The check fits the same terms as the profile: prompts of several lengths uncached (fixed, per
    token, per token squared), a chunk after at least two cached depths (per token x cached context), and
    decode at several batches and contexts (fixed, per sequence, per cached token)."""
    from servingplan.profile.measure import build_grid
    profile = {"threads": 0, "rounds": 4, "reference_decode": [4, 256], "reference_prefill": 256,
               "prefill_lengths": [16, 64, 256, 512], "prefill_batches": [1, 2, 4],
               "decode_batches": [1, 4, 32], "decode_contexts": [64, 768], "repeats": 3,
               "cached_prefill": [[64, 128], [32, 512], [32, 128], [64, 512]]}
    points = build_grid(grid.check_profile(profile))
    kinds = {kind: [p for p in points if p.kind == kind] for kind in ("prefill", "prefill_batch", "prefill_cached", "decode")}
    assert len({p.prompt_len for p in kinds["prefill"]}) >= 3
    assert not kinds["prefill_batch"]
    assert [(p.prompt_len, p.cached) for p in kinds["prefill_cached"]] == [(32, 512), (32, 128)]
    assert len({p.batch for p in kinds["decode"]}) >= 2 and len({p.cached for p in kinds["decode"]}) >= 2


@given(values=st.lists(st.integers(1, 1024), min_size=1, max_size=40, unique=True), at_most=st.integers(2, 8),
       keep=st.lists(st.integers(1, 1024), max_size=3))
def test_thinning_keeps_both_ends_and_every_kept_value_and_adds_nothing(values, at_most, keep):
    thin = grid.thinned(values, at_most, keep)
    assert thin == sorted(set(thin)) and set(thin) <= set(values)
    assert min(values) in thin and max(values) in thin
    assert set(keep) & set(values) <= set(thin)
    assert len(thin) <= at_most + len(set(keep)) and (len(values) > at_most or thin == sorted(values))
