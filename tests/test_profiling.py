"""Model loading, the shared prefill/decode calls, and the quick profile end to end."""
import json
import statistics

import pandas as pd
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from servingplan import roofline
from servingplan.profile import machine
from servingplan.profile import measure as measure_module
from servingplan.profile.kvpool import KVPool, decode_call, decode_step, prefill_call, prefill_step
from servingplan.profile.measure import (
    MAX_EXTRA_ROUNDS_PER_POINT, QUICK_PROFILE, build_grid, decode_lengths, normalise, profile_settings, relative_speed, run_profile, speed_summary,
)
from servingplan.profile.model import QUICK_CONFIG_OVERRIDES, load_model

PROFILE_CFG = {
    "threads": 0, "warmup": 1, "rounds": 3, "repeats": 3, "reference_interval_s": 10,
    "reference_decode": [4, 256], "reference_prefill": 256,
    "prefill_lengths": [16, 512], "prefill_batches": [1, 2], "decode_batches": [1, 64],
    "decode_contexts": [64, 768], "probe_bytes": 2**28, "gemm_size": 1024,
}


def tiny_model(seed=0):
    return load_model("random", seed, QUICK_CONFIG_OVERRIDES)[0]


def test_random_source_is_gpt2_small_in_float32_eval_mode():
    model, meta = load_model("random", 0)
    assert meta["param_count"] == 124_439_808
    assert (meta["n_layer"], meta["n_head"], meta["n_embd"], meta["n_positions"]) == (12, 12, 768, 1024)
    assert meta["random_weights"] and meta["source"] == "random"
    assert meta["param_bytes"] == 4 * meta["param_count"]
    assert not model.training
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_same_seed_gives_same_weights_and_another_seed_does_not():
    first, second, other = tiny_model(3).state_dict(), tiny_model(3).state_dict(), tiny_model(4).state_dict()
    assert all(torch.equal(first[name], second[name]) for name in first)
    name = "transformer.h.0.attn.c_attn.weight"
    assert not torch.equal(first[name], other[name])


def test_local_checkpoint_round_trip(tmp_path):
    torch.manual_seed(7)
    saved = GPT2LMHeadModel(GPT2Config(**QUICK_CONFIG_OVERRIDES)).eval()
    saved.save_pretrained(tmp_path)
    loaded, meta = load_model(str(tmp_path), seed=0)
    assert not meta["random_weights"] and meta["source"] == str(tmp_path)
    assert meta["n_layer"] == 2 and meta["n_embd"] == 64
    expected = saved.state_dict()
    assert expected.keys() == loaded.state_dict().keys()
    assert all(torch.equal(expected[name], tensor) for name, tensor in loaded.state_dict().items())


@pytest.mark.parametrize("make_source", [lambda tmp: tmp / "missing", lambda tmp: tmp])
def test_bad_source_is_one_line_value_error(tmp_path, make_source):
    with pytest.raises(ValueError) as err:
        load_model(str(make_source(tmp_path)), seed=0)
    assert "\n" not in str(err.value) and "checkpoint" in str(err.value)


