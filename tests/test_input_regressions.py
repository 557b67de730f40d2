"""Every failure of issues 12 and 19, each a named test: an input that hung, crashed or produced
impossible numbers now works or is refused with one line naming the input, the value and what is
allowed."""
from __future__ import annotations

import copy
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from servingplan import architecture, config as config_module, costmodel, io as io_module
from servingplan.cli.main import main
from servingplan.config import ConfigError
from servingplan.report.text import markdown_text
from servingplan.simulate import metrics, workload
from servingplan.simulate import simulate
from servingplan.simulate.capacity import MAX_BISECTIONS, log_bisect

from helpers import config_refused, hang_guard

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "serving_sim.py"
BASE = yaml.safe_load((ROOT / "config.yaml").read_text())
QUICK = yaml.safe_load((ROOT / "config" / "quick.yaml").read_text())
HEADER = "arrival_s,prompt_tokens,output_tokens\n"


def refusal(config: dict) -> str:
    message = config_refused(config)
    assert message is not None, "accepted"
    return message


def with_value(path: str, value, base=BASE) -> dict:
    config = copy.deepcopy(base)
    *parents, last = path.split(".")
    node = config
    for key in parents:
        node = node[key]
    node[last] = value
    return config


def cli_error(capsys, *argv) -> str:
    """Run the CLI in-process: it must return 2 (or exit 2 from argparse) with one stderr line."""
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    assert code == 2, captured
    assert captured.out == ""
    assert len(captured.err.splitlines()) == 1, captured.err
    return captured.err


def cost_file(tmp_path, decode=None, prefill=None, **extra) -> str:
    document = {"schema_version": 1,
                "decode": {"fixed_s": 5e-3, "per_seq_s": 0.0, "per_ctx_token_s": 4.3e-8, **(decode or {})},
                "prefill": {"fixed_s": 0.0, "per_token_s": 4.7e-5, **(prefill or {})}, **extra}
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(document))
    return str(path)


def trace_file(tmp_path, body: str) -> str:
    path = tmp_path / "trace.csv"
    path.write_text(HEADER + body)
    return str(path)


# -- hangs --------------------------------------------------------------------------------------------

def test_capacity_tolerance_1e_300_is_refused():
    assert refusal(with_value("capacity.tolerance", 1e-300)) == \
        "config error: capacity.tolerance = 1e-300: must be >= 1e-09"


def test_log_bisect_stops_once_its_bounds_are_neighbouring_floats():
    calls = []

    def below(rate):
        calls.append(rate)
        return rate < 1.2345

    lo, hi = log_bisect(below, 0.05, 64.0, 1e-300)
    assert lo < 1.2345 <= hi and np.nextafter(lo, math.inf) == hi
    assert len(calls) < MAX_BISECTIONS


def test_capacity_rate_max_infinite_is_refused():
    assert refusal(with_value("capacity.rate_max", math.inf)) == \
        "config error: capacity.rate_max = inf: must be a finite number"
    with pytest.raises(ValueError, match="finite bounds"):
        log_bisect(lambda rate: True, 0.05, math.inf, 0.02)


def test_a_million_sweep_seeds_is_refused():
    assert refusal(with_value("sweep.seeds", 1_000_000)) == "config error: sweep.seeds = 1000000: must be <= 100"


@pytest.mark.parametrize("option, value", [("--num-requests", "1e12"), ("--num-requests", "1000000000000"),
                                           ("--seeds", "1e12"), ("--seeds", "1000000000000")])
def test_cli_huge_request_and_seed_counts_are_refused(capsys, option, value):
    assert option in cli_error(capsys, option, value)


def test_cli_requests_held_at_once_are_bounded(capsys):
    assert "at most 10,000,000" in cli_error(capsys, "--num-requests", "1000000", "--seeds", "20")


# -- inputs that passed and produced impossible numbers ------------------------------------------------

@pytest.mark.parametrize("path, value", [
    ("workload.rate", math.nan), ("workload.rate", math.inf), ("exercise2.rate", math.nan),
    ("workload.output.sigma", math.nan), ("slo.ttft_ms", math.inf), ("memory.budget_gb", math.nan),
])
def test_nan_and_infinity_are_refused_where_a_positive_number_is_asked(path, value):
    assert refusal(with_value(path, value)) == f"config error: {path} = {value!r}: must be a finite number"


def test_an_infinite_sweep_rate_is_refused():
    assert refusal(with_value("sweep.rates", [1.0, math.inf])) == \
        "config error: sweep.rates[1] = inf: must be a finite number"


def test_cli_cost_model_with_negative_coefficients_is_refused(tmp_path, capsys):
    err = cli_error(capsys, "--cost-model", cost_file(tmp_path, decode={"fixed_s": -0.005}))
    assert "decode.fixed_s = -0.005" in err and "[0, 3600]" in err


def test_cli_cost_model_with_a_negative_batch_table_is_refused(tmp_path, capsys):
    table = {"batch_fixed_s": {"batches": [1, 8], "fixed_s": [0.004, -0.01]}}
    err = cli_error(capsys, "--cost-model", cost_file(tmp_path, decode=table))
    assert "decode.batch_fixed_s.fixed_s[1] = -0.01" in err


def test_trace_blank_cell_is_refused_with_its_line(tmp_path):
    with pytest.raises(ValueError, match=r"line 3: prompt_tokens = \(blank\): must be an integer"):
        workload.load_trace_csv(trace_file(tmp_path, "0.0,5,6\n0.1,,10\n"))


@pytest.mark.parametrize("row, fields", [("0.1,5,10,7", 4), ("0.1,5", 2)])
def test_trace_ragged_rows_are_refused_with_their_line(tmp_path, row, fields):
    with pytest.raises(ValueError, match=f"line 2: {fields} fields, the header has 3"):
        workload.load_trace_csv(trace_file(tmp_path, row + "\n0.2,5,6\n"))


@pytest.mark.parametrize("arrival", ["inf", "nan", "-1"])
def test_trace_non_finite_or_negative_arrival_is_refused(tmp_path, arrival):
    with pytest.raises(ValueError, match=f"line 2: arrival_s = {arrival}: must be a finite time >= 0"):
        workload.load_trace_csv(trace_file(tmp_path, f"{arrival},5,6\n"))


