"""vLLM's result file and load shapes (issue 21): the flat result dict and its file name, closed-loop
--max-concurrency (checked by hand and against a separately written client loop), --request-rate inf,
--burstiness's gamma arrivals, the summary line, the profiled-range warning, progress and the main guard."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from servingplan import costmodel
from servingplan.cli import main as cli, users, vllm_result
from servingplan.costmodel import CostModel
from servingplan.simulate import workload
from servingplan.simulate import simulate
from servingplan.simulate.closed_loop import simulate_closed_loop
from servingplan.simulate.workload import Trace
from test_cli_vllm import refused

ROOT = Path(__file__).resolve().parent.parent
SMALL = ["--num-prompts", "60", "--request-rate", "20", "--sweep-batch", "32", "--seeds", "1"]
DATE = "20260102-030405"
COUNTS = ("completed", "failed", "total_input_tokens", "total_output_tokens", "num_prompts", "max_concurrent_requests")
LISTS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "latencies", "queue_times", "errors")


def saved(tmp_path) -> list[tuple[str, dict]]:
    return [(path.name, json.loads(path.read_text())) for path in sorted(tmp_path.glob("*.json"))]


# --- the result file -------------------------------------------------------------------------------------

def test_the_result_file_is_vllms_flat_dict_with_integer_counts_and_top_level_lists(tmp_path, capsys):
    assert cli.main([*SMALL, "--save-result", "--save-detailed", "--result-dir", str(tmp_path), "--result-date", DATE,
                     "--goodput", "ttft:2000", "--metric-percentiles", "50,99.9",
                     "--metadata", "version=1.2", "machine=laptop"]) == 0
    capsys.readouterr()
    [(name, result)] = saved(tmp_path)
    assert name == f"servingplan-sim-continuous_chunked-cap32-seed0-20.0qps-exercise2-{DATE}.json"
    assert isinstance(result, dict) and "results" not in result
    assert result["date"] == DATE and result["backend"] == "servingplan-sim" and result["model_id"] == "exercise2"
    assert result["request_rate"] == 20.0 and result["burstiness"] == 1.0 and result["max_concurrency"] is None
    assert result["version"] == "1.2" and result["machine"] == "laptop"
    for key in COUNTS:
        assert type(result[key]) is int, key
    assert result["completed"] == 60 and result["failed"] == 0 and result["num_prompts"] == 60
    for key in LISTS:
        assert isinstance(result[key], list) and len(result[key]) == 60, key
    assert all(len(gaps) == n - 1 for gaps, n in zip(result["itls"], result["output_lens"]))
    assert sum(result["output_lens"]) == result["total_output_tokens"]
    assert sum(result["input_lens"]) == result["total_input_tokens"]
    assert result["errors"] == [""] * 60
    for key in vllm_result.THROUGHPUT_KEYS:
        assert isinstance(result[key], float) and result[key] > 0, key
    assert result["request_throughput"] == pytest.approx(60 / result["duration"])
    # vLLM's default metrics, and the percentiles spelled as vLLM spells them
    for metric in ("ttft", "tpot", "itl"):
        assert {f"mean_{metric}_ms", f"median_{metric}_ms", f"std_{metric}_ms", f"p50_{metric}_ms",
                f"p99.9_{metric}_ms"} <= set(result)
    assert "mean_e2el_ms" not in result
    assert result["median_ttft_ms"] == pytest.approx(result["p50_ttft_ms"])
    assert result["mean_ttft_ms"] == pytest.approx(np.mean(result["ttfts"]) * 1e3)
    assert result["p99.9_itl_ms"] == pytest.approx(np.percentile(np.concatenate(result["itls"]), 99.9) * 1e3)


def test_without_save_detailed_the_lists_are_left_out_as_vllm_does(tmp_path, capsys):
    assert cli.main([*SMALL, "--save-result", "--result-dir", str(tmp_path), "--result-date", DATE,
                     "--percentile-metrics", "e2el"]) == 0
    capsys.readouterr()
    [(_, result)] = saved(tmp_path)
    assert not set(LISTS) & set(result)
    assert "p99_e2el_ms" in result and "p99_ttft_ms" not in result
    assert result["request_goodput"] is None  # no goodput bound given, as vLLM


def test_a_run_that_does_not_keep_up_nulls_every_throughput(tmp_path, capsys):
    assert cli.main(["--num-prompts", "150", "--request-rate", "20", "--sweep-batch", "1", "--seeds", "1",
                     "--save-result", "--result-dir", str(tmp_path), "--goodput", "ttft:2000"]) == 0
    capsys.readouterr()
    [(_, result)] = saved(tmp_path)
    assert result["stable"] is False
    for key in vllm_result.THROUGHPUT_KEYS:
        assert result[key] is None, key
    assert all(result[k] is None for k in result if k.endswith("_ms"))
    assert type(result["completed"]) is int
    [row] = json.loads(_stdout_json(capsys, "--num-prompts", "150", "--request-rate", "20", "--sweep-batch", "1",
                                    "--seeds", "1"))
    assert row["throughput_tok_s"] is None
    for key in ("output_throughput", "request_throughput", "total_token_throughput", "request_goodput"):
        assert row[key] is None, key


def _stdout_json(capsys, *argv) -> str:
    assert cli.main([*argv, "--json"]) == 0
    return capsys.readouterr().out


def test_append_result_adds_one_json_line_per_run(tmp_path, capsys):
    argv = [*SMALL, "--seeds", "2", "--result-dir", str(tmp_path), "--result-filename", "all.json", "--append-result"]
    assert cli.main(argv) == 0
    assert cli.main(argv) == 0
    capsys.readouterr()
    results = vllm_result.read_results(tmp_path / "all.json")
    assert [r["seed"] for r in results] == [0, 1, 0, 1]
    assert not (tmp_path / "all.json").read_text().endswith("\n")  # vLLM writes no final newline


def test_concurrency_and_an_infinite_rate_name_the_file_as_vllm_does(tmp_path, capsys):
    assert cli.main(["--num-prompts", "40", "--request-rate", "inf", "--max-concurrency", "4", "--sweep-batch", "8",
                     "--seeds", "1", "--save-result", "--result-dir", str(tmp_path), "--result-date", DATE,
                     "--label", "mine", "--percentile-metrics", "ttft,client_queue_time"]) == 0
    capsys.readouterr()
    [(name, result)] = saved(tmp_path)
    assert name == f"mine-continuous_chunked-cap8-seed0-infqps-concurrency4-exercise2-{DATE}.json"
    assert result["request_rate"] == "inf" and result["max_concurrency"] == 4
    assert result["max_concurrent_requests"] == 4 and result["stable"] is True
    assert result["p99_client_queue_time_ms"] > 0


@pytest.mark.parametrize("argv, names", [
    (["--request-rate", "-1"], ["--request-rate", "'-1'"]),
    (["--burstiness", "0"], ["--burstiness", "'0'"]),
    (["--burstiness", "1e-9"], ["--burstiness", ">= 0.001"]),
    (["--burstiness", "nan"], ["--burstiness", "'nan'"]),
    (["--max-concurrency", "0"], ["--max-concurrency", "'0'"]),
    (["--max-concurrency", "2.5"], ["--max-concurrency", "'2.5'"]),
    (["--percentile-metrics", "ttft,goodput"], ["--percentile-metrics", "'goodput'"]),
    (["--percentile-metrics", "ttft"], ["--percentile-metrics", "--save-result"]),
    (["--save-result", "--percentile-metrics", "client_queue_time"], ["client_queue_time", "--max-concurrency"]),
    (["--metadata", "novalue"], ["--metadata", "KEY=VALUE"]),
    (["--save-result", "--metadata", "completed=3"], ["--metadata completed", "result key"]),
    (["--save-result", "--metadata", "a=1", "a=2"], ["--metadata", "each key once"]),
    (["--metadata", "a=1"], ["--metadata", "--save-result"]),
    (["--result-date", "2026-01-01"], ["--result-date", "YYYYMMDD-HHMMSS"]),
    (["--result-date", "20261301-000000"], ["--result-date", "calendar"]),
    (["--result-filename", "a/b.json"], ["--result-filename", "without '/'"]),
    (["--save-result", "--seeds", "2", "--result-filename", "one.json"], ["--result-filename", "--append-result"]),
    (["--save-result", "--result-dir", "/dev/null"], ["--result-dir", "directory"]),
    (["--max-context", "100"], ["--max-context", "--trace"]),
    (["--burstiness", "2", "--workload", "/dev/null"], ["--burstiness"]),
])
def test_bad_load_and_result_options_give_one_line(capsys, argv, names):
    err = refused(capsys, *argv)
    for name in names:
        assert name in err


# --- closed loop -----------------------------------------------------------------------------------------

# 1 s per decode step whatever the batch, 0.1 s per prompt token: a 10-token prompt prefills in 1 s
HAND = CostModel(decode_fixed_s=1.0, decode_per_seq_s=0.0, decode_per_ctx_token_s=0.0, prefill_fixed_s=0.0,
                 prefill_per_token_s=0.1, name="hand")


@pytest.mark.parametrize("arrivals, slots, sends, firsts, ends", [
    # one user: each request waits for the one before (prefill 1 s, then one decode step of 1 s)
    ([0, 0, 0], 1, [0, 2, 4], [1, 3, 5], [2, 4, 6]),
    # two users: two prompts prefill in one step (2 s), decode together (3 s); the third goes in at 3
    ([0, 0, 0], 2, [0, 0, 3], [2, 2, 4], [3, 3, 5]),
    # a request that arrives after a slot freed is sent at its arrival
    ([0, 0.5, 5], 1, [0, 2, 5], [1, 3, 6], [2, 4, 7]),
])
def test_closed_loop_matches_a_hand_worked_timeline(arrivals, slots, sends, firsts, ends):
    trace = Trace(np.array(arrivals, dtype=float), np.full(3, 10), np.full(3, 2))
    result = simulate_closed_loop(trace, HAND, "continuous", 8, slots)
    np.testing.assert_allclose(result.arrival_s, sends)
    np.testing.assert_allclose(result.first_token_s, firsts)
    np.testing.assert_allclose(result.completion_s, ends)
    np.testing.assert_allclose(result.meta["client_queue_s"], np.array(sends) - np.array(arrivals))
    assert result.stable and not result.truncated


def reference_closed_loop(trace: Trace, cost, policy: str, cap: int, slots: int):
    """A separate closed-loop client: guess every send time, serve the requests open-loop at those times,
    send request i when the (i - slots + 1)-th of the requests before it has finished, and repeat until
    the send times stop changing (each round fixes at least one more request, in order)."""
    arrivals = np.asarray(trace.arrival_s, dtype=float)
    sends = arrivals.copy()
    for _ in range(len(arrivals) + 1):
        result = simulate(Trace(sends, trace.prompt_tokens, trace.output_tokens), cost, policy, cap,
                          horizon_factor=1e6)
        done = result.completion_s
        again = np.array([max(arrivals[i], np.sort(done[:i])[i - slots] if i >= slots else -math.inf)
                          for i in range(len(arrivals))])
        if np.allclose(again, sends, rtol=0, atol=1e-9):
            return result
        sends = again
    raise AssertionError("the reference client did not settle")


@pytest.mark.parametrize("policy, cap, slots, rate", [
    ("continuous_chunked", 16, 4, 20.0), ("continuous_chunked", 8, 12, 20.0), ("continuous", 32, 8, 5.0),
    ("static", 8, 6, 10.0), ("continuous_chunked", 64, 16, math.inf),
])
def test_closed_loop_matches_a_separately_written_client_loop(policy, cap, slots, rate):
    trace = workload.generate({**workload.EXERCISE2, "num_requests": 80, "rate": rate}, 3)
    ours = simulate_closed_loop(trace, costmodel.EXERCISE2, policy, cap, slots)
    theirs = reference_closed_loop(trace, costmodel.EXERCISE2, policy, cap, slots)
    np.testing.assert_allclose(ours.arrival_s, theirs.arrival_s, rtol=1e-9)
    np.testing.assert_allclose(ours.first_token_s, theirs.first_token_s, rtol=1e-9)
    np.testing.assert_allclose(ours.completion_s, theirs.completion_s, rtol=1e-9)
    in_flight = [np.sum((ours.arrival_s <= t) & (ours.completion_s > t)) for t in ours.arrival_s]
    assert max(in_flight) <= slots


def test_without_a_limit_the_closed_loop_is_the_open_loop():
    trace = workload.generate({**workload.EXERCISE2, "num_requests": 150}, 1)
    ours = simulate_closed_loop(trace, costmodel.EXERCISE2, "continuous_chunked", 32, None)
    theirs = simulate(trace, costmodel.EXERCISE2, "continuous_chunked", 32)
    np.testing.assert_array_equal(ours.completion_s, theirs.completion_s)
    np.testing.assert_array_equal(ours.first_token_s, theirs.first_token_s)


# --- arrivals --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_arrivals_have_vllms_mean_and_coefficient_of_variation(burstiness):
    rate, n = 8.0, 400_000
    arrivals = workload.vllm_arrivals(n, rate, burstiness, np.random.default_rng(11))
    gaps = np.diff(np.concatenate([[0.0], arrivals]))
    assert np.all(gaps >= 0) and arrivals[-1] == pytest.approx(n / rate)
    assert gaps.mean() == pytest.approx(1 / rate, rel=1e-9)
    assert gaps.std() / gaps.mean() == pytest.approx(1 / math.sqrt(burstiness), rel=0.02)
    # drawn as vLLM draws them: gamma(shape=burstiness, scale=1/(rate*burstiness)), summed, rescaled to n/rate
    drawn = np.cumsum(np.random.default_rng(11).gamma(burstiness, 1 / (rate * burstiness), n))
    np.testing.assert_allclose(arrivals, drawn * (n / rate) / drawn[-1])


def test_an_infinite_rate_sends_everything_at_zero_and_an_infinite_burstiness_evenly():
    assert not workload.vllm_arrivals(5, math.inf, 0.5, np.random.default_rng(0)).any()
    np.testing.assert_allclose(workload.vllm_arrivals(4, 2.0, math.inf, np.random.default_rng(0)), [0.5, 1, 1.5, 2])
    spec = {**workload.EXERCISE2, "num_requests": 30}
    # without a burstiness the preset's own Poisson draw, as before
    np.testing.assert_array_equal(workload.generate(spec, 0).arrival_s,
                                  workload.poisson_arrivals(30, spec["rate"], np.random.default_rng(0)))
    np.testing.assert_array_equal(workload.generate({**spec, "rate": math.inf}, 0).arrival_s, np.zeros(30))


def test_burstiness_changes_the_preset_draw_through_the_cli(capsys):
    [poisson] = json.loads(_stdout_json(capsys, *SMALL))
    [bursty] = json.loads(_stdout_json(capsys, *SMALL, "--burstiness", "0.2"))
    [even] = json.loads(_stdout_json(capsys, *SMALL, "--burstiness", "inf"))
    assert bursty["ttft_ms_p99"] > even["ttft_ms_p99"]
    assert poisson != bursty


# --- messages --------------------------------------------------------------------------------------------

def test_the_summary_line_names_every_bound_given(capsys):
    assert cli.main([*SMALL, "--goodput", "ttft:2000", "tpot:12", "e2el:1000", "--slo-itl-ms", "50"]) == 0
    [line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("SLO:")]
    for bound in ("TTFT p95 <= 2000 ms", "TPOT p95 <= 12 ms", "E2EL p95 <= 1000 ms", "ITL p99 <= 50 ms"):
        assert bound in line


def _profiled_cost_model(tmp_path, prompts=(1, 128), contexts=(1, 256)) -> Path:
    doc = costmodel.EXERCISE2.to_dict()
    doc["meta"] = {"profiled_range": {"prompt_tokens": list(prompts), "context_tokens": list(contexts)}}
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(doc))
    return path


def test_a_trace_beyond_the_profiled_range_gets_its_warning(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,100,20\n1,900,20\n2,120,200\n3,50,10\n")
    cost = _profiled_cost_model(tmp_path)
    assert cli.main(["--trace", str(trace), "--cost-model", str(cost), "--sweep-batch", "4"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"warning: 2 of 4 simulated requests lie outside the profiled range .*prompt 1\.\.128 tokens, "
                     r"context up to 256 tokens", err)
    inside = tmp_path / "inside.csv"
    inside.write_text("arrival_s,prompt_tokens,output_tokens\n0,100,20\n1,50,10\n")
    assert cli.main(["--trace", str(inside), "--cost-model", str(cost), "--sweep-batch", "4"]) == 0
    assert "warning" not in capsys.readouterr().err


def test_a_malformed_profiled_range_is_refused(tmp_path, capsys):
    cost = _profiled_cost_model(tmp_path, prompts=(128, 1))
    assert "meta.profiled_range.prompt_tokens" in refused(capsys, *SMALL, "--cost-model", str(cost))


def test_max_context_skips_or_clips_a_traces_long_requests(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,100,20\n1,900,20\n2,120,30\n")
    err = refused(capsys, "--trace", str(trace), "--max-context", "512")  # refused by default
    assert "1 of 3 requests need more than 512 tokens" in err and "give --too-long skip or clip" in err
    assert cli.main(["--trace", str(trace), "--max-context", "512", "--too-long", "skip", "--sweep-batch", "4"]) == 0
    assert "2 requests simulated, 1 longer than --max-context skipped" in capsys.readouterr().out
    [row] = json.loads(_stdout_json(capsys, "--trace", str(trace), "--max-context", "512", "--too-long", "clip",
                                    "--sweep-batch", "4"))
    assert row["completed"] == 3


def test_progress_goes_to_a_terminal_only(capsys, monkeypatch):
    monkeypatch.setattr(cli, "PROGRESS_AFTER_S", 0.0)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert cli.main([*SMALL, "--seeds", "2"]) == 0
    assert "serving_sim: 2/2 runs simulated" in capsys.readouterr().err
    assert cli.main([*SMALL, "--seeds", "2", "--json"]) == 0
    assert "runs simulated" not in capsys.readouterr().err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert cli.main([*SMALL, "--seeds", "2"]) == 0
    assert "runs simulated" not in capsys.readouterr().err


def test_the_module_runs_as_a_program_and_refuses_an_unknown_flag():
    done = subprocess.run([sys.executable, "-m", "servingplan.cli", "--bogus"], cwd=ROOT, capture_output=True,
                          text=True)
    assert done.returncode == 2 and "unrecognized arguments: --bogus" in done.stderr


# --- capacity in users -----------------------------------------------------------------------------------

@pytest.mark.parametrize("threshold, users_max, lower, upper", [(7, 20, 7, 8), (0, 20, 0, 1), (25, 20, 20, None),
                                                                (1, 2, 1, 2), (20, 20, 20, None)])
def test_bisect_users_finds_the_last_count_that_holds(threshold, users_max, lower, upper):
    found = users.bisect_users(lambda n: n <= threshold, users_max)
    assert (found["lower"], found["upper"]) == (lower, upper)


def test_capacity_in_users_is_the_largest_count_a_linear_scan_finds():
    from servingplan.simulate.capacity import Criterion
    from servingplan.simulate.metrics import SLO
    criterion = Criterion(SLO(ttft_ms=400.0, tpot_ms=9.0))
    traces = [workload.generate({**workload.EXERCISE2, "num_requests": 60}, seed) for seed in (0, 1)]
    found = users.capacity_users(traces, [0, 1], costmodel.EXERCISE2, "continuous_chunked", 32, 512, criterion, 24)
    for trace, seed in zip(traces, found["per_seed"]):
        held = [n for n in range(1, 25) if users.holds_for_users(trace, n, costmodel.EXERCISE2, "continuous_chunked",
                                                                 32, 512, criterion)]
        assert held == list(range(1, len(held) + 1))  # the criterion is monotone here, as the bisection assumes
        assert seed["lower"] == len(held)
    assert found["capacity_users"] == min(s["lower"] for s in found["per_seed"])
    assert 0 < found["capacity_users"] < 24


def test_the_cli_reports_capacity_in_users(capsys):
    argv = ["--num-prompts", "60", "--sweep-batch", "32", "--seeds", "2", "--slo-ttft-ms", "400", "--slo-tpot-ms", "9",
            "--capacity-users", "24"]
    [row] = json.loads(_stdout_json(capsys, *argv))
    assert 0 < row["capacity_users"] < 24
    assert cli.main(argv) == 0
    assert (f"Most concurrent users holding the SLO in every seed: continuous_chunked cap 32 -> {row['capacity_users']} "
            "users") in capsys.readouterr().out
    assert "needs an SLO bound" in refused(capsys, *SMALL, "--capacity-users", "8")


# --- the pipeline's keys ---------------------------------------------------------------------------------

def test_simulate_load_is_the_open_loop_without_a_limit_and_the_closed_loop_with_one():
    from servingplan.simulate.closed_loop import simulate_load
    trace = workload.generate({**workload.EXERCISE2, "num_requests": 60}, 2)
    args = (trace, costmodel.EXERCISE2, "continuous_chunked", 16, 512, None, 16, 20.0)
    np.testing.assert_array_equal(simulate_load(*args).completion_s,
                                  simulate(trace, costmodel.EXERCISE2, "continuous_chunked", 16).completion_s)
    np.testing.assert_array_equal(simulate_load(*args, 4).completion_s,
                                  simulate_closed_loop(trace, costmodel.EXERCISE2, "continuous_chunked", 16, 4)
                                  .completion_s)


@pytest.mark.parametrize("key, value, ok", [("max_concurrency", 8, True), ("max_concurrency", 0, False),
                                            ("max_concurrency", 2.5, False), ("burstiness", 0.5, True),
                                            ("burstiness", 0, False), ("burstiness", 1e9, False)])
def test_the_config_checks_the_load_shape_keys(tmp_path, key, value, ok):
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text(f"workload:\n  {key}: {value}\n")
    done = subprocess.run([sys.executable, "-m", "servingplan.config", str(overlay)], cwd=ROOT, capture_output=True,
                          text=True)
    if ok:
        assert done.returncode == 0 and "config ok" in done.stdout, done.stderr
    else:
        assert done.returncode == 2 and f"workload.{key}" in done.stderr and len(done.stderr.splitlines()) == 1


def test_the_config_check_merges_an_overlay_onto_config_yaml_as_snakemake_does():
    from servingplan import config
    merged = config.overlaid([ROOT / "config" / "quick.yaml"])
    base, quick = config.read(ROOT / "config.yaml"), config.read(ROOT / "config" / "quick.yaml")
    for section, values in quick.items():
        if isinstance(values, dict):
            for key, value in values.items():
                assert merged[section][key] == value
            assert set(base.get(section, {})) <= set(merged[section])


def test_the_sweep_runs_closed_loop_under_workload_max_concurrency():
    from servingplan.plan import planner
    from servingplan.plan.hardware import HERE, memory_for
    from test_planner import MACHINE, small_config
    config = small_config()

    def sweep(**load):
        workload_cfg = {**config["workload"], **load}
        return planner.sweep_cell(costmodel.EXERCISE2, MACHINE, "continuous_chunked", 4, workload_cfg, config["slo"],
                                  config["sweep"], memory_for(config, HERE), [0])
    open_loop = sweep()
    # as many slots as requests: every request is sent at its arrival, the open loop
    assert sweep(max_concurrency=int(config["workload"]["num_requests"])).equals(open_loop)
    closed = sweep(max_concurrency=1)
    assert not closed.equals(open_loop)
    assert (closed["peak_running"] <= 1).all()
