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


def test_load_refuses_unknown_specs(tmp_path):
    with pytest.raises(ValueError, match="not a preset"):
        costmodel.load("a100")
    stale = tmp_path / "old.json"
    stale.write_text(json.dumps({**EXERCISE2.to_dict(), "schema_version": 0}))
    with pytest.raises(ValueError, match="schema_version"):
        costmodel.load(stale)
