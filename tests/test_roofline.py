"""The one roofline work model (servingplan.roofline): its counts against a hand computation for
GPT2Config(), against the modules transformers builds, and the profiler, the fit and the carry-over
reading their floors from it alike."""
import pandas as pd
import pytest
from transformers import GPT2Config, GPT2LMHeadModel

from servingplan import architecture, roofline
from servingplan.costmodel import CostModel
from servingplan.fit.step_model import Floors, physical_readings
from servingplan.plan import hardware
from servingplan.profile import measure

GPT2 = architecture.GPT2_SMALL


def test_term_work_matches_a_hand_computation_for_gpt2_small():
    e, layers, vocab, positions = 768, 12, 50257, 1024
    # per token and layer: q/k/v 768 x 2304, output 768 x 768, MLP 768 x 3072 and 3072 x 768
    block_macs = layers * (768 * 2304 + 768 * 768 + 768 * 3072 + 3072 * 768)
    assert block_macs == 84_934_656
    head_macs = 768 * 50257
    pair = 4 * e * layers  # score and weighted value, every layer
    kv = 2 * layers * e * 4
    weights = 4 * (124_439_808 - positions * e)  # GPT-2 small's parameters, the position table aside
    work = roofline.term_work(GPT2)
    assert work["decode_fixed_s"] == roofline.Work(weights, 0.0) == roofline.Work(494_613_504, 0.0)
    assert work["decode_per_seq_s"] == roofline.Work(kv, 2 * block_macs + 2 * head_macs + pair)
    assert work["decode_per_seq_s"].flops == 247_100_928  # about 247 MFLOP per decoding sequence
    assert work["decode_per_ctx_token_s"] == roofline.Work(73_728, 36_864)
    # a prefill call asks for the last token's logits alone: the LM head is per call, not per token
    assert work["prefill_fixed_s"] == roofline.Work(weights, 2 * head_macs)
    assert work["prefill_per_token_s"] == roofline.Work(kv, 2 * block_macs + pair / 2)
    assert work["prefill_per_token_s"].flops == 169_887_744  # about 170 MFLOP per prompt token
    # the causal triangle: L (L + 1) / 2 pairs, half a pair per squared token and per token
    assert work["prefill_per_token_sq_s"] == roofline.Work(0.0, 18_432)
    assert work["prefill_per_token_ctx_s"] == roofline.Work(0.0, 36_864)
    assert set(work) == set(roofline.TERMS)


def test_the_products_counted_are_the_modules_transformers_builds():
    config = GPT2Config(**architecture.QUICK_CONFIG_OVERRIDES)
    model = GPT2LMHeadModel(config)
    block = model.transformer.h[0]
    arch = {key: getattr(config, key) for key in GPT2}
    products = roofline.block_products(arch)
    # transformers' Conv1D stores its weight as (inner, outer)
    assert tuple(block.attn.c_attn.weight.shape) == products["attention_qkv"]
    assert tuple(block.attn.c_proj.weight.shape) == products["attention_out"]
    assert tuple(block.mlp.c_fc.weight.shape) == products["mlp_up"]
    assert tuple(block.mlp.c_proj.weight.shape) == products["mlp_down"]
    assert tuple(model.lm_head.weight.shape[::-1]) == roofline.lm_head(arch)
    every_weight = sum(p.numel() for p in {p.data_ptr(): p for p in model.parameters()}.values())
    assert roofline.weights_read_bytes(arch) == 4 * (every_weight - model.transformer.wpe.weight.numel())


def test_a_calls_work_is_the_sum_of_its_terms_units():
    work = roofline.term_work(GPT2)
    decode = roofline.call_work(GPT2, "decode", 8, 1, 300)
    assert decode.flops == pytest.approx(8 * work["decode_per_seq_s"].flops + 8 * 300 * work["decode_per_ctx_token_s"].flops)
    assert decode.bytes == pytest.approx(work["decode_fixed_s"].bytes + 8 * 73_728 + 8 * 300 * 73_728)
    chunk = roofline.call_work(GPT2, "prefill_cached", 1, 128, 256)
    pairs = 128 * 256 + 128 * 129 / 2
    assert chunk.flops == pytest.approx(2 * 768 * 50257 + 128 * 169_869_312 + pairs * 36_864)
    # a batched prefill reads the weights once for all its prompts
    batched = roofline.call_work(GPT2, "prefill_batch", 4, 128, 0)
    single = roofline.call_work(GPT2, "prefill", 1, 128, 0)
    assert batched.flops == pytest.approx(4 * single.flops)
    assert batched.bytes == pytest.approx(single.bytes + 3 * 128 * 73_728)
    assert roofline.batch_work(GPT2, 5) == work["decode_fixed_s"] + work["decode_per_seq_s"].times(5)


