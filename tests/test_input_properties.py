"""Property-based: configs, CLI arguments, cost models, trace files and engine request mixes drawn from
hostile values. Every case finishes (a hang guard stops one that does not), and either gives finite,
non-negative figures or is refused with one line and no traceback; no input file is changed."""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import math
import signal
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings, strategies as st

from servingplan import architecture, config as config_module, costmodel, metrics, workload
from servingplan.capacity import MAX_BISECTIONS, log_bisect
from servingplan.cli import main
from servingplan.config import ConfigError
from servingplan.serving.engine import request_problem
from servingplan.sim import simulate

ROOT = Path(__file__).resolve().parent.parent
QUICK = yaml.safe_load((ROOT / "config" / "quick.yaml").read_text())
# A case that has not finished by then is a hang, whatever the machine's speed.
HANG_S = 120
FAST = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                      HealthCheck.function_scoped_fixture])


@contextlib.contextmanager
def hang_guard(seconds: int = HANG_S):
    def stop(signum, frame):
        raise TimeoutError(f"still running after {seconds} s: a hang")
    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def assert_one_line(message: str) -> None:
    event("refused")
    assert message.strip() and len(message.strip().splitlines()) == 1, message
    assert "Traceback" not in message


def assert_figures(values) -> None:
    """Every number finite and >= 0 (None stands for an undefined or infinite figure)."""
    event("ran")
    for value in values:
        if isinstance(value, (bool, str)) or value is None:
            continue
        assert math.isfinite(value) and value >= 0, value


def digest(paths) -> dict:
    return {str(p): hashlib.sha256(Path(p).read_bytes()).hexdigest() for p in paths}


# -- configs ---------------------------------------------------------------------------------------------

def leaves(node, path=()):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from leaves(value, path + (key,))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from leaves(value, path + (i,))
    else:
        yield path


LEAVES = list(leaves(QUICK))
HOSTILE = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(-10**15, 10**15),
    st.sampled_from([0, -1, 1, 2, 10**12, 2**63, 1e-300, 1e300, 0.5, 1e-9, 1e-10]),
    st.text(max_size=12), st.none(), st.booleans(),
    st.lists(st.floats(allow_nan=True, allow_infinity=True), max_size=3),
)


def mostly(valid, hostile, one_in: int = 8):
    """`valid` draws, with one `hostile` draw in about `one_in`: most cases then get past validation
    and exercise what runs after it."""
    return st.integers(0, one_in - 1).flatmap(lambda i: hostile if i == 0 else valid)


