"""The carry-over check's 1-thread profile grid (servingplan/profiling/grid.py): the profile's grid thinned
on a log scale, its ends and speed references kept, at 1 thread, in at most CHECK_ROUNDS rounds."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from servingplan.profiling import grid


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


@given(values=st.lists(st.integers(1, 1024), min_size=1, max_size=40, unique=True), at_most=st.integers(2, 8),
       keep=st.lists(st.integers(1, 1024), max_size=3))
def test_thinning_keeps_both_ends_and_every_kept_value_and_adds_nothing(values, at_most, keep):
    thin = grid.thinned(values, at_most, keep)
    assert thin == sorted(set(thin)) and set(thin) <= set(values)
    assert min(values) in thin and max(values) in thin
    assert set(keep) & set(values) <= set(thin)
    assert len(thin) <= at_most + len(set(keep)) and (len(values) > at_most or thin == sorted(values))
