"""The carry-over's accuracy measured in the run (servingplan/check/carry_check.py): the cost model carried to
this machine at 1 thread, each capacity cell compared with the 1-thread model's, and the summary the
report quotes."""
from __future__ import annotations

import dataclasses

import pytest

from servingplan import architecture, roofline
from servingplan.check import carry_check
from servingplan.costmodel import CostModel
from servingplan.plan.hardware import HERE, memory_for
from servingplan.profile.grid import ragged_contexts
from servingplan.seeds import simulation_seeds
from test_planner import FAST, MACHINE, small_config


def machine(threads: int, bandwidth_gbs: float, gflops: float) -> dict:
    rates = {"bandwidth_gbs": bandwidth_gbs, "gemm_gflops": gflops}
    return {**MACHINE, "machine": {"threads": threads}, "roofline": {**rates, "seen": {**rates, "readings": 1}}}


def settings() -> dict:
    config = small_config()
    config["sweep"].update(policies=["continuous", "static"], caps=[4])
    return {**carry_check.settings_of(config), "model": config["model"]}


def test_settings_of_a_config_is_what_the_rule_passes():
    """The benchmarks' settings from a whole config: the rule's sections, this machine's KV model set (a
    memory section without it is refused by the simulation), the sweep's cells kept, its rates left out."""
    config = small_config()
    given = carry_check.settings_of(config)
    assert given["memory"]["kv_memory"] == memory_for(config, HERE)["kv_memory"] == "slots"
    assert set(given["memory"]) <= {"block_size", "budget_gb", "kv_memory", "max_context"}
    assert given["sweep"]["policies"] == config["sweep"]["policies"] and "rates" not in given["sweep"]
    assert given["seeds"] == simulation_seeds(config)


# peaks far above what MEASURED's terms reach, so that no carried term meets a floor (none is clamped)
PEAKS = (50_000.0, 5_000_000.0)


# FAST with every term above zero, as a fit gives it (a zero term would be raised to its floor)
MEASURED = dataclasses.replace(FAST, prefill_per_token_sq_s=1e-8, prefill_per_token_ctx_s=1e-8)


# rates at which a model held at its floors runs the small config's workload at a few requests per second
RATES = (400.0, 800.0)


def at_floors(bandwidth_gbs: float, gflops: float) -> CostModel:
    """Every term at its roofline time on a machine of these rates, nothing above it."""
    floors = roofline.term_floors(architecture.architecture(settings()["model"]), bandwidth_gbs, gflops)
    return CostModel(**{term: seconds for term, (seconds, _) in floors.items()}, ctx_mode=MEASURED.ctx_mode,
                     name="at its floors", meta=MEASURED.meta)


def run_check(cost_one, machine_one, cost_here=MEASURED, machine_here=None):
    s = settings()
    return carry_check.check(cost_here, machine_here or machine(2, *PEAKS), cost_one, machine_one, s.pop("model"), s)


def half_rates_at_floors(truth=None):
    """The check of a model held at its floors here, carried to a target whose probes read half this
    machine's, against `truth` (by default this machine's model: the target was as fast as here)."""
    here = at_floors(*RATES)
    return run_check(truth or here, machine(1, RATES[0] / 2, RATES[1] / 2), here, machine(2, *RATES))


def test_a_target_with_this_machines_roofline_and_model_is_estimated_exactly():
    # the same roofline carries every term at scale 1 and the same model is the truth: every error is 0
    result = run_check(MEASURED, machine(1, *PEAKS))
    assert result["clamped_terms"] == []
    assert (result["threads_here"], result["threads_target"]) == (2, 1)
    assert len(result["rows"]) == 2 * len(carry_check.CRITERIA)
    for row in result["rows"]:
        assert row["estimated_rps"] == pytest.approx(row["measured_rps"])
        assert row["error"] == pytest.approx(0.0, abs=1e-12)
    summary = result["summary"]
    assert summary["cells"] == summary["within_goal"] == 4 and summary["median_abs_error"] == pytest.approx(0.0, abs=1e-12)