def plausible(value):
    """Values near a config's own: the same type, scaled by up to 2 either way."""
    if isinstance(value, bool):
        return st.booleans()
    if isinstance(value, int):
        return st.integers(max(0, value // 2), 2 * value + 1)
    if isinstance(value, float):
        return st.floats(value / 2, 2 * value)
    return st.just(value)


@st.composite
def mutation(draw):
    path = draw(st.sampled_from(LEAVES))
    node = QUICK
    for key in path:
        node = node[key]
    return path, draw(mostly(plausible(node), HOSTILE, one_in=3))


def mutated(mutations) -> dict:
    config = copy.deepcopy(QUICK)
    for path, value in mutations:
        node = config
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
    return config


@FAST
@given(st.lists(mutation(), min_size=1, max_size=3))
def test_a_config_is_refused_in_one_line_or_runs_finite(mutations):
    config = mutated(mutations)
    with hang_guard():
        try:
            config_module.check(config)
        except ConfigError as exc:
            assert_one_line(str(exc))
            assert str(exc).startswith("config error: ")
            return
        trace = workload.generate({**config["workload"], "num_requests": min(config["workload"]["num_requests"], 200)},
                                  config["seed"])
        capacity = config["capacity"]
        calls = []
        log_bisect(lambda rate: calls.append(rate) or rate < math.sqrt(capacity["rate_min"] * capacity["rate_max"]),
                   capacity["rate_min"], capacity["rate_max"], capacity["tolerance"])
    event("ran")
    assert len(calls) <= MAX_BISECTIONS
    assert np.isfinite(trace.arrival_s).all() and (np.diff(trace.arrival_s) >= 0).all()
    for part, tokens in (("prompt", trace.prompt_tokens), ("output", trace.output_tokens)):
        spec = config["workload"][part]
        lo, hi = (spec["value"], spec["value"]) if spec["dist"] == "constant" else (spec["min"], spec["max"])
        assert tokens.min() >= lo and tokens.max() <= hi


def test_yaml_spellings_of_nan_and_infinity_are_refused(tmp_path):
    for spelling in (".nan", ".inf", "-.inf", ".NaN"):
        path = tmp_path / "config.yaml"
        path.write_text((ROOT / "config" / "quick.yaml").read_text().replace("rate: 6.0", f"rate: {spelling}"))
        with pytest.raises(ConfigError, match="workload.rate = .*: must be a finite number"):
            config_module.load(path)


# -- cost models -----------------------------------------------------------------------------------------

COEFFICIENT = mostly(
    st.one_of(st.floats(min_value=0, max_value=1e-2), st.sampled_from([0, 0.0, 1e-300, 3600.0])),
    st.one_of(st.floats(allow_nan=True, allow_infinity=True),
              st.sampled_from([-1e-3, 3601.0, 1e300, "0.005", None, True])), one_in=12)


@st.composite
def cost_documents(draw):
    def section(keys):
        return {key: draw(COEFFICIENT) for key in keys if draw(st.integers(0, 29)) > 0}
    decode = section(costmodel.DECODE_KEYS)
    if draw(st.booleans()):
        decode["ctx_mode"] = draw(st.sampled_from(["sum", "padded_max", "sum", "padded_max", "max", 3]))
    if draw(st.booleans()):
        batches = draw(st.lists(mostly(st.integers(1, 80), st.sampled_from([0, -2, 1.5, "4", 2**40])),
                                max_size=4, unique_by=str))
        lengths = mostly(st.just(len(batches)), st.sampled_from([max(0, len(batches) - 1), len(batches) + 1]))
        decode["batch_fixed_s"] = {"batches": batches,
                                   "fixed_s": [draw(COEFFICIENT) for _ in range(draw(lengths))]}
    document = {"schema_version": draw(mostly(st.just(1), st.sampled_from([2, "1", None]))), "decode": decode,
                "prefill": section(costmodel.PREFILL_KEYS)}
    return draw(mostly(st.just(document), st.sampled_from([[], "model", 3, None, {"decode": []}])))


SMALL_LENGTHS = {"num_requests": 30, "rate": 20.0,
                 "prompt": {"dist": "uniform", "min": 1, "max": 300},
                 "output": {"dist": "uniform", "min": 1, "max": 60}}


@FAST
@given(cost_documents())
def test_a_cost_model_is_refused_in_one_line_or_gives_positive_finite_times(tmp_path, document):
    path = tmp_path / "cost.json"
    path.write_text(json.dumps(document))
    with hang_guard():
        try:
            model = costmodel.load(path)
        except ValueError as exc:
            assert_one_line(str(exc))
            return
        for batch in (1, 2, 7, 64, 1000):
            for context in (1, 100, 2048):
                t = model.decode_time(batch, batch * context, context)
                assert math.isfinite(t) and t > 0
        for tokens in (1, 100, 2048):
            t = model.prefill_time(tokens, tokens)
            assert math.isfinite(t) and t > 0
        result = simulate(workload.generate(SMALL_LENGTHS, 0), model, "continuous_chunked", 8, 64,
                          record_tokens=True)
        summary = metrics.summarize(result, metrics.SLO(ttft_ms=500, tpot_ms=50, itl_ms=50))
    assert_figures(summary.values())


# -- trace files -----------------------------------------------------------------------------------------

CELL = mostly(
    st.one_of(st.sampled_from(["0.5", "3", "1e-9", "12", "1", "64", "250", "7.0", "1048576"]),
              st.integers(1, 5000).map(str)),
    st.one_of(st.sampled_from(["", " ", "abc", "nan", "inf", "-inf", "-1", "0", "1.5", "1e400", "100000000000"]),
              st.text(alphabet="0123456789.-e", min_size=1, max_size=6)), one_in=25)
ROW = mostly(st.lists(CELL, min_size=3, max_size=3), st.lists(CELL, min_size=0, max_size=5), one_in=25)


@FAST
@given(st.lists(ROW, min_size=0, max_size=12))
def test_a_trace_file_is_refused_in_one_line_or_simulates_finite(tmp_path, rows):
    path = tmp_path / "trace.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens\n" + "".join(",".join(r) + "\n" for r in rows))
    before = digest([path])
    with hang_guard():
        try:
            trace = workload.load_trace_csv(path)
        except ValueError as exc:
            assert_one_line(str(exc))
            assert str(path) in str(exc)
            return
        finally:
            assert digest([path]) == before
        assert np.isfinite(trace.arrival_s).all() and (trace.arrival_s >= 0).all()
        assert (trace.prompt_tokens >= 1).all() and (trace.output_tokens >= 1).all()
        if len(trace):
            summary = metrics.summarize(simulate(trace, costmodel.EXERCISE2, "continuous_chunked", 16, 512,
                                                 record_tokens=True), metrics.SLO(itl_ms=20))
            assert_figures(summary.values())


# -- the CLI ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cli_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    good_trace, bad_trace = root / "trace.csv", root / "bad_trace.csv"
    workload.generate({**SMALL_LENGTHS, "num_requests": 40}, 1).to_frame().to_csv(good_trace, index=False)
    bad_trace.write_text("arrival_s,prompt_tokens,output_tokens\n0.1,,10\n0.2,5\n")
    good_cost, negative_cost = root / "cost.json", root / "negative.json"
    costmodel.EXERCISE2.scaled(3.0).save(good_cost)
    negative = costmodel.EXERCISE2.to_dict()
    negative["decode"]["fixed_s"] = -0.005
    negative_cost.write_text(json.dumps(negative))
    return {"trace": good_trace, "bad_trace": bad_trace, "cost": good_cost, "negative_cost": negative_cost}


OPTION_VALUES = {
    "--policies": ["static", "continuous,continuous_chunked", "fifo", ""],
    "--rate": ["5", "20", "0.001", "1e6", "0", "-1", "nan", "inf", "1e7", "x"],
    "--sweep-rate": ["5,40", "1,,2", "0,5", "inf"],
    "--max-num-seqs": ["1", "4", "65536", "0", "70000", "4.5"],
    "--sweep-batch": ["4,8", "0,4", "x", "1"],
    "--chunk-size": ["1", "512", "0", "2000000"],
    "--seeds": ["1", "2", "0,3", "0", "-1", "101", "1,x", "1e12"],
    "--num-requests": ["10", "50", "0", "-5", "1e12", "1000000000000", "nan"],
    "--slo-ttft-ms": ["2000", "0", "-3", "nan", "1e10"],
    "--slo-tpot-ms": ["12", "0", "inf"],
    "--slo-itl-ms": ["40", "0", "nan"],
    "--slo-ttft-pct": ["95", "101", "-1", "nan"],
    "--kv-blocks": ["1", "200", "0", "2000000000"],
    "--block-size": ["1", "16", "0", "1e9"],
    "--curve-context": ["1", "2000", "0", "2000000"],
    "--workload": ["exercise2", "capstone", "no_such.csv", "@trace", "@bad_trace"],
    "--cost-model": ["exercise2", "@cost", "@negative_cost", "no_such.json"],
}


@st.composite
def cli_arguments(draw):
    options = draw(st.lists(st.sampled_from(sorted(OPTION_VALUES)), max_size=5, unique=True))
    argv = [part for option in options for part in (option, draw(st.sampled_from(OPTION_VALUES[option])))]
    if draw(st.integers(0, 5)) == 0:
        argv.append("--print-curve")
    return argv


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(cli_arguments())
def test_cli_arguments_are_refused_in_one_line_or_give_finite_figures(capsys, cli_files, argv):
    argv = [str(cli_files[a[1:]]) if a.startswith("@") else a for a in argv]
    # keep each run small: a few requests, one or two seeds
    if "--num-requests" not in argv:
        argv += ["--num-requests", "40"]
    if "--seeds" not in argv:
        argv += ["--seeds", "1"]
    before = digest(cli_files.values())
    with hang_guard():
        try:
            code = main(argv + ["--json"])
        except SystemExit as exit_:
            code = exit_.code
    out, err = capsys.readouterr()
    assert digest(cli_files.values()) == before
    if code != 0:
        assert code == 2 and out == ""
        assert_one_line(err)
        return
    assert err == ""
    if "--print-curve" in argv:
        for line in out.splitlines()[2:]:
            assert_figures(float(cell) for cell in line.split())
        return
    def refuse_constant(name):
        raise AssertionError(f"{name} in the JSON output")
    for row in json.loads(out, parse_constant=refuse_constant):
        assert_figures(row.values())


# -- load shapes and vLLM's result file (issue 21) --------------------------------------------------------

LOAD_OPTION_VALUES = {
    "--rate": ["inf", "20", "0"],
    "--burstiness": ["0.5", "1", "inf", "0", "1e-9", "nan", "x"],
    "--max-concurrency": ["1", "8", "1000000", "0", "2.5", "x"],
    "--percentile-metrics": ["ttft", "e2el,client_queue_time", "goodput", ""],
    "--metadata": ["a=1", "completed=1", "novalue"],
    "--result-date": ["20260101-000000", "20261301-000000", "x"],
    "--result-filename": ["one.json", "a/b.json"],
    "--capacity-users": ["4", "0"],
    "--slo-ttft-ms": ["2000"],
    "--sweep-batch": ["4,8", "16"],
}


@st.composite
def load_arguments(draw):
    options = draw(st.lists(st.sampled_from(sorted(LOAD_OPTION_VALUES)), max_size=5, unique=True))
    argv = [part for option in options for part in (option, draw(st.sampled_from(LOAD_OPTION_VALUES[option])))]
    for flag in ("--save-result", "--append-result", "--save-detailed"):
        if draw(st.booleans()):
            argv.append(flag)
    return argv


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(load_arguments())
def test_load_shape_and_result_options_are_refused_in_one_line_or_give_finite_figures(capsys, tmp_path_factory,
                                                                                       argv):
    results = tmp_path_factory.mktemp("results")
    with hang_guard():
        try:
            code = main(argv + ["--num-requests", "30", "--seeds", "1", "--json", "--result-dir", str(results)])
        except SystemExit as exit_:
            code = exit_.code
    out, err = capsys.readouterr()
    if code != 0:
        assert code == 2 and out == ""
        assert_one_line(err)
        return
    for row in json.loads(out, parse_constant=lambda name: pytest.fail(f"{name} in the JSON output")):
        assert_figures(row.values())
    for path in results.glob("*.json"):
        for line in path.read_text().splitlines():
            saved = json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in {path.name}"))
            assert_figures(v for v in saved.values() if not isinstance(v, (list, dict)))


# -- engine request mixes ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model():
    from servingplan.profiling.model import load_model
    return load_model("random", 0, architecture.QUICK_CONFIG_OVERRIDES)[0]


REQUEST = st.tuples(st.sampled_from([0.0, 0.01, 0.05, math.nan, math.inf, -1.0]),
                    st.sampled_from([1, 5, 20, 0, -3, 1000, 10**11]),
                    st.sampled_from([1, 3, 8, 0, -1, 24, 10**9]))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(st.lists(REQUEST, min_size=1, max_size=4), st.sampled_from(["static", "continuous", "continuous_chunked"]))
def test_an_engine_serves_every_valid_request_and_refuses_the_rest(tiny_model, requests, policy):
    from servingplan.serving import Engine
    arrivals, prompts, outputs = (np.array(column) for column in zip(*requests))
    trace = workload.Trace(arrivals.astype(float), prompts.astype(np.int64), outputs.astype(np.int64))
    n_positions = tiny_model.config.n_positions
    with hang_guard():
        run = Engine(tiny_model, policy, 4, chunk_size=64, threads=1).run(trace, max_wall_s=60.0)
    result = run.result
    assert not result.truncated
    for i, (arrival, prompt, output) in enumerate(requests):
        problem = request_problem(prompt, output, n_positions, arrival)
        if problem is None:
            assert result.finished[i] and len(run.tokens[i]) == output and i not in run.errors
            assert 0 <= arrival <= result.first_token_s[i] <= result.completion_s[i] <= result.end_s
        else:
            assert run.errors[i] == problem and result.rejected[i] and not result.finished[i]
            assert len(run.prompts[i]) == 0 and len(run.tokens[i]) == 0