def test_the_gemm_probe_runs_the_models_own_products():
    shapes = roofline.gemm_shapes(GPT2, 32, 512)
    assert (512, 768, 2304) in shapes and (512, 3072, 768) in shapes and (32, 768, 768) in shapes
    assert shapes[-1] == (32, 768, 50257)


def test_the_profiler_the_fit_and_the_carry_over_read_one_floor_per_term():
    """By construction: the three users take their work from roofline.term_work, so one term has one
    floor whichever of them states it."""
    peak = {"bandwidth_gbs": 12.0, "gemm_gflops": 150.0}
    meta = {"model": {**GPT2, "n_inner": None}, "roofline": peak}
    floors = Floors.of(meta)
    coefficients = {term: 1.0 for term in roofline.TERMS}
    fitted = physical_readings(coefficients, floors)
    cost = CostModel(**coefficients, ctx_mode="padded_max", decode_batch_fixed_s=((4, 1.0),))
    here = {"name": "here", "bandwidth_gbs": 12.0, "gflops": 150.0}
    _, rows = hardware.carry_over(cost, GPT2, here, {**here, "name": "there"})
    carried = {row["term"]: row for row in rows if row["batch"] is None}
    for term in roofline.TERMS:
        expected = roofline.floor(roofline.term_work(GPT2)[term], 12.0, 150.0)[0]
        assert fitted[term]["floor"] == carried[term]["roofline_here_s"] == floors.term(term) == expected
    batch_row = next(row for row in rows if row["batch"] == 4)
    assert batch_row["roofline_here_s"] == floors.batch(4)
    # the profiler's floor of a decode point: the same terms' work summed over the call's units
    point = measure.GridPoint("decode", 4, 1, 256)
    samples = _one_sample()
    row = measure._point_row(0, point, samples, GPT2, peak, samples.assign(superseded=False), planned_rounds=1)
    work = roofline.term_work(GPT2)
    assert row["flops"] == pytest.approx(4 * work["decode_per_seq_s"].flops + 4 * 256 * work["decode_per_ctx_token_s"].flops)
    assert row["bytes"] == pytest.approx(work["decode_fixed_s"].bytes + 4 * work["decode_per_seq_s"].bytes
                                         + 4 * 256 * work["decode_per_ctx_token_s"].bytes)


def _one_sample():
    return pd.DataFrame({"round": [0], "normalized_s": [0.1], "seconds": [0.1], "cpu_share": [1.0]})


def test_architecture_of_a_profile_reads_its_models_shape():
    meta = {key: value for key, value in GPT2.items() if key != "n_inner"}
    assert roofline.architecture_of(meta) == GPT2
    with pytest.raises(KeyError):
        roofline.architecture_of({"n_embd": 768})


def test_a_probe_reading_records_every_product_and_the_peak_is_the_highest():
    readings = [{"label": label, "t_s": t, "bandwidth_gbs": bw, "gemm_gflops": max(by_shape.values()),
                 "gemm_by_shape": by_shape, "probe_bytes": 2**20, "gemm_size": 64, "probe_repeats": 7}
                for label, t, bw, by_shape in (("start", 0.0, 10.0, {"4x8x8": 50.0, "64x64x64": 80.0}),
                                               ("end", 9.0, 14.0, {"4x8x8": 90.0, "64x64x64": 70.0}))]
    peak = measure.machine.peak_roofline(readings)
    assert (peak["bandwidth_gbs"], peak["gemm_gflops"]) == (14.0, 90.0)
    assert peak["peak"]["gemm_reading"] == "end" and peak["peak"]["gemm_shape"] == "4x8x8"
    assert peak["peak"]["gemm_lowest_over_peak"] == pytest.approx(80.0 / 90.0)
    assert peak["gemm_shapes"] == [[4, 8, 8], [64, 64, 64]] and peak["readings"] == readings


def test_a_probe_reading_rates_every_product_and_the_square_one():
    probe = measure.machine.roofline_probes(2**20, 16, gemm_shapes=[(4, 16, 8)])
    assert set(probe["gemm_by_shape"]) == {"4x16x8", "16x16x16"}
    assert probe["gemm_gflops"] == max(probe["gemm_by_shape"].values()) > 0
