"""The validation stage's measurements: the speed probe, the path check, agreement and step tables."""
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from servingplan.costmodel import CostModel
from servingplan.engine import Engine
from servingplan.engine.replay import bootstrap_interval
from servingplan.profile.measure import QUICK_PROFILE
from servingplan.profile.measure import GridPoint
from servingplan.profile.model import QUICK_CONFIG_OVERRIDES, load_model
from servingplan.simulate.metrics import per_request
from servingplan.simulate.workload import Trace
from servingplan.validate.replay_file import result_from_json, result_to_json
from servingplan.validate.validation import (agreement, corrected_cost, corrected_times, corrections, findings,
                                             headline, steps_by_batch)
from servingplan.validate.validation_replay import (Budget, PathCheck, ShapeRetimer, SpeedProbe, TorchRetimer,
                                                    expected_max, service_rate_rps, validation_traces)


@pytest.fixture(scope="module")
def model():
    return load_model("random", 0, QUICK_CONFIG_OVERRIDES)[0]


def profile_meta(decode_s=0.002, prefill_s=0.004):
    return {"settings": dict(QUICK_PROFILE),
            "speed": {"by_kind": {"decode": {"median_s": decode_s}, "prefill": {"median_s": prefill_s}}},
            "roofline": {"bandwidth_gbs": 20.0, "gemm_gflops": 100.0, "probe_bytes": 2**20, "gemm_size": 64}}


def test_speed_probe_compares_the_references_with_the_profile_median(model):
    probe = SpeedProbe(model, profile_meta(), seed=0)
    ratios = probe.measure("now")
    assert set(ratios) == {"decode", "prefill"}
    for row in probe.rows:
        assert row["ratio"] == pytest.approx(row["seconds"] / row["profiled_s"]) and row["label"] == "now"
    assert probe.probes[0]["gemm_over_profile"] == pytest.approx(probe.probes[0]["gemm_gflops"] / 100.0)


def test_path_check_times_engine_steps_and_profile_points_of_each_shape(model):
    meta = profile_meta()
    checker = PathCheck(model, meta, tiny_points(meta["settings"]), seed=0, shapes=((1, 16), (3, 16)), steps=4,
                        rounds=2)
    # rounds are taken round by round, each shape once per round
    assert checker.pending == [(1, 16), (3, 16), (1, 16), (3, 16)]
    assert checker.expected_s() > 0
    checker.run_units(1e-9)
    assert len(checker.pending) == 4 and checker.result()["shapes"] == []
    checker.run_units(600.0)
    checked = checker.result()
    assert [(row["batch"], row["context"]) for row in checked["shapes"]] == [(1, 16), (3, 16)]
    for row in checked["shapes"]:
        assert len(row["engine_rounds_s"]) == len(row["profile_rounds_s"]) == 2
        assert row["engine_over_profile"] == pytest.approx(row["engine_step_s"] / row["profile_point_s"])
    assert checked["median_ratio"] > 0 and checked["units_left_out"] == 0
    # without profiled times to plan by, no unit is expected to fit anywhere, so none runs
    blind = PathCheck(model, meta, tiny_points(meta["settings"]).iloc[:0], seed=0, shapes=((1, 16),), rounds=1)
    blind.run_units(600.0)
    assert blind.pending == [(1, 16)] and blind.result()["shapes"] == [] and blind.result()["median_ratio"] is None


def test_a_budget_counts_down_from_its_start():
    budget = Budget(100.0)
    assert 99.0 < budget.remaining() <= 100.0 and 0.0 <= budget.used() < 1.0
    assert Budget(0.0).remaining() <= 0


def test_bootstrap_interval_brackets_the_statistic_and_narrows_with_more_requests():
    rng = np.random.default_rng(0)
    few, many = rng.exponential(size=40), rng.exponential(size=4000)
    lo, hi = bootstrap_interval(few, "p90")
    assert lo < np.percentile(few, 90) < hi
    lo_many, hi_many = bootstrap_interval(many, "p90")
    assert hi_many - lo_many < hi - lo
    assert bootstrap_interval(few, "mean") == bootstrap_interval(few, "mean")