def test_chunked_prefill_through_the_cache_matches_one_prefill():
    model = tiny_model()
    prompt = torch.randint(model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    whole = prefill_call(model, prompt)
    first_chunk = prefill_call(model, prompt[:, :16])
    second_chunk = prefill_call(model, prompt[:, 16:], first_chunk.past_key_values)
    assert whole.logits.shape == (1, 1, model.config.vocab_size)
    assert second_chunk.past_key_values.get_seq_length() == 24
    torch.testing.assert_close(second_chunk.logits, whole.logits, rtol=1e-4, atol=1e-5)


def test_decode_after_prefill_matches_prefill_of_the_longer_prompt():
    model = tiny_model()
    prompts = torch.randint(model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
    cache = prefill_call(model, prompts[:, :8]).past_key_values
    step = decode_call(model, prompts[:, 8:], cache, torch.ones(3, 9, dtype=torch.long),
                       torch.full((3, 1), 8, dtype=torch.long))
    torch.testing.assert_close(step.logits, prefill_call(model, prompts).logits, rtol=1e-4, atol=1e-5)


def test_the_engine_step_functions_on_a_pool_match_a_plain_prefill_of_the_longer_prompts():
    model = tiny_model()
    prompts = torch.randint(model.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
    lengths = torch.tensor([8, 5, 3])
    pool = KVPool(model.config, slots=3, capacity=12)
    for slot, length in enumerate(lengths.tolist()):
        prefill_step(model, pool, slot, prompts[slot:slot + 1, :length], cached=0)
    next_ids = torch.stack([prompts[slot, length] for slot, length in enumerate(lengths.tolist())])[:, None]
    logits = decode_step(model, pool, lengths, next_ids)
    for slot, length in enumerate(lengths.tolist()):
        expected = prefill_call(model, prompts[slot:slot + 1, :length + 1]).logits[0, -1]
        torch.testing.assert_close(logits[slot], expected, rtol=1e-4, atol=1e-5)


def test_the_step_functions_write_each_new_entry_into_its_slot_in_place():
    model = tiny_model()
    prompts = torch.randint(model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(2))
    pool = KVPool(model.config, slots=2, capacity=16)
    storage = (pool.keys.data_ptr(), pool.values.data_ptr())
    prefill_step(model, pool, 1, prompts[1:, :4], cached=0)
    prefill_step(model, pool, 1, prompts[1:, 4:7], cached=4)     # a second chunk after the first
    prefill_step(model, pool, 0, prompts[:1, :10], cached=0)
    decode_step(model, pool, torch.tensor([10, 7]), torch.stack([prompts[0, 10:11], prompts[1, 7:8]]))
    assert (pool.keys.data_ptr(), pool.values.data_ptr()) == storage
    assert pool.stored == [11, 8]
    # what a plain prefill of each sequence's tokens so far caches, at the same positions of its slot
    for slot, length in ((0, 11), (1, 8)):
        cache = prefill_call(model, prompts[slot:slot + 1, :length]).past_key_values
        for layer, plain in enumerate(cache.layers):
            torch.testing.assert_close(pool.keys[layer, slot, :, :length], plain.keys[0], rtol=1e-4, atol=1e-5)
            torch.testing.assert_close(pool.values[layer, slot, :, :length], plain.values[0], rtol=1e-4, atol=1e-5)


def test_a_decode_step_allocates_nothing_that_grows_like_a_copy_of_the_batch_s_past():
    model = tiny_model()
    config = model.config
    batch = 4
    pool = KVPool(config, slots=batch, capacity=900)
    ids = torch.zeros(batch, 1, dtype=torch.long)

    def allocated_bytes(context: int) -> int:
        lengths = torch.tensor([context, context - 3, context // 2, context - 1])
        decode_step(model, pool, lengths, ids)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            decode_step(model, pool, lengths, ids)
        return sum(event.cpu_memory_usage for event in prof.events() if event.cpu_memory_usage > 0)

    per_context_token = (allocated_bytes(800) - allocated_bytes(100)) / 700
    # a copy of the batch's past (a DynamicCache's concatenation) allocates the whole K and V of every
    # row per context token; what is left grows with attention's scores and mask, far below that
    batch_kv_per_token = batch * 2 * config.n_layer * config.n_embd * 4
    assert per_context_token < batch_kv_per_token / 4


def test_profiled_decode_batches_are_ragged_like_the_engine_s():
    assert decode_lengths(1, 256).tolist() == [256]
    lengths = decode_lengths(4, 256)
    assert lengths.max() == 256 and lengths.min() == 128 and len(set(lengths.tolist())) == 4


def test_normalising_by_the_speed_trace_removes_a_slowdown_of_the_whole_machine():
    # the machine runs 1.5x slower after t = 10 s; the same call measured before and after
    trace = pd.DataFrame({"t_s": [0.0, 9.0, 11.0, 20.0], "kind": "decode", "seconds": [1.0, 1.0, 1.5, 1.5]})
    samples = pd.DataFrame({"kind": "decode", "t_s": [2.0, 18.0], "seconds": [0.2, 0.3]})
    normalised = normalise(samples, trace)
    assert normalised["normalized_s"].iloc[0] == pytest.approx(normalised["normalized_s"].iloc[1])
    assert relative_speed(trace, "decode", [10.0])[0] == pytest.approx(1.25 / 1.25)
    summary = speed_summary(trace)
    assert summary["by_kind"]["decode"]["moved_pct"] == pytest.approx(100 * 0.5 / 1.25)
    assert summary["moved_more_than_10pct"] and summary["by_kind"]["decode"]["relative_max"] == pytest.approx(1.2)


def test_fingerprint_is_stable_and_depends_on_threads():
    assert machine.fingerprint(2) == machine.fingerprint(2)
    assert len(machine.fingerprint(2)) == 10
    assert machine.fingerprint(1) != machine.fingerprint(3)
    assert machine.fingerprint(0) == machine.fingerprint(machine.resolve_threads(0))


@pytest.fixture(scope="module")
def quick_profile(quick_profile_files):
    points, samples, meta = quick_profile_files
    return [pd.read_csv(points), pd.read_csv(samples), json.loads(meta.read_text())]


def test_quick_profile_measures_every_grid_point_with_positive_times(quick_profile):
    points, samples, meta = quick_profile
    grid = build_grid(profile_settings(PROFILE_CFG, quick=True))
    assert len(points) == len(grid)
    assert set(zip(points.kind, points.batch, points.prompt_len, points.cached)) == {
        (p.kind, p.batch, p.prompt_len, p.cached) for p in grid}
    assert set(points.kind) == {"prefill", "prefill_batch", "prefill_cached", "decode"}
    assert (points.median_s > 0).all() and (points.floor_s > 0).all() and (points.efficiency > 0).all()
    assert (points.round_min_s <= points.median_s).all() and (points.median_s <= points.round_max_s).all()
    # extra rounds go only to points whose rounds disagree, within the bound
    assert (points.n_rounds == QUICK_PROFILE["rounds"] + points.n_extra_rounds).all()
    assert (points.n_extra_rounds <= MAX_EXTRA_ROUNDS_PER_POINT).all()
    assert (points.n_repeats == points.n_rounds * QUICK_PROFILE["repeats"]).all()
    remeasure = quick_profile[2]["remeasure"]
    assert remeasure["n_remeasured"] + remeasure["n_extra_rounds"] <= remeasure["budget"]
    assert remeasure["n_extra_rounds"] == points.n_extra_rounds.sum()
    assert samples[samples.superseded].groupby(["point_id", "round"]).ngroups <= remeasure["n_remeasured"]
    samples = samples[~samples.superseded]
    assert (samples.seconds > 0).all() and (samples.speed > 0).all()
    assert samples.normalized_s.to_numpy() == pytest.approx((samples.seconds / samples.speed).to_numpy())
    # rounds are spread over the run: each point's rounds were measured at different times
    spans = samples.groupby("point_id").t_s.agg(lambda t: t.max() - t.min())
    assert (spans > 0).all()
    per_round = samples.groupby(["point_id", "round"]).normalized_s.median().groupby("point_id").median()
    assert per_round.loc[points.point_id].to_numpy() == pytest.approx(points.median_s.to_numpy())


def test_quick_profile_metadata(quick_profile):
    meta = quick_profile[2]
    assert meta["wall_time_s"] > 0 and meta["settings"]["quick"] and meta["settings"]["tiny"]
    assert meta["model"]["n_layer"] == QUICK_CONFIG_OVERRIDES["n_layer"]
    assert meta["roofline"]["bandwidth_gbs"] > 0 and meta["roofline"]["gemm_gflops"] > 0
    assert meta["machine"]["fingerprint"] == machine.fingerprint(meta["machine"]["threads"])
    assert meta["memory"]["peak_rss_bytes"] >= meta["memory"]["param_bytes"]
    trace = pd.DataFrame(meta["speed"]["trace"])
    assert set(trace.kind) == {"decode", "prefill"} and trace.groupby("kind").size().min() >= 2
    assert meta["speed"]["moved_pct"] >= 0 and set(meta["speed"]["by_kind"]) == {"decode", "prefill"}


def test_the_roofline_is_the_peak_of_probes_read_through_the_profile_on_the_models_products(quick_profile):
    points, meta = quick_profile[0], quick_profile[2]
    peak = meta["roofline"]
    readings = peak["readings"]
    assert [r["label"] for r in readings] == ["start"] + [f"before round {r + 1}" for r in
                                                          range(1, QUICK_PROFILE["rounds"])] + ["end"]
    assert [r["t_s"] for r in readings] == sorted(r["t_s"] for r in readings)
    assert peak["bandwidth_gbs"] == max(r["bandwidth_gbs"] for r in readings)
    assert peak["gemm_gflops"] == max(rate for r in readings for rate in r["gemm_by_shape"].values())
    # what a typical round ran at, which the carry-over scales from: each probe's median reading
    assert peak["seen"] == {"bandwidth_gbs": statistics.median(r["bandwidth_gbs"] for r in readings),
                            "gemm_gflops": statistics.median(r["gemm_gflops"] for r in readings),
                            "readings": len(readings)}
    arch = roofline.architecture_of(meta["model"])
    products = roofline.gemm_shapes(arch, max(QUICK_PROFILE["decode_batches"]), max(QUICK_PROFILE["prefill_lengths"]))
    size = QUICK_PROFILE["gemm_size"]
    assert peak["gemm_shapes"] == [list(shape) for shape in products] + [[size, size, size]]
    assert all(set(r["gemm_by_shape"]) == {machine.shape_name(s) for s in peak["gemm_shapes"]} for r in readings)
    # every point's floor counts its work with the one roofline work model, at the peaks
    for point in points.itertuples():
        work = roofline.call_work(arch, point.kind, point.batch, point.prompt_len, point.cached)
        assert (point.flops, point.bytes) == pytest.approx((work.flops, work.bytes), rel=1e-12)
        assert point.floor_s == pytest.approx(max(work.bytes / (peak["bandwidth_gbs"] * 1e9), work.flops / (peak["gemm_gflops"] * 1e9)), rel=1e-12)


def test_measured_kv_bytes_per_token_is_two_tensors_per_layer_in_float32(quick_profile):
    memory = quick_profile[2]["memory"]
    assert memory["kv_bytes_per_token"] == 2 * 2 * 64 * 4 == memory["kv_bytes_per_token_expected"]


def test_only_float32_is_profiled():
    with pytest.raises(ValueError, match="float32"):
        run_profile(PROFILE_CFG, {"source": "random", "dtype": "bfloat16"}, seed=0, quick=True, progress=False)


def test_tiny_model_setting_keeps_the_configured_grid():
    grid = {**QUICK_PROFILE, "prefill_lengths": [8], "prefill_batches": [1], "decode_batches": [2],
            "decode_contexts": [4], "cached_prefill": [(4, 4)]}
    profile = run_profile(grid, {"source": "random", "dtype": "float32", "tiny": True}, seed=0, progress=False)
    assert profile.meta["model"]["n_layer"] == QUICK_CONFIG_OVERRIDES["n_layer"]
    assert not profile.meta["settings"]["quick"] and profile.meta["settings"]["tiny"]
    assert set(zip(profile.points.kind, profile.points.batch, profile.points.prompt_len, profile.points.cached)) == {
        ("prefill", 1, 8, 0), ("prefill_batch", 1, 128, 0), ("prefill_cached", 1, 4, 4), ("decode", 2, 1, 4)}


def test_the_check_s_references_are_read_at_its_threads_before_each_round_and_at_the_end(monkeypatch):
    """With check_references set (the carry-over check on), the profile reads the check's reference shapes
    at the check's threads in its own window, with the check's estimator, and restores its own threads after
    each reading: every measurement runs at the profile's threads."""
    grid = {**QUICK_PROFILE, "threads": 2, "rounds": 2, "prefill_lengths": [8], "prefill_batches": [1],
            "decode_batches": [2], "decode_contexts": [4], "cached_prefill": [(4, 4)],
            "check_references": {"threads": 1, "reference_decode": [2, 8], "reference_prefill": 8, "warmup": 0,
                                 "repeats": 2}}
    seen = []
    real = measure_module.time_call

    def recording(call, warmup, repeats, clock_zero):
        seen.append((torch.get_num_threads(), repeats))
        return real(call, warmup, repeats, clock_zero)

    monkeypatch.setattr(measure_module, "time_call", recording)
    profile = run_profile(grid, {"source": "random", "dtype": "float32", "tiny": True}, seed=0, progress=False)
    window = profile.meta["check_references"]
    assert [row["label"] for row in window["readings"]] == [
        "before round 1", "before round 1", "before round 2", "before round 2", "end", "end"]
    assert {row["kind"] for row in window["readings"]} == {"decode", "prefill"}
    for kind, values in window["by_kind"].items():
        seconds = [row["seconds"] for row in window["readings"] if row["kind"] == kind]
        assert values["n"] == 3 and values["median_s"] == statistics.median(seconds) and values["log_sigma"] >= 0
    # 6 window readings at 1 thread, of 2 calls each; everything else at the profile's 2 threads
    assert sum(1 for threads, _ in seen if threads == 1) == 6 and all(r == 2 for t, r in seen if t == 1)
    assert all(threads in (1, 2) for threads, _ in seen) and torch.get_num_threads() == 2
    assert profile.meta["settings"]["threads"] == 2


def test_a_profile_without_the_check_reads_no_window():
    grid = {**QUICK_PROFILE, "prefill_lengths": [8], "prefill_batches": [1], "decode_batches": [2],
            "decode_contexts": [4], "cached_prefill": [(4, 4)]}
    profile = run_profile(grid, {"source": "random", "dtype": "float32", "tiny": True}, seed=0, progress=False)
    assert "check_references" not in profile.meta
