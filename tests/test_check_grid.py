"""The carry-over check's 1-thread profile grid (servingplan/profile/grid.py): the profile's grid thinned
on a log scale, its ends kept, at 1 thread, in at most CHECK_ROUNDS rounds, without the warm-up call, with a
short prefill reference and a smaller re-measurement budget."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from servingplan.profile import grid


def test_the_default_grid_thins_to_its_ends_and_a_log_spread_between():
    profile = {"threads": 0, "rounds": 4, "reference_decode": [4, 256], "reference_prefill": 256,
               "prefill_lengths": [16, 32, 64, 96, 128, 192, 256, 320, 384, 448, 512],
               "decode_batches": [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32], "decode_contexts": [64, 256, 512, 768],
               "repeats": 3, "warmup": 1}
    check = grid.check_profile(profile)
    assert check["prefill_lengths"] == [16, 32, 96, 192, 512]
    assert check["decode_batches"] == [1, 2, 4, 8, 16, 32]
    assert check["decode_contexts"] == [64, 256, 768]
    assert (check["threads"], check["rounds"], check["repeats"], check["warmup"]) == (1, 2, 3, 0)
    # the references trace the speed and need not be grid points: the prefill one is short
    assert check["reference_prefill"] == 64 and check["reference_decode"] == [4, 256]
    assert check["remeasure_rounds"] == 1
    # no batched prefill (no carried term reads it); cached prefill at the shortest chunk, every depth
    assert check["prefill_batches"] == []
    assert check["cached_prefill"] == [[128, 256], [128, 512]]


def test_the_checks_grid_still_has_a_point_for_every_carried_term():
    """The check fits the same terms as the profile: prompts of several lengths uncached (fixed, per
    token, per token squared), a chunk after at least two cached depths (per token x cached context), and
    decode at several batches and contexts (fixed, per sequence, per cached token)."""
    from servingplan.profile.measure import build_grid
    profile = {"threads": 0, "rounds": 4, "warmup": 1, "reference_decode": [4, 256], "reference_prefill": 256,
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


def test_a_shorter_prefill_reference_and_a_profile_without_warm_up_are_kept():
    profile = {"threads": 0, "rounds": 1, "warmup": 0, "reference_decode": [2, 16], "reference_prefill": 16,
               "prefill_lengths": [8, 16, 32], "decode_batches": [1, 2], "decode_contexts": [8, 32], "repeats": 2}
    check = grid.check_profile(profile)
    assert (check["reference_prefill"], check["warmup"], check["rounds"]) == (16, 0, 1)


def test_the_checks_remeasure_budget_bounds_its_profile():
    """run_profile reads the check's budget: at most remeasure_rounds grid-sizes of extra measurements."""
    from servingplan.profile.measure import QUICK_PROFILE, run_profile
    settings = {**QUICK_PROFILE, "prefill_lengths": [8, 16], "prefill_batches": [], "decode_batches": [1, 2],
                "decode_contexts": [4], "cached_prefill": [(4, 4)], "remeasure_rounds": 1}
    profile = run_profile(settings, {"source": "random", "dtype": "float32", "tiny": True}, seed=0, progress=False)
    remeasure = profile.meta["remeasure"]
    assert remeasure["budget"] == profile.meta["n_points"]
    assert remeasure["n_remeasured"] + remeasure["n_extra_rounds"] <= profile.meta["n_points"]
    assert f"at most 1 x {profile.meta['n_points']} measurements" in remeasure["rule"]