def test_bootstrap_interval_is_scipys_bca_and_a_constant_has_no_spread():
    from scipy import stats
    values = np.random.default_rng(1).lognormal(size=40)
    found = stats.bootstrap((values,), lambda x, axis: np.percentile(x, 90, axis=axis), vectorized=True,
                            n_resamples=2000, confidence_level=0.9, method="BCa",
                            rng=np.random.default_rng(0)).confidence_interval
    assert bootstrap_interval(values, "p90") == (found.low, found.high)
    assert bootstrap_interval(np.full(10, 3.0), "p99") == (3.0, 3.0)
    assert bootstrap_interval(np.array([5.0]), "mean") == (5.0, 5.0)


def comparison_rows(model_name, diff, inside):
    rows = []
    for metric, stat in [("ttft", "p90"), ("tpot", "mean")]:
        for fraction, d in ((0.4, diff), (1.3, 99.0)):
            measured = 100.0
            simulated = measured * (1 + d / 100)
            lo, hi = (min(measured, simulated) - 1, max(measured, simulated) + 1) if inside else (99.0, 101.0)
            rows.append({"metric": metric, "stat": stat, "diff_pct": d, "load_fraction": fraction,
                         "cost_model": model_name, "measured_ms": measured, "simulated_ms": simulated,
                         "measured_lo_ms": lo, "measured_hi_ms": hi})
    return rows


def test_agreement_is_inside_the_interval_or_within_the_goal():
    rows = pd.DataFrame(comparison_rows("as_fitted", -20.0, inside=True) + comparison_rows("x", -20.0, inside=False)
                        + comparison_rows("y", -8.0, inside=False))
    judged = rows[rows.load_fraction < 1]
    assert list(agreement(judged, 10.0)) == [True, True, False, False, True, True]


def test_headline_judges_loads_up_to_085_and_the_step_table():
    comparison = pd.DataFrame(comparison_rows("as_fitted", -20.0, inside=False)
                              + comparison_rows("drift_corrected", -4.0, inside=False))
    steps = pd.DataFrame({"batch": [1] * 25 + [2] * 5, "n_prefill_calls": 0, "duration_s": 0.1,
                          "predicted_s": 0.09, "corrected_s": 0.1, "error_pct": -10.0, "corrected_error_pct": 0.0})
    steps.loc[25:, "corrected_error_pct"] = 50.0
    by_batch = steps_by_batch(steps)
    assert list(by_batch.batch) == [1, 2] and list(by_batch.judged) == [True, False]
    out = headline(comparison, by_batch, {"goal_pct": 10})
    assert not out["as_fitted"]["met"] and out["as_fitted"]["worst_abs_ttft_p90_diff_pct"] == 20.0
    assert out["drift_corrected"]["met"] and out["drift_corrected"]["judged"] == 2
    assert out["met"] and out["steps"]["met"] and out["steps"]["judged_batches"] == [1]


def test_validation_replays_only_the_first_requests_of_a_trace_file(tmp_path):
    # 500 requests: replayed whole in real time, the stage would serve for minutes at these rates
    path = tmp_path / "log.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens\n"
                    + "".join(f"{i * 0.25},{16 + i},{8 + i % 5}\n" for i in range(500)))
    workload = {"num_requests": 120, "rate": 6.0, "trace": {"path": str(path)}}
    validation = {"rates_fraction": [0.5, 2.0], "trace_seconds": 5, "min_requests": 6}
    traces = list(validation_traces(workload, validation, reference_rps=2.0, seed=0))
    # 0.5 x 2 req/s for 5 s is 5 requests, raised to min_requests; 2 x 2 req/s for 5 s is 20
    assert [(fraction, rate, len(trace)) for fraction, rate, trace in traces] == [(0.5, 1.0, 6), (2.0, 4.0, 20)]
    for (_, rate, trace), n in zip(traces, (6, 20)):
        assert trace.prompt_tokens.tolist() == list(range(16, 16 + n))
        assert trace.mean_rate_rps == pytest.approx(rate)


def test_expected_max_is_the_mean_largest_of_k_draws():
    values = np.array([1.0, 2.0, 4.0])
    draws = [max(a, b) for a in values for b in values]
    assert expected_max(values, 2) == pytest.approx(np.mean(draws))
    assert expected_max(values, 1) == pytest.approx(values.mean())