def test_trace_fractional_token_count_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"output_tokens = 2\.5"):
        workload.load_trace_csv(trace_file(tmp_path, "0.0,5,2.5\n"))


def test_memory_budget_below_the_weights_is_refused_before_any_work():
    message = refusal(with_value("memory.budget_gb", 0.0001))
    weights = architecture.weight_count(architecture.GPT2_SMALL)
    assert message.startswith("config error: memory.budget_gb = 0.0001: must hold the weights of GPT-2 small "
                              f"({weights:,} float32 parameters")


def test_budget_check_uses_the_tiny_model_when_the_config_asks_for_it():
    tiny = {**architecture.GPT2_SMALL, **architecture.QUICK_CONFIG_OVERRIDES}
    just_enough = (architecture.weight_bytes(tiny) + 768 * architecture.kv_bytes_per_token(tiny)) / 1e9
    config_module.check(with_value("memory.budget_gb", just_enough, QUICK))
    assert "the tiny 2-layer GPT-2" in refusal(with_value("memory.budget_gb", just_enough * 0.99, QUICK))


def test_the_profile_rule_keeps_the_configs_grid_with_the_tiny_model():
    """config/quick.yaml's `profile` values take effect: the rule no longer swaps in QUICK_PROFILE."""
    rule = (ROOT / "rules" / "profile.smk").read_text()
    script = (ROOT / "scripts" / "profile.py").read_text()
    assert "quick" not in rule.split("params:")[1].split("threads:")[0]
    assert "quick=" not in script


# -- tracebacks ------------------------------------------------------------------------------------------

ZERO = {"fixed_s": 0.0, "per_seq_s": 0.0, "per_ctx_token_s": 0.0}


@pytest.mark.parametrize("extra", [[], ["--print-curve"]])
def test_all_zero_cost_model_is_refused(tmp_path, capsys, extra):
    err = cli_error(capsys, "--cost-model", cost_file(tmp_path, decode=ZERO), *extra)
    assert "a decode step would take no time" in err


def test_nan_coefficient_is_refused(tmp_path, capsys):
    path = tmp_path / "cost.json"
    path.write_text(Path(cost_file(tmp_path)).read_text().replace("4.7e-05", "NaN"))
    assert "prefill.per_token_s = nan" in cli_error(capsys, "--cost-model", str(path))


@pytest.mark.parametrize("document, kind", [("[1, 2]", "an array"), ('"x"', "a string"), ("3", "a number")])
def test_a_cost_model_that_is_not_an_object_is_refused(tmp_path, capsys, document, kind):
    path = tmp_path / "cost.json"
    path.write_text(document)
    assert f"the document is {kind}" in cli_error(capsys, "--cost-model", str(path))


def test_non_numeric_trace_cell_is_refused(tmp_path, capsys):
    err = cli_error(capsys, "--workload", trace_file(tmp_path, "0.1,abc,10\n"))
    assert "line 2: prompt_tokens = abc" in err


def test_nan_arrival_in_a_trace_is_refused(tmp_path, capsys):
    assert "arrival_s = nan" in cli_error(capsys, "--workload", trace_file(tmp_path, "0.0,5,6\nnan,5,6\n"))


def test_itl_gaps_are_summarised_in_blocks_with_identical_results(monkeypatch):
    trace = workload.generate({**workload.EXERCISE2, "num_requests": 300}, 3)
    result = simulate(trace, costmodel.EXERCISE2, "continuous_chunked", 16, 512, record_tokens=True)
    slo = metrics.SLO(ttft_ms=2000, tpot_ms=12, itl_ms=30)
    whole = metrics.summarize(result, slo)
    gaps_whole, own_whole = metrics.inter_token_gaps(result, 99)
    monkeypatch.setattr(metrics, "GAP_BLOCK_REQUESTS", 7)
    assert metrics.summarize(result, slo) == whole
    gaps, own = metrics.inter_token_gaps(result, 99)
    assert np.array_equal(gaps, gaps_whole) and np.array_equal(own, own_whole, equal_nan=True)
    expected = np.concatenate([np.diff(result.token_times(i)) for i in range(len(trace))])
    assert np.allclose(gaps, expected, rtol=1e-12, atol=0)


# -- the engine ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model():
    from servingplan.profile.model import load_model
    return load_model("random", 0, architecture.QUICK_CONFIG_OVERRIDES)[0]


def serve(model, trace):
    from servingplan.engine import Engine
    return Engine(model, "continuous", 4, threads=1).run(trace, max_wall_s=60.0)


def test_a_huge_request_is_refused_before_anything_is_allocated_and_the_others_are_served(tiny_model):
    trace = workload.Trace(np.array([0.0, 0.01, 0.02]), np.array([12, 10**11, 9]), np.array([4, 5, 3]))
    run = serve(tiny_model, trace)
    assert list(run.errors) == [1] and "n_positions" in run.errors[1]
    assert list(run.result.finished) == [True, False, True]
    assert [len(p) for p in run.prompts] == [12, 0, 9] and [len(t) for t in run.tokens] == [4, 0, 3]


def test_a_nan_arrival_is_refused_and_does_not_stall_the_loop(tiny_model):
    trace = workload.Trace(np.array([0.0, math.nan, 0.02]), np.array([12, 8, 9]), np.array([4, 5, 3]))
    run = serve(tiny_model, trace)
    assert list(run.errors) == [1] and "arrival_s=nan" in run.errors[1]
    assert not run.result.truncated
    assert list(run.result.finished) == [True, False, True]


# -- the report and the README -----------------------------------------------------------------------

INJECTION = "ok\n\n# Fake section\n[x](javascript:alert(3)) ![](http://example.com/x.png)"


def test_a_title_with_newlines_is_refused():
    assert refusal(with_value("report.title", INJECTION)).startswith(
        "config error: report.title = 'ok\\n\\n# Fake section")


def test_markdown_title_renders_as_text():
    text = markdown_text(INJECTION)
    assert "\n" not in text
    assert text == r"ok \# Fake section \[x\](javascript:alert(3)) \!\[\](http\://example.com/x.png)"
    assert markdown_text("servingplan: sizing a GPT-2 small chat service") == \
        "servingplan: sizing a GPT-2 small chat service"