def test_a_slower_target_whose_truth_is_faster_reads_as_a_pessimistic_estimate():
    # every term at its floor here and the target's probes read half this machine's, so every carried
    # term doubles, while the model measured there is this machine's: the estimate expects less capacity
    # than was measured
    result = half_rates_at_floors()
    errors = [row["error"] for row in result["rows"]]
    assert all(e < -carry_check.GOAL for e in errors)
    assert result["summary"]["direction"] == "pessimistic" and result["summary"]["within_goal"] == 0


def test_the_summary_counts_the_goal_and_names_the_direction():
    rows = [{"error": e} for e in (-0.1, 0.2, -0.05, None)]
    summary = carry_check.summarize(rows)
    assert summary == {"cells": 3, "within_goal": 2, "median_abs_error": pytest.approx(0.1), "largest_error": 0.2,
                       "direction": "mixed", "uncompared": 1}
    assert carry_check.summarize([{"error": 0.3}, {"error": 0.01}])["direction"] == "optimistic"
    assert carry_check.summarize([{"error": None}]) is None


def test_each_call_shows_the_ratio_the_probes_assumed_against_the_ratio_measured():
    # every term at its floor and the target's probes read half this machine's: every carried call takes
    # twice as long (the assumed ratio 2); the truth there is this machine's model (measured ratio 1), so
    # every call is 100% over
    result = half_rates_at_floors()
    calls = result["calls"]
    assert [(c["kind"], c["size"]) for c in calls] == (
        [("decode", b) for b in carry_check.CALL_BATCHES] + [("prefill", n) for n in carry_check.CALL_PROMPTS])
    for call in calls:
        assert call["seconds_here"] == pytest.approx(call["seconds_measured"])
        assert call["ratio_assumed"] == pytest.approx(2.0) and call["ratio_measured"] == pytest.approx(1.0)
        assert call["error"] == pytest.approx(1.0)
        assert call["seconds_estimated"] == pytest.approx(2.0 * call["seconds_here"])
    assert result["worst_call"] in calls


def test_the_worst_call_is_the_one_the_carry_over_missed_most():
    # a 1-thread truth whose prefill per token is twice this machine's, under the same roofline (the
    # carried model is this machine's): only the prefills miss, the longest most, and optimistically
    truth = dataclasses.replace(MEASURED, prefill_per_token_s=2 * MEASURED.prefill_per_token_s)
    result = run_check(truth, machine(1, *PEAKS))
    worst = result["worst_call"]
    assert (worst["kind"], worst["size"]) == ("prefill", max(carry_check.CALL_PROMPTS))
    assert worst["error"] < 0 and worst["ratio_assumed"] == pytest.approx(1.0)
    assert all(call["error"] == pytest.approx(0.0) for call in result["calls"] if call["kind"] == "decode")


def test_time_above_the_floor_is_carried_to_the_1_thread_target_as_it_was():
    # every term far above its floor (the peaks dwarf the work): halving the probes adds only each call's
    # floor once more, under 1% of its time here (keeping the terms' efficiency would double it), as a
    # 1-thread machine whose calls are host-bound measures it
    result = run_check(MEASURED, machine(1, PEAKS[0] / 2, PEAKS[1] / 2))
    for call in result["calls"]:
        assert 1.0 < call["ratio_assumed"] < 1.01 and 0.0 < call["error"] < 0.01



REFERENCES = {"threads": 1, "reference_decode": [4, 256], "reference_prefill": 64, "warmup": 0, "repeats": 3}


def reference_times(cost: CostModel) -> tuple[float, float]:
    """`cost`'s time for the check's decode and prefill reference shapes."""
    batch, context = REFERENCES["reference_decode"]
    return (cost.decode_time(batch, sum(ragged_contexts(batch, context)), context),
            cost.prefill_time(REFERENCES["reference_prefill"]))