def test_service_rate_is_the_cost_models_throughput_at_the_cap():
    cost = CostModel(decode_fixed_s=0.01, decode_per_seq_s=0.0, decode_per_ctx_token_s=0.0, prefill_fixed_s=0.0,
                     prefill_per_token_s=0.001)
    trace = Trace(np.arange(4.0), np.array([100, 100, 100, 100]), np.array([11, 11, 11, 11]))
    # per request: 0.1 s of prefill and 11 tokens at a quarter of a 10 ms step of 4 sequences
    assert service_rate_rps(cost, [trace], 4) == pytest.approx(1 / (0.1 + 11 * 0.01 / 4))


def step_rows(batch, n, duration, ctx=64, prefill=()):
    return [{"batch": batch, "ctx_sum": batch * ctx, "ctx_max": ctx, "prefill_calls": list(prefill),
             "n_prefill_calls": len(prefill), "duration_s": duration} for _ in range(n)]


def readings(label, kind, batch, ratio, n=2):
    return [{"label": label, "kind": kind, "batch": batch, "prompt_len": 1, "cached": 64, "ratio": ratio}] * n


LINE = CostModel(decode_fixed_s=0.01, decode_per_seq_s=0.0, decode_per_ctx_token_s=0.0, prefill_fixed_s=0.0,
                 prefill_per_token_s=0.001)


def predicted(rows):
    from servingplan.engine.replay import predict_steps
    return predict_steps(pd.DataFrame(rows), LINE)


def test_a_correction_is_applied_only_where_the_engines_steps_agree_with_it():
    # batch 1: engine 20% slower than the model, points re-timed 15% slower: applied
    # batch 2: engine 20% slower, points 20% faster: contradicted; batch 4: engine 5% slower, points 30%
    # slower: it would overshoot, so not applied; batch 3: no point re-timed; prefill-only steps match
    steps = predicted(step_rows(1, 30, 0.012) + step_rows(2, 30, 0.012) + step_rows(4, 30, 0.0105)
                      + step_rows(3, 5, 0.01) + step_rows(0, 5, 0.1, prefill=[(100, 0)]))
    retimed = pd.DataFrame(readings("trace 1", "decode", 1, 1.15) + readings("trace 1", "decode", 2, 0.8)
                           + readings("trace 1", "decode", 4, 1.3) + readings("trace 2", "decode", 3, 2.0))
    applied = {(row["kind"], row["batch"]): row for row in corrections(steps, retimed, "trace 1")}
    assert applied["decode", 1]["status"] == "applied" and applied["decode", 1]["applied_factor"] == pytest.approx(1.15)
    assert applied["decode", 2]["status"] == "contradicted" and applied["decode", 2]["applied_factor"] == 1.0
    assert applied["decode", 4]["status"] == "no closer" and applied["decode", 4]["applied_factor"] == 1.0
    assert applied["decode", 3]["status"] == "no evidence"
    assert applied["prefill", 0]["status"] == "no evidence"
    corrected = corrected_times(steps, LINE, list(applied.values()))
    assert corrected[steps["batch"] == 1].iloc[0] == pytest.approx(0.0115)
    assert corrected[steps["batch"] == 2].iloc[0] == pytest.approx(0.01)
    model, decode, prefill = corrected_cost(LINE, list(applied.values()))
    # step-weighted: 30 steps at 1.15 among 95 decode steps
    assert decode == pytest.approx((30 * 1.15 + 65) / 95) and prefill == 1.0
    assert model.decode_fixed_s == pytest.approx(0.01 * decode)