def test_readme_says_how_to_recover_from_a_killed_run():
    readme = (ROOT / "README.md").read_text()
    assert "snakemake --unlock" in readme and "cannot be locked" in readme


def test_config_validation_runs_as_a_user_runs_it(tmp_path):
    """The command-line check prints one line and exits 2 for a bad file, as in the issue's probes."""
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(with_value("capacity.rate_max", math.inf)))
    proc = subprocess.run([sys.executable, "-m", "servingplan.config", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr == "config error: capacity.rate_max = inf: must be a finite number\n"


# == issue 19: the inputs added since issue 12 ===========================================================


def no_hang():
    """A case still running after a minute raises instead of blocking the suite (a FIFO would)."""
    return hang_guard(60)


def trace_config(path, **trace) -> dict:
    config = copy.deepcopy(QUICK)
    config["workload"]["trace"] = {"path": str(path), **trace}
    return config


def fifo(tmp_path, name="trace.csv") -> Path:
    path = tmp_path / name
    os.mkfifo(path)
    return path


def zero_link(tmp_path, name="trace.csv") -> Path:
    path = tmp_path / name
    path.symlink_to("/dev/zero")
    return path


def deep_json(levels: int = 100_000) -> str:
    return "[" * levels + "]" * levels


def cli_lines(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


# -- hangs ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("special", [fifo, zero_link], ids=["fifo", "link to /dev/zero"])
def test_config_check_refuses_a_special_trace_file_without_opening_it(tmp_path, special):
    path = special(tmp_path)
    with no_hang():
        message = refusal(trace_config(path))
    assert f"workload.trace.path = {str(path)!r}" in message
    assert ("FIFO" if special is fifo else "character device") in message and "must be a regular file" in message


@pytest.mark.parametrize("special", [fifo, zero_link], ids=["fifo", "link to /dev/zero"])
def test_cli_refuses_a_special_trace_or_cost_model_file(tmp_path, capsys, special):
    trace, cost = special(tmp_path, "trace.csv"), special(tmp_path, "cost.json")
    with no_hang():
        for argv in (["--trace", str(trace)], ["--workload", str(trace)], ["--cost-model", str(cost), "--print-curve"]):
            assert "must be a regular file" in cli_error(capsys, *argv)


@pytest.mark.parametrize("special", [fifo, zero_link], ids=["fifo", "link to /dev/zero"])
def test_config_check_refuses_a_special_cost_model_file(tmp_path, special):
    path = special(tmp_path, "cost.json")
    config = copy.deepcopy(QUICK)
    config["costmodel"] = {"source": str(path)}
    config["hardware"] = []
    with no_hang():
        assert "must be a regular file" in refusal(config)


def test_config_file_that_is_a_fifo_is_refused(tmp_path):
    path = fifo(tmp_path, "config.yaml")
    with no_hang(), pytest.raises(ConfigError, match="FIFO .*must be a regular file"):
        config_module.read(path)


def test_a_trace_spanning_1e300_s_is_refused(tmp_path, capsys):
    path = trace_file(tmp_path, "0,10,5\n1e300,10,5\n")
    with no_hang():
        assert "at most 1e+08 s" in cli_error(capsys, "--workload", path)
        assert "at most 1e+08 s" in cli_error(capsys, "--trace", path)
        assert "at most 1e+08 s" in refusal(trace_config(path))


def test_a_skipped_rows_timestamp_1e300_s_from_the_others_is_refused(tmp_path, capsys):
    """The generative suite's Azure file with seconds: the row at 1e300 s asks for 0 prompt tokens, so it was
    skipped before the span was checked, and the two left (0 and 1e-320 s) were accepted. A skipped row's
    timestamp is the same clock, so every row is in the span."""
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n1e+300,0,5\n0.0,10,5\n1e-320,12,6\n")
    said = (f"trace {path}: TIMESTAMP spans 1e+300 s, from 0.0 (line 3) to 1e+300 (line 2); at most 1e+08 s "
            "(about three years) allowed")
    keys = {"layout": "azure", "timestamps": "seconds"}
    with no_hang():
        assert said in refusal(trace_config(path, **keys))
        with pytest.raises(ValueError) as raised:
            workload.describe({"rate": 2.0, "trace": {"path": str(path), **keys}})
        assert str(raised.value) == said
        assert said in cli_error(capsys, "--trace", str(path), "--trace-layout", "azure", "--trace-timestamps",
                                 "seconds")


@pytest.mark.parametrize("body, layout, line, said", [
    ("100000000000000000000,10,5\n100000000000000000001,12,6\n", "servingplan", 2,
     "arrival_s = 100000000000000000000: 1e+20 s from time 0, where float64 seconds resolve only 1.6e+04 s"),
    ("9999-12-31 23:59:59,10,5\n9999-12-31 23:59:59.5,12,6\n", "azure", 3,
     "TIMESTAMP = 9999-12-31 23:59:59.5: 2.53e+11 s from 1970, where float64 seconds resolve only 3.1e-05 s")],
    ids=["seconds at 1e20", "dates in 9999"])
def test_timestamps_too_far_from_time_0_to_tell_a_microsecond_apart_are_refused(tmp_path, capsys, body, layout,
                                                                                 line, said):
    """Two rows a second apart at 1e20 s read as one instant once the first timestamp was subtracted: a
    burst made up by float64, whose spacing there is 16,384 s."""
    path = tmp_path / "trace.csv"
    path.write_text({"servingplan": HEADER, "azure": "TIMESTAMP,ContextTokens,GeneratedTokens\n"}[layout] + body)
    allowed = ("must be a time in [0, 8.59e+09) s (2^33 s)" if layout == "servingplan" else
               "must be a date from 1697-10-17 to 2242-03-16 (within 2^33 s of 1970)")
    cli = cli_error(capsys, "--trace", str(path), "--trace-layout", layout)
    for message in (refusal(trace_config(path, layout=layout)), cli):
        assert f"trace {path} line {line}: {said}" in message and message.rstrip().endswith(allowed)


def test_a_workload_csv_at_1e300_s_is_refused_where_it_replayed_with_no_time_passing(tmp_path, capsys):
    """--workload keeps a CSV's own times: two rows at 1e300 s spanned 0 s and were replayed at 1e300 s,
    where a step's milliseconds vanish (TTFT came out 0 ms)."""
    path = trace_file(tmp_path, "1e300,10,5\n1e300,12,6\n")
    assert (f"trace {path} line 2: arrival_s = 1e300: must be a finite time >= 0 and at most 1e+08 s (about three "
            "years)") in cli_error(capsys, "--workload", path)


def test_rescaling_to_a_tiny_rate_cannot_make_an_endless_trace(tmp_path, capsys):
    path = trace_file(tmp_path, "0,10,5\n1,10,5\n")
    assert "at most 1e+08 s" in cli_error(capsys, "--trace", path, "--rate", "1e-12")


def test_a_workload_rate_that_spreads_a_trace_past_1e8_s_is_refused_by_the_config(tmp_path):
    """workload.rate = 1e-320 passed the check, and the workload description divided by it: the replayed
    span and the gap scale came out inf, which the workload stage cannot write (the sweep would have
    refused the rate hours later)."""
    path = trace_file(tmp_path, "".join(f"{i / 6:.4f},{20 + i},8\n" for i in range(60)))
    config = trace_config(path)
    config["workload"]["rate"] = 1e-320
    assert refusal(config) == ("config error: workload.rate = 1e-320: 60 requests at rate 1e-320 span more seconds "
                               "than a float holds: at most 1e+08 s allowed (a rate >= 6e-07 req/s)")
    config["workload"]["rate"] = 6e-07
    assert config_refused(config) is None
    described = workload.describe(config["workload"])
    assert described["replayed_span_s"] <= workload.MAX_TRACE_SPAN_S
    json.dumps(described, allow_nan=False)


@pytest.mark.parametrize("key, value", [("workload.rate", 1e-9), ("sweep.rates", [1.0, 1e-9]),
                                        ("slo.capacity_target_rate", 1e-9), ("capacity.rate_min", 1e-9),
                                        ("exercise2.rate", 1e-9)])
def test_every_rate_the_stages_replay_a_drawn_workload_at_is_bounded_by_its_span(key, value):
    """A rate the sweep, the capacity search or exercise 2 draws or rescales the workload to, spreading its
    requests over more than 1e8 s, passed the check and failed the stage (or ran a 6e11 s simulation)."""
    message = refusal(with_value(key, value, QUICK))
    shown = f"{key}[1]" if key == "sweep.rates" else key
    assert message.startswith(f"config error: {shown} = 1e-09: ") and "at most 1e+08 s allowed" in message


def test_cli_a_preset_at_a_rate_spreading_it_past_1e8_s_is_refused(capsys):
    """--request-rate 1e-12 drew 50 requests over 5e13 s; the result's per-second token count then asked
    for 400 TiB."""
    assert cli_error(capsys, "--request-rate", "1e-12", "--num-requests", "50", "--seeds", "1", "--json") == (
        "serving_sim: error: --request-rate: 50 requests at rate 1e-12 span 5e+13 s: at most 1e+08 s allowed (a rate "
        ">= 5e-07 req/s)\n")


def test_the_peak_tokens_per_second_needs_memory_for_the_tokens_not_the_span():
    """The count was a bincount with a slot for every second of the run: 800 MB for a trace spanning
    the 1e8 s allowed, 400 TiB for one spanning 5e13 s."""
    from servingplan.cli.vllm_result import peak_output_tokens_per_s
    tokens = [np.array([0.2, 0.7, 1.5]), np.array([1e12 + 0.1, 1e12 + 0.3, 1e12 + 0.6, 1e12 + 1.2])]
    assert peak_output_tokens_per_s(np.array([0.0, 1e12]), tokens) == 3.0


# -- tracebacks -----------------------------------------------------------------------------------------

def test_save_result_checks_its_path_before_any_simulation(tmp_path, capsys, monkeypatch):
    """A path that cannot be written is refused before the first cell runs (one run spent 130 s first)."""
    import servingplan.cli.main as cli
    monkeypatch.setattr(cli, "run_cells", lambda *a, **k: pytest.fail("simulated before checking the output path"))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cases = [([str(tmp_path / "missing")], "no such directory"),
             ([str(blocker)], "not a directory"),
             ([str(tmp_path), "--seeds", "1", "--label", "x" * 200], "at most 255 allowed")]
    for dir_and_name, expected in cases:
        err = cli_error(capsys, "--save-result", "--result-dir", *dir_and_name)
        assert err.startswith("serving_sim: error: --save-result: ") and expected in err, err
    # a file name that leaves its folder is refused as the argument is read, before anything else
    for name, expected in (("../../x.json", "without '/'"), ("", "without '/'"), ("x" * 300 + ".json", "at most 255")):
        err = cli_error(capsys, "--save-result", "--result-dir", str(tmp_path), "--result-filename", name)
        assert err.startswith("serving_sim: error: argument --result-filename: ") and expected in err, err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere")
def test_save_result_into_an_unwritable_folder_is_refused_first(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    assert "not writable" in cli_error(capsys, "--save-result", "--result-dir", str(locked))


def test_a_csv_field_over_128_kib_is_refused_with_its_line(tmp_path, capsys):
    path = trace_file(tmp_path, "0,10,5\n1," + "9" * 200_000 + ",5\n")
    err = cli_error(capsys, "--workload", path)
    assert "line 3" in err and "field larger than field limit" in err
    assert "line 3" in refusal(trace_config(path))


def test_deeply_nested_json_is_refused_in_a_cost_model(tmp_path, capsys):
    path = tmp_path / "cost.json"
    path.write_text(deep_json())
    assert "nested deeper than 32 levels" in cli_error(capsys, "--cost-model", str(path))
    config = copy.deepcopy(QUICK)
    config["costmodel"], config["hardware"] = {"source": str(path)}, []
    assert "nested deeper than 32 levels" in refusal(config)


def test_deeply_nested_json_is_refused_in_a_jsonl_trace(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 2}\n' + deep_json(50_000) + "\n")
    assert "line 2: nested deeper than 32 levels" in cli_error(capsys, "--trace", str(path))
    assert "line 2: nested deeper than 32 levels" in refusal(trace_config(path))


def test_a_deeply_nested_config_is_refused():
    config = copy.deepcopy(QUICK)
    node = config["report"]
    for _ in range(5000):
        node["x"] = {}
        node = node["x"]
    assert refusal(config) == "config error: (top level): nested deeper than 32 levels"


def test_a_config_of_expanding_yaml_anchors_is_refused(tmp_path):
    text = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8))
    path = tmp_path / "laughs.yaml"
    path.write_text(text)
    with no_hang():
        assert "more than 100,000 values" in refusal(config_module.read(path))


def test_print_curve_into_a_closed_pipe_exits_quietly():
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run([sys.executable, str(SCRIPT), "--print-curve"], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, cwd=ROOT, timeout=120)
    finally:
        os.close(write_end)
    assert proc.stderr == "" and proc.returncode == 141


# -- silently wrong -------------------------------------------------------------------------------------

def test_one_timestamp_for_every_row_is_refused_by_the_config(tmp_path):
    """Every sweep rate replayed the same burst: the stable capacity came out as the search's bound."""
    path = trace_file(tmp_path, "".join(f"3.5,{10 + i},5\n" for i in range(20)))
    assert "arrive at one time" in refusal(trace_config(path))


@pytest.mark.parametrize("second", ["0", "1e-320", "5e-7"])
def test_arrivals_within_a_microsecond_are_a_burst_that_no_rate_rescales(tmp_path, capsys, second):
    path = trace_file(tmp_path, f"0,10,5\n{second},12,6\n")
    assert "all arrivals at one time" in cli_error(capsys, "--trace", path, "--request-rate", "5")
    assert "all arrivals at one time" in cli_error(capsys, "--workload", path, "--request-rate", "5")
    assert "arrive at one time" in refusal(trace_config(path))
    with pytest.raises(ValueError, match="no gaps to rescale"):
        workload.load_trace(path, rate=5.0)


def test_a_burst_replayed_at_its_own_pace_has_no_rate_but_valid_json(tmp_path, capsys):
    path = trace_file(tmp_path, "0,10,5\n1e-320,12,6\n")
    code, out, err = cli_lines(capsys, "--trace", path, "--json")
    assert code == 0 and err == ""
    rows = json.loads(out, parse_constant=lambda name: pytest.fail(f"{name} in the JSON output"))
    assert rows[0]["rate"] is None


@pytest.mark.parametrize("second", ["1e-320", "5e-7"])
def test_a_bursts_summary_has_no_request_rate_as_the_burst_has_none(tmp_path, capsys, second):
    """Found by the generative suite: the summary of a burst replayed at its own pace divided its 2 requests
    by the 1e-320 s to the last arrival, and request_rate came out inf (5e-7 s made up 4e6 req/s), where
    the trace's own rate and the CLI's row have none."""
    path = trace_file(tmp_path, f"0,10,5\n{second},12,6\n")
    code, out, _ = cli_lines(capsys, "--trace", path, "--json")
    assert code == 0 and json.loads(out)[0]["rate"] is None
    trace = workload.load_trace(path).trace
    summary = metrics.summarize(simulate(trace, costmodel.EXERCISE2, "continuous_chunked", 16, 512),
                                metrics.SLO(ttft_ms=1000))
    assert trace.mean_rate_rps is None and summary["request_rate"] is None
    json.dumps(summary, allow_nan=False)


def test_a_runs_request_rate_is_its_traces_own_rate(tmp_path):
    trace = workload.load_trace(trace_file(tmp_path, "1,10,5\n1.5,12,6\n3,9,4\n")).trace
    summary = metrics.summarize(simulate(trace, costmodel.EXERCISE2, "continuous_chunked", 16, 512))
    assert summary["request_rate"] == trace.mean_rate_rps == 1.5


def test_workload_description_of_a_burst_is_valid_json(tmp_path):
    path = trace_file(tmp_path, "0,10,5\n1e-320,12,6\n")
    described = workload.describe({"rate": 5.0, "trace": {"path": path}})
    assert described["file_rate_rps"] is None and described["gap_scale"] is None
    json.dumps(described, allow_nan=False)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_result_files_never_hold_nan_or_infinity(tmp_path, value):
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        io_module.write_json(tmp_path / "r.json", {"rows": [{"x": value}]})
    assert not (tmp_path / "r.json").exists() and list(tmp_path.iterdir()) == []


def test_a_duplicated_csv_header_is_refused(tmp_path, capsys):
    """It silently took the last column, which made every prompt 7 tokens."""
    path = tmp_path / "dup.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens,prompt_tokens\n0,100,5,7\n1,120,6,7\n")
    assert "names column 'prompt_tokens' 2 times" in cli_error(capsys, "--workload", str(path))
    assert "names column 'prompt_tokens' 2 times" in cli_error(capsys, "--trace", str(path))
    assert "names column 'prompt_tokens' 2 times" in refusal(trace_config(path))


def test_a_jsonl_record_with_a_key_twice_is_refused(tmp_path, capsys):
    path = tmp_path / "dup.jsonl"
    path.write_text('{"arrival_s": 0, "prompt_tokens": 100, "output_tokens": 5, "prompt_tokens": 7}\n')
    assert "key 'prompt_tokens' appears twice" in cli_error(capsys, "--trace", str(path))


def test_columns_mapping_two_fields_to_one_column_is_refused(tmp_path, capsys):
    path = trace_file(tmp_path, "0,10,5\n1,12,6\n")
    same = {"arrival": "arrival_s", "prompt_tokens": "prompt_tokens", "output_tokens": "prompt_tokens"}
    assert "both name column 'prompt_tokens'" in refusal(trace_config(path, columns=same))
    assert "arrival and prompt_tokens both name column 'arrival_s'" in cli_error(
        capsys, "--trace", path, "--trace-columns", "prompt_tokens=arrival_s")


@pytest.mark.parametrize("section, key, nearest", [("decode", "ctx_mod", "ctx_mode"),
                                                   ("prefill", "per_token_sq", "per_token_sq_s"),
                                                   (None, "sorce", "source")])
def test_a_misspelled_cost_model_key_names_itself_and_the_nearest(tmp_path, capsys, section, key, nearest):
    extra = {section: {key: 1e-9}} if section else {key: "x"}
    path = cost_file(tmp_path, decode=extra.get("decode"), prefill=extra.get("prefill"),
                     **({key: "x"} if section is None else {}))
    where = f"{section}." if section else ""
    err = cli_error(capsys, "--cost-model", path)
    assert f"cost model {where}{key} is not a known key; did you mean {where}{nearest}?" in err
    with pytest.raises(ValueError, match=f"did you mean {where}{nearest}"):
        costmodel.read_file(path)


def test_cost_model_schema_version_true_is_refused(tmp_path, capsys):
    assert "schema_version=True: expected 1" in cli_error(capsys, "--cost-model",
                                                          cost_file(tmp_path, schema_version=True))


def test_a_reversed_speed_band_is_refused(tmp_path, capsys):
    path = cost_file(tmp_path, meta={"speed_band": {"decode": [1.3, 0.9], "prefill": [0.9, 1.2]}})
    assert "meta.speed_band.decode = [1.3, 0.9]: must be [fastest, slowest]" in cli_error(capsys, "--cost-model", path)


def test_the_published_cost_model_schema_accepts_what_the_project_writes():
    import jsonschema
    schema = json.loads((ROOT / "schemas" / "costmodel.schema.json").read_text())
    import dataclasses
    table = dataclasses.replace(costmodel.EXERCISE2, decode_batch_fixed_s=((1, 0.004), (8, 0.006)),
                                meta={"speed_band": {"decode": [0.9, 1.2], "prefill": [0.95, 1.1], "matmul": [0.8, 1.3]},
                                      "fit": {"mape": 3.0}})
    for model in (costmodel.EXERCISE2, table):
        jsonschema.validate(model.to_dict(), schema)
        assert costmodel.CostModel.from_dict(json.loads(json.dumps(model.to_dict()))) == model
    assert schema["additionalProperties"] is False
    assert "schemas/costmodel.schema.json" in (ROOT / "README.md").read_text()


@pytest.mark.parametrize("first, second", [("--num-prompts", "--num-requests"), ("--rate", "--request-rate")])
def test_aliases_given_twice_with_different_values_are_refused(capsys, first, second):
    assert "given twice with different values (10 and 20)" in cli_error(capsys, first, "10", second, "20") \
        or "given twice with different values (10.0 and 20.0)" in cli_error(capsys, first, "10", second, "20")


def test_aliases_given_twice_with_the_same_value_agree(capsys):
    code, out, _ = cli_lines(capsys, "--num-prompts", "30", "--num-requests", "30", "--seeds", "1", "--json")
    assert code == 0 and json.loads(out)


def test_result_filename_cannot_leave_the_result_dir(tmp_path, capsys):
    inner = tmp_path / "a" / "b"
    inner.mkdir(parents=True)
    err = cli_error(capsys, "--save-result", "--result-dir", str(inner), "--result-filename", "../../x.json")
    assert "must be a file name without '/'" in err and not (tmp_path / "x.json").exists()


def test_save_result_never_replaces_a_symlink_or_a_device(tmp_path, capsys):
    target = tmp_path / "kept.json"
    target.write_text("precious\n")
    (tmp_path / "link.json").symlink_to(target)
    err = cli_error(capsys, "--save-result", "--result-dir", str(tmp_path), "--result-filename", "link.json",
                    "--seeds", "1")
    assert "is a symlink; only a regular file is replaced" in err
    assert target.read_text() == "precious\n" and (tmp_path / "link.json").is_symlink()
    err = cli_error(capsys, "--save-result", "--result-dir", "/dev", "--result-filename", "null", "--seeds", "1")
    assert "is a character device" in err
    with pytest.raises(ValueError, match="is a symlink"):
        io_module.write_json(tmp_path / "link.json", {"x": 1})
    assert target.read_text() == "precious\n"


def test_a_bom_in_a_csv_header_gets_a_message_that_says_bom(tmp_path, capsys):
    path = tmp_path / "bom.csv"
    path.write_bytes(b"\xef\xbb\xbf" + (HEADER + "0,10,5\n1,12,6\n").encode())
    for err in (cli_error(capsys, "--workload", str(path)), cli_error(capsys, "--trace", str(path)),
                refusal(trace_config(path))):
        assert "byte-order mark (BOM, U+FEFF)" in err and "'arrival_s'" in err


def test_a_trace_that_is_not_utf8_is_refused(tmp_path, capsys):
    path = tmp_path / "latin1.csv"
    path.write_bytes((HEADER + "0,10,5\n").encode() + b"1,12,6 \xe9\n")
    assert "not UTF-8 text" in cli_error(capsys, "--trace", str(path))


# -- Markdown injection through every free text ---------------------------------------------------------

INJECTIONS = ["[x](javascript:alert(3))", "![i](http://e.com/x.png)", "*em* _em_ **b** `code` ~~del~~",
              "# heading", "- item", "+ item", "1. item", "3) item", "> quote", "=== ", "a | b | c",
              "&lt;script&gt; &amp; &#106;avascript", "<script>alert(1)</script>", "<javascript:alert(1)>",
              "see http://evil.example www.evil.example", "[ref]: http://evil.example", "a\\*b\\", "\u202eevil",
              "line\n\n# second"]


def rendered_markdown(text: str) -> str:
    """`text` as report.md carries it (markdown_text, then the template's autoescaping), rendered as
    CommonMark with GitHub's tables and strikethrough."""
    from markdown_it import MarkdownIt
    from markupsafe import escape
    cell = str(escape(markdown_text(text)))
    # the same text in a paragraph and in a table cell, the two places report.md puts free text
    return MarkdownIt("commonmark").enable(["table", "strikethrough"]).render(
        f"{cell}\n\n| a | b |\n|---|---|\n| {cell} | x |\n")


STRUCTURE = re.compile(r"<(a|img|em|strong|code|del|s|h\d|li|ol|ul|blockquote|script|pre|hr)\b")


@pytest.mark.parametrize("text", INJECTIONS)
def test_markdown_text_leaves_no_markdown_structure(text):
    pytest.importorskip("markdown_it")
    html = rendered_markdown(text)
    assert not STRUCTURE.search(html), html
    assert html.count("<td>") == 2 and html.count("<p>") == 1, html


@pytest.mark.parametrize("field", ["trace file name", "trace column header", "cost model name",
                                   "cost model source", "report title", "hardware name", "hardware description"])
def test_every_free_text_input_reaches_markdown_only_through_markdown_text(tmp_path, field):
    """Each text a user controls, carried as far as the pipeline carries it before rendering, comes
    out of markdown_text as plain text."""
    pytest.importorskip("markdown_it")
    evil = "[x](javascript:alert(3)) *e*"
    if field == "trace file name":
        path = tmp_path / f"{evil}.csv"
        path.write_text(HEADER + "0,10,5\n1,12,6\n")
        text = workload.describe({"rate": 2.0, "trace": {"path": str(path)}})["file"]
    elif field == "trace column header":
        path = tmp_path / "t.csv"
        path.write_text(f"{evil.replace(',', ' ')},prompt_tokens,output_tokens\n0,10,5\n1,12,6\n")
        columns = {"arrival": evil.replace(",", " ")}
        text = workload.describe({"rate": 2.0, "trace": {"path": str(path), "columns": columns}})["columns"]["arrival"]
    elif field.startswith("cost model"):
        key = field.split()[-1]
        text = costmodel.read_file(cost_file(tmp_path, **{key: evil})).__dict__[key]
    elif field == "report title":
        config = with_value("report.title", evil, QUICK)
        config_module.check(config)
        text = config["report"]["title"]
    else:
        text = evil
    assert evil in text
    assert not STRUCTURE.search(rendered_markdown(text))


def test_a_burst_logged_after_time_zero_is_still_a_burst(tmp_path, capsys):
    """--workload keeps a CSV's own times: 20 rows at t = 3.5 s were rescaled as if they spanned 3.5 s."""
    path = trace_file(tmp_path, "".join(f"3.5,{10 + i},5\n" for i in range(20)))
    assert "all arrivals at one time" in cli_error(capsys, "--workload", path, "--request-rate", "5")


def test_a_length_key_its_dist_does_not_read_is_refused():
    config = copy.deepcopy(QUICK)
    config["workload"]["prompt"]["value"] = 10**12
    assert refusal(config).startswith("config error: workload.prompt.value = 1000000000000: not read with dist "
                                      "uniform")


# == the keys, flags and file formats added since issue 19, found by the probe runner ======================

def saved_run(tmp_path, *argv) -> tuple[int, str, str]:
    """The CLI run in-process with a small workload: (exit code, stdout, stderr)."""
    try:
        code = main([*argv, "--num-requests", "20", "--json"])
    except SystemExit as exit_:
        code = exit_.code
    return code


@pytest.mark.parametrize("meta, meant", [
    ({"speed_bnad": {"decode": [0.9, 1.2], "prefill": [0.9, 1.1]}}, "meta.speed_band"),
    ({"profiled_rnage": {"prompt_tokens": [16, 512], "context_tokens": [17, 1024]}}, "meta.profiled_range"),
    ({"speed_band": {"decdoe": [0.9, 1.2], "prefill": [0.9, 1.1]}}, "meta.speed_band.decode"),
    ({"profiled_range": {"prompt_token": [16, 512], "context_tokens": [17, 1024]}}, "meta.profiled_range.prompt_tokens"),
])
def test_a_misspelled_meta_key_the_pipeline_reads_names_the_key_meant(tmp_path, capsys, meta, meant):
    """meta is free-form, so a misspelled speed_band or profiled_range was dropped without a word: the
    capacity stage lost its speed band, serving_sim its extrapolation warning."""
    path = cost_file(tmp_path, meta=meta)
    assert f"did you mean {meant}?" in cli_error(capsys, "--cost-model", path, "--print-curve")
    config = {**copy.deepcopy(QUICK), "costmodel": {"source": path}, "hardware": []}
    assert f"did you mean {meant}?" in refusal(config)


def test_the_fits_own_meta_keys_are_no_misspelling():
    """The fit's provenance keys stay far from the keys the pipeline reads."""
    meta = {"machine_fingerprint": "abc", "profile_wall_time_s": 3.0, "tiny_model": False, "r2": {}, "heldout_mape": 0.1,
            "heldout_mape_line_only": 0.1, "round_mape": 0.1, "mape_goal": 0.05, "goal_met": False,
            "speed_band": {}, "profiled_range": {"prompt_tokens": [16, 512], "context_tokens": [1, 768]}}
    costmodel.validate({**costmodel.EXERCISE2.to_dict(), "meta": meta})


def test_a_speed_band_of_one_kind_is_refused(tmp_path, capsys):
    """The capacity stage uses a band only with both kinds: one alone was ignored silently."""
    path = cost_file(tmp_path, meta={"speed_band": {"decode": [0.9, 1.2]}})
    assert "has no prefill" in cli_error(capsys, "--cost-model", path, "--print-curve")


@pytest.mark.parametrize("ranges, says", [
    ({"prompt_tokens": [512, 16], "context_tokens": [1, 768]}, "the smaller count first"),
    ({"prompt_tokens": [16, 512], "context_tokens": [1.5, 768]}, "is not of type 'integer'"),
    ({"prompt_tokens": [16, 512]}, "'context_tokens' is a required property"),
])
def test_a_bad_profiled_range_is_refused_where_the_cost_model_enters(tmp_path, capsys, ranges, says):
    """costmodel.source accepted a profiled_range serving_sim refuses; now both refuse it on reading."""
    path = cost_file(tmp_path, meta={"profiled_range": ranges})
    assert says in refusal({**copy.deepcopy(QUICK), "costmodel": {"source": path}, "hardware": []})
    assert says in cli_error(capsys, "--cost-model", path, "--print-curve")


def test_burstiness_with_a_trace_file_is_refused(tmp_path):
    """A trace keeps its own arrivals, so workload.burstiness was ignored without a word (the CLI
    refuses --burstiness with --trace)."""
    config = trace_config(trace_file(tmp_path, "".join(f"{i / 6:.4f},{20 + i},9\n" for i in range(30))))
    config["workload"]["burstiness"] = 2.0
    assert "workload.burstiness = 2.0: shapes drawn arrivals" in refusal(config)
    del config["workload"]["burstiness"]
    config["workload"]["max_concurrency"] = 4
    assert config_refused(config) is None


@pytest.mark.parametrize("content, says", [
    (HEADER.encode() + b"0,10,5\n", "not a vLLM result file (line 1: not a JSON document"),
    (b"[1, 2, 3]", "line 1 is no JSON object with date, request_rate"),
    (json.dumps(costmodel.EXERCISE2.to_dict()).encode(), "line 1 is no JSON object with date, request_rate"),
    (b'{"label": "caf\xe9"}', "not UTF-8"),
    (b"[" * 50_000 + b"]" * 50_000, "nested deeper than 32 levels"),
])
@pytest.mark.parametrize("flag", ["--append-result", "--save-result"])
def test_a_file_that_is_no_result_file_is_neither_appended_to_nor_replaced(tmp_path, capsys, monkeypatch, content,
                                                                          says, flag):
    """--append-result added a JSON line to whatever the file was (a trace, a cost model), after the whole
    simulation; a file that is not UTF-8 ended in a UnicodeDecodeError. Now it is refused first."""
    import servingplan.cli.main as cli
    monkeypatch.setattr(cli, "run_cells", lambda *a, **k: pytest.fail("simulated before checking the output file"))
    path = tmp_path / "out.json"
    path.write_bytes(content)
    err = cli_error(capsys, flag, "--result-dir", str(tmp_path), "--result-filename", "out.json", "--seeds", "1")
    assert says in err and "only a result file is replaced or appended to" in err, err
    assert path.read_bytes() == content


def test_a_result_file_of_16_gib_is_refused_unread(tmp_path, capsys):
    path = tmp_path / "big.json"
    with open(path, "wb") as handle:
        handle.truncate(1 << 34)
    err = cli_error(capsys, "--append-result", "--result-dir", str(tmp_path), "--result-filename", "big.json",
                    "--seeds", "1")
    assert "17,179,869,184 bytes, at most 1,073,741,824 allowed" in err


def test_append_result_keeps_a_vllm_file_and_adds_one_line_per_run(tmp_path, capsys):
    """vLLM's json.dump writes NaN for an undefined figure: its file is still one to append to."""
    path = tmp_path / "vllm.json"
    previous = '{"date": "20260101-000000", "backend": "vllm", "request_rate": 5.0, "mean_ttft_ms": NaN}'
    path.write_text(previous)
    assert saved_run(tmp_path, "--append-result", "--result-dir", str(tmp_path), "--result-filename", "vllm.json",
                     "--seeds", "2") == 0
    capsys.readouterr()
    lines = path.read_text().splitlines()
    assert lines[0] == previous and len(lines) == 3
    for line in lines[1:]:
        json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} written"))


