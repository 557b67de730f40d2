"""Every failure of issue 12, each a named test: an input that hung, crashed or produced impossible
numbers now works or is refused with one line naming the input, the value and what is allowed."""
from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from servingplan import architecture, config as config_module, costmodel, metrics, workload
from servingplan.capacity import MAX_BISECTIONS, log_bisect
from servingplan.cli import main
from servingplan.config import ConfigError
from servingplan.report.text import markdown_text
from servingplan.sim import simulate

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "serving_sim.py"
BASE = yaml.safe_load((ROOT / "config.yaml").read_text())
QUICK = yaml.safe_load((ROOT / "config" / "quick.yaml").read_text())
HEADER = "arrival_s,prompt_tokens,output_tokens\n"


def refusal(config: dict) -> str:
    with pytest.raises(ConfigError) as caught:
        config_module.check(config)
    message = str(caught.value)
    assert len(message.splitlines()) == 1
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
    from servingplan.profiling.model import load_model
    return load_model("random", 0, architecture.QUICK_CONFIG_OVERRIDES)[0]


def serve(model, trace):
    from servingplan.serving import Engine
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
    assert text == r"ok \# Fake section \[x\](javascript:alert(3)) !\[\](http://example.com/x.png)"
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