def test_findings_give_each_gap_signed_with_its_direction():
    rows = []
    for fraction, ttft, tpot in ((0.45, -17.0, -16.0), (0.85, -22.0, 4.0), (1.3, 80.0, 90.0)):
        for metric, stat, diff in (("ttft", "p90", ttft), ("tpot", "mean", tpot)):
            rows.append({"metric": metric, "stat": stat, "diff_pct": diff, "load_fraction": fraction,
                         "cost_model": "as_fitted", "measured_ms": 100.0, "simulated_ms": 100 + diff,
                         "measured_lo_ms": 99.0, "measured_hi_ms": 101.0})
    comparison = pd.DataFrame(rows)
    comparison["agrees"] = agreement(comparison, 10.0)
    steps = pd.DataFrame({"batch": [1] * 25, "n_prefill_calls": 0, "duration_s": 0.1, "predicted_s": 0.08,
                          "corrected_s": 0.1, "error_pct": -20.0, "corrected_error_pct": 0.0})
    traces = [{"load_fraction": 0.45, "skipped": False, "measured_truncated": True},
              {"load_fraction": 1.3, "skipped": True}]
    out = findings(comparison, steps_by_batch(steps), traces, [], {"goal_pct": 10})
    gap = {(g["metric"], g["cost_model"]): g for g in out["requests"]}
    ttft = gap["ttft", "as_fitted"]
    assert ttft["diff_pct"] == [-17.0, -22.0] and ttft["loads"] == [0.45, 0.85]
    assert ttft["direction"] == "optimistic" and (ttft["min_abs_pct"], ttft["max_abs_pct"]) == (17.0, 22.0)
    assert gap["tpot", "as_fitted"]["direction"] == "mixed"
    # nothing simulated on the corrected model here: no figure, and said so
    assert gap["ttft", "drift_corrected"]["direction"] == "not measured"
    assert gap["ttft", "drift_corrected"]["max_abs_pct"] is None
    assert out["steps"] == [{"batch": 1, "steps": 25, "judged": True, "error_pct": -20.0, "direction": "optimistic",
                             "corrected_error_pct": 0.0, "corrected_direction": "mixed", "within_goal": True}]
    assert out["skipped_traces"] == [1.3] and out["truncated_traces"] == [0.45]


def tiny_points(settings):
    from servingplan.profile.measure import build_grid
    return pd.DataFrame([{"kind": p.kind, "batch": p.batch, "prompt_len": p.prompt_len, "cached": p.cached,
                          "median_s": 0.001} for p in build_grid(settings)])


def test_the_retimer_matches_served_shapes_and_uses_only_gaps_it_fits_in(model):
    meta = profile_meta()
    retimer = TorchRetimer(model, tiny_points(meta["settings"]), cap=2, seed=0)
    served = [{"batch": 2, "ctx_max": 60, "prefill_calls": [(30, 0), (8, 16)]}, {"batch": 3, "ctx_max": 10,
                                                                                  "prefill_calls": []}]
    matched = retimer.matches(served)
    contexts, lengths = meta["settings"]["decode_contexts"], meta["settings"]["prefill_lengths"]
    nearest_context = min(contexts, key=lambda c: abs(np.log(c / 60)))
    nearest_length = min(lengths, key=lambda n: abs(np.log(n / 30)))
    # batch 3 is beyond the cap's profiled points, and a chunk after cached entries has no fresh-prompt point
    assert matched == {GridPoint("decode", 2, 1, nearest_context): 1, GridPoint("prefill", 1, nearest_length, 0): 1}
    retimer.retime_within(retimer.unmatched(served, "trace 1"), "trace 1", 1e-6)
    assert retimer.rows == []
    retimer.retime_within(retimer.unmatched(served, "trace 1"), "trace 1", 60.0)
    assert {(row["kind"], row["batch"]) for row in retimer.rows} == {("decode", 2), ("prefill", 1)}
    for row in retimer.rows:
        assert row["label"] == "trace 1" and row["ratio"] == pytest.approx(row["seconds"] / 0.001)
    assert retimer.unmatched(served, "trace 1") == [] and retimer.uncovered_kinds(served, "trace 1") == []
    # a point re-timed once in this trace comes after the ones never re-timed
    assert len(retimer.least_timed(served, "trace 1")) == 2
    # after a trace: one point per kind of step without a reading in it
    assert retimer.uncovered_kinds(served, "trace 2") == sorted(matched, key=lambda p: (p.kind, p.batch))
    retimer.retime_within(retimer.uncovered_kinds(served, "trace 2"), "trace 2", 60.0)
    assert sum(row["label"] == "trace 2" for row in retimer.rows) == 2


class ClockRetimer(ShapeRetimer):
    """A ShapeRetimer whose readings take no time and read every point at its profiled time."""

    def time_point(self, point):
        return 0.0, self.profiled[point]


