"""The cost model: Exercise 2's decode table, the JSON contract, scaling."""
from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from servingplan import costmodel
from servingplan.costmodel import EXERCISE2, CostModel

# The source's table at a 2,000-token context: batch -> (step ms, tokens/s)
EXERCISE2_TABLE = {1: (5.09, 197), 2: (5.17, 387), 4: (5.34, 749), 8: (5.69, 1406), 16: (6.38, 2509),
                   24: (7.06, 3398), 32: (7.75, 4128), 48: (9.13, 5259), 64: (10.50, 6093),
                   96: (13.26, 7242), 128: (16.01, 7996)}


def test_exercise2_preset_reproduces_the_source_table():
    rows = costmodel.decode_curve(EXERCISE2, EXERCISE2_TABLE, context=2000)
    for row in rows:
        step_ms, tokens_per_s = EXERCISE2_TABLE[row["batch"]]
        assert row["step_ms"] == pytest.approx(step_ms, abs=0.01)
        assert round(row["tokens_per_s"]) == tokens_per_s


def test_step_time_adds_one_decode_call_and_one_call_per_prefill():
    m = CostModel(1.0, 0.5, 0.01, 2.0, 0.1, 0.001, 0.0001)
    assert m.decode_time(0, 0) == 0.0 and m.prefill_time(0) == 0.0
    assert m.decode_time(4, 100) == 1.0 + 2.0 + 1.0
    assert m.prefill_time(10, cached=20) == pytest.approx(2.0 + 1.0 + 0.1 + 0.02)
    assert m.step_time(4, 100, [(10, 20), (5, 0)]) == pytest.approx(4.0 + 3.12 + 2.525)


def test_padded_decode_reads_batch_times_the_longest_context():
    m = CostModel(0.0, 0.0, 1.0, 0.0, 0.0, ctx_mode="padded_max")
    assert m.decode_time(3, ctx_sum=60, ctx_max=50) == 150.0
    with pytest.raises(ValueError, match="ctx_mode"):
        CostModel(0.0, 0.0, 1.0, 0.0, 0.0, ctx_mode="mean")


@given(speedup=st.floats(0.1, 100), batch=st.integers(0, 256), ctx=st.integers(0, 100_000),
       prompt=st.integers(0, 4096), cached=st.integers(0, 4096))
def test_scaled_divides_every_step_time(speedup, batch, ctx, prompt, cached):
    m = CostModel(3e-3, 1e-4, 4e-8, 2e-3, 5e-5, 1e-9, 2e-9)
    fast = m.scaled(speedup)
    assert fast.step_time(batch, ctx, [(prompt, cached)]) == pytest.approx(
        m.step_time(batch, ctx, [(prompt, cached)]) / speedup, rel=1e-9, abs=1e-15)


def test_json_round_trip(tmp_path):
    path = tmp_path / "cost.json"
    EXERCISE2.save(path)
    assert costmodel.load(path) == EXERCISE2
    assert json.loads(path.read_text())["schema_version"] == costmodel.SCHEMA_VERSION