def test_a_result_dir_where_no_file_can_be_created_is_refused_first(tmp_path, capsys, monkeypatch):
    """os.access says yes to root in /proc/self/fd, where no file can be made: the run simulated, then
    died writing. The directory is now tried with a file created and removed before any run."""
    import servingplan.cli.main as cli
    monkeypatch.setattr(cli, "run_cells", lambda *a, **k: pytest.fail("simulated before checking the output path"))
    err = cli_error(capsys, "--save-result", "--result-dir", "/proc/self/fd", "--seeds", "1")
    assert "--result-dir '/proc/self/fd': no file can be created there" in err or "not writable" in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("option, value", [("--sweep-rate", "inf,inf"), ("--sweep-rate", "5,5.0"), ("--seeds", "3,3"),
                                           ("--sweep-batch", "4,4"), ("--percentile-metrics", "ttft,ttft")])
def test_a_list_item_given_twice_is_refused(capsys, option, value):
    """--sweep-rate inf,inf ran its cell twice and reported the one seed as 2 seeds."""
    extra = ["--save-result", "--result-dir", "/tmp"] if option == "--percentile-metrics" else []
    err = cli_error(capsys, option, value, *extra)
    assert f"argument {option}: {value!r}: " in err and "given twice; each item must differ" in err


def test_trace_dates_with_and_without_a_utc_offset_are_refused(tmp_path, capsys):
    """A date without an offset is read as UTC; beside dates with one, the file's timeline was silently
    reordered (+14:00 put the second request 14 hours before the first)."""
    path = tmp_path / "azure.csv"
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00,10,5\n"
                    "2024-05-10 00:00:01+14:00,12,6\n")
    err = cli_error(capsys, "--trace", str(path), "--trace-layout", "azure")
    assert "line 3: TIMESTAMP = 2024-05-10 00:00:01+14:00: has UTC offset, line 2's date has none" in err
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00+00:00,10,5\n"
                    "2024-05-10 00:00:01-07:00,12,6\n")
    loaded = workload.load_trace(path, "azure")
    assert list(loaded.trace.arrival_s) == [0.0, 7 * 3600 + 1.0]


def test_azure_2023_and_2024_dates_and_burstgpt_rows_read_as_their_data_sets_write_them(tmp_path):
    azure23, azure24, burst = tmp_path / "a23.csv", tmp_path / "a24.csv", tmp_path / "b.csv"
    azure23.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
                       "2023-11-16 18:15:50.9951690,396,109\n")
    azure24.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00.009930+00:00,2162,5\n"
                       "2024-05-10 00:00:00.018005+00:00,4020,5\n")
    burst.write_text("Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
                     "5,ChatGPT,472,18,490,Conversation log\n45,ChatGPT,1087,0,1087,Conversation log\n"
                     "118,GPT-4,417,276,693,API log\n")
    assert workload.load_trace(azure23, "azure").trace.arrival_s[1] == pytest.approx(4.314579)
    assert workload.load_trace(azure24, "azure").trace.arrival_s[1] == pytest.approx(0.008075)
    loaded = workload.load_trace(burst, "burstgpt")
    assert loaded.skipped_zero_tokens == 1 and list(loaded.trace.arrival_s) == [0.0, 113.0]