def prefill_points(lengths_s: dict) -> pd.DataFrame:
    rows = [{"kind": "prefill", "batch": 1, "prompt_len": n, "cached": 0, "median_s": s} for n, s in lengths_s.items()]
    rows.append({"kind": "decode", "batch": 1, "prompt_len": 1, "cached": 256, "median_s": 0.02})
    return pd.DataFrame(rows)


def test_a_kind_is_read_where_its_served_time_is_not_where_its_most_steps_are():
    retimer = ClockRetimer(prefill_points({32: 0.06, 320: 0.44}), cap=8)
    # six short prompts (0.36 s as profiled) and two long ones (0.88 s)
    served = [{"batch": 0, "ctx_max": 0, "prefill_calls": [(30, 0)]}] * 6 + \
             [{"batch": 0, "ctx_max": 0, "prefill_calls": [(300, 0)]}] * 2
    assert retimer.matches(served)[GridPoint("prefill", 1, 32, 0)] == 6
    assert retimer.served_s(served) == pytest.approx({GridPoint("prefill", 1, 32, 0): 0.36,
                                                      GridPoint("prefill", 1, 320, 0): 0.88})
    long_prompt = GridPoint("prefill", 1, 320, 0)
    assert retimer.uncovered_kinds(served, "run 1") == [long_prompt]
    assert retimer.unmatched(served, "run 1")[0] == long_prompt
    # a kind short of `readings` gets its point once per reading it lacks, counting readings at any length
    assert retimer.uncovered_kinds(served, "run 1", readings=2) == [long_prompt, long_prompt]
    retimer.retime(GridPoint("prefill", 1, 32, 0), "run 1")
    assert retimer.uncovered_kinds(served, "run 1", readings=2) == [long_prompt]
    assert retimer.uncovered_kinds(served, "run 1") == []
    assert retimer.least_timed(served, "run 1") == [long_prompt, GridPoint("prefill", 1, 32, 0)]


def test_the_bench_retimer_needs_a_gap_as_long_as_its_tool_runs(monkeypatch):
    from servingplan.llamacpp import profile
    from servingplan.llamacpp.validation import bench_retimer

    def bench(point, settings, gguf, binary):
        time.sleep(0.05)       # the tool's start-up and its calls
        return [0.011, 0.01, 0.012]

    monkeypatch.setattr(profile, "run_bench", bench)
    points = prefill_points({32: 0.01, 256: 0.02})
    retimer = bench_retimer(points, {"settings": {"warmup": 1, "repeats": 3}}, 8, "model.gguf")
    decode = GridPoint("decode", 1, 1, 256)
    # before a tool run has been seen, no gap holds one
    assert retimer.expected_s(GridPoint("prefill", 1, 32, 0)) == float("inf")
    retimer.retime_within([GridPoint("prefill", 1, 32, 0)], "run 1", 1e6)
    assert retimer.rows == []
    retimer.retime(GridPoint("prefill", 1, 32, 0), "run 1")
    row = retimer.rows[-1]
    assert row["seconds"] == pytest.approx(0.011) and row["ratio"] == pytest.approx(1.1)
    # the run took 0.05 s, its four calls 0.044 of them: the rest is start-up
    assert 0.0 <= retimer.startup_s < 0.05
    # a decode point's run also prefills its 256 cached tokens once, untimed (the profile's 256-token prompt)
    assert retimer.untimed_s(decode) == pytest.approx(0.02)
    assert retimer.expected_s(decode) == pytest.approx(retimer.startup_s + (0.02 * 4 + 0.02) * 1.1)
    retimer.retime_within([decode], "run 1", 0.9 * retimer.expected_s(decode))
    assert len(retimer.rows) == 1


def test_a_replay_survives_its_json_round_trip(model):
    trace = Trace(np.array([0.0, 0.01, 0.02]), np.array([5, 9, 200]), np.array([3, 4, 2]))
    run = Engine(model, "continuous", 2, threads=1).run(trace, 30.0, seed=0)
    import json
    back = result_from_json(json.loads(json.dumps(result_to_json(run.result))))
    pd.testing.assert_frame_equal(per_request(back), per_request(run.result))
    assert back.meta["errors"] == run.result.meta["errors"] and back.truncated == run.result.truncated