def test_a_model_the_pipeline_wrote_is_read_back_without_importing_jsonschema(tmp_path):
    """read_written (every simulation job's reader) gives the same model as load, runs the value checks
    and leaves the schema pass, and jsonschema, to the reader of a user's file."""
    import subprocess
    import sys
    path = tmp_path / "cost.json"
    EXERCISE2.save(path)
    assert costmodel.read_written(path) == costmodel.load(path) == EXERCISE2
    probe = ("import sys; from servingplan.costmodel import read_written; model = read_written(sys.argv[1]); "
             "print(model.name, 'jsonschema' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [EXERCISE2.name, "False"]
    document = json.loads(path.read_text())
    document["decode"]["fixed_s"] = -1.0
    path.write_text(json.dumps(document))
    with pytest.raises(ValueError, match="decode.fixed_s"):
        costmodel.read_written(path)


def test_load_refuses_unknown_specs(tmp_path):
    with pytest.raises(ValueError, match="not a preset"):
        costmodel.load("a100")
    stale = tmp_path / "old.json"
    stale.write_text(json.dumps({**EXERCISE2.to_dict(), "schema_version": 0}))
    with pytest.raises(ValueError, match="schema_version"):
        costmodel.load(stale)


# f(B) bumps as on the profiling CPU: matrix-vector kernels at batch 1, slow small GEMMs at 2-3
TABLED = CostModel(0.05, 0.002, 1e-6, 0.04, 1e-3, ctx_mode="padded_max",
                   decode_batch_fixed_s=((4, 0.07), (1, 0.03), (2, 0.065), (8, 0.08)))


def test_decode_table_replaces_the_line_and_interpolates_between_batches():
    assert TABLED.decode_batch_fixed_s == ((1, 0.03), (2, 0.065), (4, 0.07), (8, 0.08))
    assert TABLED.decode_batch_time(1) == 0.03 and TABLED.decode_batch_time(4) == 0.07
    assert TABLED.decode_batch_time(3) == pytest.approx(0.0675)
    assert TABLED.decode_batch_time(6) == pytest.approx(0.075)
    # the context term is the line's, unchanged by the table
    assert TABLED.decode_time(3, ctx_sum=0, ctx_max=100) == pytest.approx(0.0675 + 3 * 100 * 1e-6)
    assert TABLED.decode_time(0, 0) == 0.0


def test_decode_table_holds_its_first_value_below_and_continues_with_the_line_slope_beyond():
    below = CostModel(0.05, 0.002, 0.0, 0.0, 0.0, decode_batch_fixed_s=((2, 0.06), (4, 0.07)))
    assert below.decode_batch_time(1) == 0.06
    assert TABLED.decode_batch_time(9) == pytest.approx(0.08 + 0.002)
    assert TABLED.decode_batch_time(64) == pytest.approx(0.08 + 0.002 * 56)
    without = CostModel(0.05, 0.002, 1e-6, 0.04, 1e-3, ctx_mode="padded_max")
    # beyond the table each extra sequence costs what it costs on the line
    assert TABLED.decode_time(40, 0, 300) - TABLED.decode_time(20, 0, 300) == pytest.approx(
        without.decode_time(40, 0, 300) - without.decode_time(20, 0, 300))


def test_decode_table_refuses_repeated_or_nonpositive_batches():
    for table in (((1, 0.1), (1, 0.2)), ((0, 0.1),)):
        with pytest.raises(ValueError, match="decode_batch_fixed_s"):
            CostModel(0.0, 0.0, 0.0, 0.0, 0.0, decode_batch_fixed_s=table)


@given(speedup=st.floats(0.1, 100), batch=st.integers(0, 80), ctx=st.integers(0, 1000))
def test_scaled_divides_a_tabled_decode_step(speedup, batch, ctx):
    assert TABLED.scaled(speedup).decode_time(batch, 0, ctx) == pytest.approx(
        TABLED.decode_time(batch, 0, ctx) / speedup, rel=1e-9, abs=1e-15)


def test_decode_table_json_round_trip(tmp_path):
    path = tmp_path / "cost.json"
    TABLED.save(path)
    assert json.loads(path.read_text())["decode"]["batch_fixed_s"] == {"batches": [1, 2, 4, 8],
                                                                        "fixed_s": [0.03, 0.065, 0.07, 0.08]}
    loaded = costmodel.load(path)
    assert loaded == TABLED and loaded.decode_batch_time(3) == TABLED.decode_batch_time(3)


def test_a_cost_model_file_without_the_table_loads_as_the_line():
    old = EXERCISE2.to_dict()
    assert "batch_fixed_s" not in old["decode"]
    loaded = CostModel.from_dict(json.loads(json.dumps(old)))
    assert loaded.decode_batch_fixed_s == ()
    assert loaded.decode_time(7, 700) == EXERCISE2.decode_fixed_s + 7 * EXERCISE2.decode_per_seq_s + 700 * (
        EXERCISE2.decode_per_ctx_token_s)


def test_a_speed_band_in_meta_is_checked_where_the_model_enters():
    document = CostModel(0.01, 0.0, 0.0, 0.0, 1e-5, meta={"speed_band": {"decode": [0.9, 1.2],
                                                                      "prefill": [0.95, 1.1]}}).to_dict()
    CostModel.from_dict(document)
    # the capacity stage uses a band only with both kinds: one alone would be ignored
    with pytest.raises(ValueError, match=r"^cost model meta.speed_band = .*: has no prefill"):
        CostModel.from_dict({**document, "meta": {"speed_band": {"decode": [0.9, 1.2]}}})
    document["meta"]["speed_band"]["prefill"] = [0, "slow"]
    with pytest.raises(ValueError, match=r"^cost model meta.speed_band = .*: must be an object whose decode"):
        CostModel.from_dict(document)
