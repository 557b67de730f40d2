"""benchmarks/bench_engine_steps.py: its tables' arithmetic and its refusal of bad trees."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_engine_steps  # noqa: E402

REFERENCE = {"gemm_s": 1.0, "copy_s": 1.0}


def worker(decode_s: float, reference_scale: float = 1.0) -> dict:
    reference = {kind: value * reference_scale for kind, value in REFERENCE.items()}
    # the reading after the shapes carries the process's state too: never counted as the machine's drift
    return {"reference before": reference, "decode B32 ctx512": decode_s,
            "reference after": {kind: 3 * value for kind, value in reference.items()}}


def test_the_ratio_is_taken_round_by_round_and_noise_is_the_before_tree_s_spread():
    before = [worker(0.200), worker(0.250), worker(0.220)]
    after = [worker(0.100), worker(0.150), worker(0.110)]
    (row,) = bench_engine_steps.step_table(before, after)
    assert row["shape"] == "decode B32 ctx512"
    assert row["before_ms"] == pytest.approx(220.0) and row["after_ms"] == pytest.approx(110.0)
    assert row["ratio_median"] == pytest.approx(0.5)              # 0.5, 0.6, 0.5
    assert (row["ratio_min"], row["ratio_max"]) == pytest.approx((0.5, 0.6))
    assert row["speedup"] == pytest.approx(2.0)
    assert row["noise"] == pytest.approx(0.25)                     # 0.250 / 0.200 - 1
    assert not row["slower_beyond_noise"]


def test_a_shape_slower_by_more_than_the_noise_is_flagged():
    (row,) = bench_engine_steps.step_table([worker(0.100), worker(0.105)], [worker(0.120), worker(0.126)])
    assert row["ratio_median"] == pytest.approx(1.2) and row["noise"] == pytest.approx(0.05)
    assert row["slower_beyond_noise"]


def test_expected_memory_is_weights_plus_cap_slots_plus_the_runtime_measured_at_cap_1():
    gb = 1e9
    readings = {1: {"peak_rss_bytes": 1.0 * gb, "weights_bytes": 0.5 * gb, "slot_kv_bytes": 0.1 * gb},
                8: {"peak_rss_bytes": 1.8 * gb, "weights_bytes": 0.5 * gb, "slot_kv_bytes": 0.1 * gb}}
    one, eight = bench_engine_steps.memory_table({"after": readings})
    assert one["runtime_at_cap1_gb"] == pytest.approx(0.4) and one["error_vs_expected"] == pytest.approx(0.0)
    assert eight["weights_plus_kv_gb"] == pytest.approx(1.3)
    assert eight["expected_gb"] == pytest.approx(1.7)
    assert eight["error_vs_expected"] == pytest.approx(1.8 / 1.7 - 1)


def test_the_machine_drift_spans_every_reading_of_both_trees():
    drift = bench_engine_steps.machine_drift({"before": [worker(0.1, 1.0)], "after": [worker(0.1, 1.3)]})
    assert drift == pytest.approx({"gemm_s": 0.3, "copy_s": 0.3})


@pytest.mark.parametrize("argv", [["--before", "/nonexistent", "--after", "."],
                                  ["--before", ".", "--after", ".", "--rounds", "1"]])
def test_bad_input_is_one_line_and_exit_2(argv, capsys, monkeypatch):
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    assert bench_engine_steps.main(argv) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_a_tree_of_either_layout_is_found_and_a_tree_of_neither_refused(tmp_path):
    """Trees from before the package by stage keep the engine's steps in servingplan/serving/, later ones in
    servingplan/profile/: a change measured across the move runs each tree's own modules."""
    repo = Path(__file__).resolve().parent.parent
    assert bench_engine_steps.tree_layout(repo)["kvpool"] == "servingplan.profile.kvpool"
    old = tmp_path / "old"
    (old / "servingplan" / "serving").mkdir(parents=True)
    (old / "servingplan" / "serving" / "kvpool.py").write_text("")
    assert bench_engine_steps.tree_layout(old) == bench_engine_steps.LAYOUTS["servingplan/serving/kvpool.py"]
    assert bench_engine_steps.tree_layout(tmp_path) is None
    assert bench_engine_steps.main(["--before", str(tmp_path), "--after", str(repo)]) == 2