def test_replay_then_comparison_with_a_truncated_and_a_skipped_trace(model, capsys):
    """The two jobs end to end on the tiny model: the first trace outlasts the stage's serving time (so it
    is cut, and said so), the second is skipped (and said so); the comparison still writes every figure
    it has, and none it has not."""
    import json
    from servingplan.validate.validation import run_comparison
    from servingplan.validate.validation_replay import run_replay
    meta = {**profile_meta(), "memory": {"param_bytes": 10**6, "kv_bytes_per_token": 1000.0}}
    workload = {"num_requests": 20, "rate": 1.0, "prompt": {"dist": "uniform", "min": 8, "max": 32},
                "output": {"dist": "uniform", "min": 2, "max": 6}}
    validation = {"rates_fraction": [0.02, 2.0], "trace_seconds": 1, "min_requests": 4, "policy": "continuous",
                  "cap": 2, "max_wall_s": 1.5, "goal_pct": 10}
    sweep = {"chunk_size": 512, "horizon_factor": 20.0}
    memory = {"budget_gb": 1.0, "block_size": 16, "max_context": 64, "kv_memory": "slots"}
    replayed = json.loads(json.dumps(run_replay(model, LINE, meta, tiny_points(meta["settings"]), workload,
                                                validation, sweep, memory, seed=0, threads=1)))
    assert [t["skipped"] for t in replayed["traces"]] == [False, True]
    assert replayed["traces"][0]["result"]["truncated"]
    said = capsys.readouterr().err
    assert "trace 1 truncated" in said and "trace 2 of 2 (2 x the service rate) skipped" in said
    # every part of the stage is accounted for, and the arrivals' span is said before serving
    assert set(replayed["stage_s"]) == {"setup_s", "probes_s", "traces_s", "catch_up_s", "path_check_after_s",
                                        "total_s"}
    assert len(replayed["expected_arrival_s"]) == 2 and "the traces' arrivals span" in said
    out = run_comparison(replayed, LINE, meta, workload, validation, sweep, memory, seed=0)
    assert out["meta"]["replay_stage_s"] == replayed["stage_s"]
    assert out["meta"]["findings"]["skipped_traces"] == [2.0]
    assert out["meta"]["findings"]["truncated_traces"] == [0.02]
    assert [t["skipped"] for t in out["meta"]["traces"]] == [False, True]


def imported_package_files(module: str) -> set[str]:
    """The servingplan source files a fresh interpreter loads to import `module`."""
    import subprocess
    import sys
    code = (f"import sys, {module}; print('\\n'.join(m.__file__ for n, m in sys.modules.items() "
            f"if n.startswith('servingplan') and getattr(m, '__file__', None)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    root = Path(__file__).resolve().parents[1]
    return {str(Path(line).resolve().relative_to(root / "servingplan")) for line in out.split()}


def rule_sources(*names: str) -> set[str]:
    """The servingplan paths rules/validate.smk names in the given top-level lists or rules' blocks."""
    import re
    text = (Path(__file__).resolve().parents[1] / "rules" / "validate.smk").read_text()
    found = set()
    for name in names:
        start = text.index(name)
        end = text.find("\n\n", start)
        found |= set(re.findall(r'"([\w/]+\.py)"', text[start:end]))
    return found


def test_the_replay_job_lists_what_it_imports_and_nothing_of_the_comparison():
    replay = imported_package_files("servingplan.validate.validation_replay")
    # the comparison's modules stay out of the replay process
    assert not replay & {"validate/validation.py", "simulate/capacity.py", "simulate/metrics.py", "engine/replay.py"}
    listed = rule_sources("REPLAY_SOURCES =", "rule validate_replay:")
    # every module the replay loads is an input of its rule, but the simulator's SimResult (left out on purpose)
    # and the llama-server pricing the simulator imports (the engine serves no llamacpp policy), and the
    # validate stage's package file (a docstring, no code)
    simulator = {"__init__.py", "simulate/__init__.py", "simulate/simulator.py", "simulate/llamacpp_slots.py",
                 "validate/__init__.py"}
    assert replay - simulator <= listed
    probe = imported_package_files("servingplan.engine.memory_probe, servingplan.profile.model, "
                                   "servingplan.profile.machine, servingplan.pipeline, servingplan.io")
    assert "engine/engine.py" not in probe
    assert probe - simulator <= rule_sources("REPLAY_SOURCES =", "rule serving_memory:")