def window_read(decode_s: float, prefill_s: float, sigma: float = 0.01, n: int = 5, **changed) -> dict:
    """A profile's `check_references`: the check's references read n times in its window."""
    by_kind = {kind: {"n": n, "median_s": seconds, "log_sigma": sigma}
               for kind, seconds in (("decode", decode_s), ("prefill", prefill_s))}
    readings = [{"label": f"before round {k + 1}", "kind": kind, "seconds": by_kind[kind]["median_s"], "t_s": k}
                for k in range(n) for kind in by_kind]
    return {**REFERENCES, **changed, "readings": readings, "by_kind": by_kind}


def one_thread_run(machine_one: dict) -> dict:
    return {**machine_one, "settings": dict(REFERENCES)}


def test_a_1_thread_model_slower_than_the_window_read_it_is_brought_to_the_profile_s_window():
    # the 1-thread machine is this machine's model, but its profile ran where every call took 1.5x as long
    # as the profile's window read the references: as run every capacity reads low and the estimates high;
    # brought to the profile's window every error is 0 again
    slow = MEASURED.slowed(1.5, 1.5)
    here = {**machine(2, *PEAKS), "check_references": window_read(*reference_times(MEASURED))}
    result = run_check(slow, one_thread_run(machine(1, *PEAKS)), machine_here=here)
    window = result["window"]
    assert window["read"] and window["corrected"] == ["decode", "prefill"] and window["readings"] == 5
    for kind in ("decode", "prefill"):
        assert window[kind]["ratio"] == pytest.approx(1.5) and window[kind]["applied"] == pytest.approx(1 / 1.5)
    for row in result["rows"]:
        assert row["error"] == pytest.approx(0.0, abs=1e-9)
        assert row["error_as_run"] > carry_check.GOAL
    assert result["summary"]["within_goal"] == 4 and result["summary_as_run"]["within_goal"] == 0
    assert all(call["error"] == pytest.approx(0.0, abs=1e-9) for call in result["calls"])


def test_a_window_ratio_within_its_noise_leaves_the_model_as_measured():
    # the model's decode 3% over the window's reading, whose readings spread 10%: within two standard
    # errors, not applied; its prefill 40% over, readings tight: applied
    decode_s, prefill_s = reference_times(MEASURED)
    here = {**machine(2, *PEAKS), "check_references": window_read(decode_s / 1.03, prefill_s / 1.4)}
    here["check_references"]["by_kind"]["decode"]["log_sigma"] = 0.1
    window = carry_check.window_correction(here, one_thread_run(machine(1, *PEAKS)), MEASURED)
    assert window["decode"]["applied"] == 1.0 and window["decode"]["ratio"] == pytest.approx(1.03)
    assert window["decode"]["standard_error"] == pytest.approx(carry_check.MEDIAN_EFFICIENCY * 0.1 / 5 ** 0.5)
    assert window["prefill"]["applied"] == pytest.approx(1 / 1.4) and window["corrected"] == ["prefill"]


@pytest.mark.parametrize("changed", [{"threads": 2}, {"reference_prefill": 256}, {"reference_decode": [8, 256]},
                                     {"warmup": 1}, {"repeats": 2}])
def test_window_readings_of_another_shape_threads_or_estimator_are_not_compared(changed):
    here = {**machine(2, *PEAKS), "check_references": window_read(0.01, 0.01, **changed)}
    window = carry_check.window_correction(here, one_thread_run(machine(1, *PEAKS)), MEASURED)
    assert not window["read"] and window["corrected"] == [] and window["readings"] == 0
    assert window["decode"]["applied"] == window["prefill"]["applied"] == 1.0


def test_a_profile_without_window_readings_leaves_the_1_thread_model_as_measured():
    result = run_check(MEASURED.slowed(1.5, 1.5), machine(1, *PEAKS))
    assert not result["window"]["read"]
    assert result["summary"] == result["summary_as_run"]
    assert all(row["measured_rps"] == row["measured_as_run_rps"] for row in result["rows"])
