"""Property-based: configs, CLI arguments, cost models, trace files and engine request mixes drawn from
hostile values. Every case finishes (a hang guard stops one that does not), and either gives finite,
non-negative figures or is refused with one line and no traceback; no input file is changed."""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import stat
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings, strategies as st

from servingplan import architecture, config as config_module, costmodel
from servingplan.cli.main import main
from servingplan.config import ConfigError
from servingplan.engine.engine import request_problem
from servingplan.simulate import metrics, workload
from servingplan.simulate import simulate
from servingplan.simulate.capacity import MAX_BISECTIONS, log_bisect

import helpers
from helpers import config_refused, one_line, set_path

ROOT = Path(__file__).resolve().parent.parent
QUICK = yaml.safe_load((ROOT / "config" / "quick.yaml").read_text())
# A case that has not finished by then is a hang, whatever the machine's speed.
HANG_S = 120
FAST = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                      HealthCheck.function_scoped_fixture])


def hang_guard():
    return helpers.hang_guard(HANG_S)


def assert_one_line(message: str) -> None:
    event("refused")
    one_line(message)


def assert_figures(values) -> None:
    """Every number finite and >= 0 (None stands for an undefined or infinite figure)."""
    event("ran")
    for value in values:
        if isinstance(value, (bool, str)) or value is None:
            continue
        if isinstance(value, (list, dict)):  # --save-detailed's per-request lists
            assert_figures(value.values() if isinstance(value, dict) else value)
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
        if config_refused(config):
            event("refused")
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
    files = {"trace": good_trace, "bad_trace": bad_trace, "cost": good_cost, "negative_cost": negative_cost}
    jsonl = root / "trace.jsonl"
    jsonl.write_text("".join(json.dumps({"arrival_s": i * 0.1, "prompt_tokens": 20 + i, "output_tokens": 5}) + "\n"
                             for i in range(30)))
    burst = root / "burst.csv"
    burst.write_text("arrival_s,prompt_tokens,output_tokens\n" + "".join(f"2.5,{10 + i},4\n" for i in range(10)))
    bom = root / "bom.csv"
    bom.write_bytes(b"\xef\xbb\xbf" + good_trace.read_bytes())
    deep = root / "deep.json"
    deep.write_text("[" * 5000 + "]" * 5000)
    typo = root / "typo.json"
    typo_doc = costmodel.EXERCISE2.to_dict()
    typo_doc["decode"]["ctx_mod"] = typo_doc["decode"].pop("ctx_mode")
    typo.write_text(json.dumps(typo_doc))
    fifo = root / "fifo"
    os.mkfifo(fifo)
    outdir = root / "out"
    outdir.mkdir()
    (outdir / "link.json").symlink_to(good_trace)
    # what --append-result finds: a vLLM result file (added to), a trace and a FIFO (refused)
    (outdir / "results.json").write_text(json.dumps({"date": "20260101-000000", "request_rate": 5.0}) + "\n")
    (outdir / "notes.csv").write_text(good_trace.read_text())
    os.mkfifo(outdir / "pipe.json")
    files.update(jsonl_trace=jsonl, burst_trace=burst, bom_trace=bom, deep_json=deep, typo_cost=typo)
    # paths the CLI must refuse or write into; never hashed (reading a FIFO would block)
    files["unhashed"] = {"fifo": fifo, "outdir": outdir, "missing_dir": root / "missing", "long_name": "x" * 300,
                         "link_name": "link.json"}
    return files


def hashed(cli_files) -> list:
    return [path for name, path in cli_files.items() if name != "unhashed"]


def resolve(argument: str, cli_files) -> str:
    if not argument.startswith("@"):
        return argument
    return str(cli_files.get(argument[1:]) or cli_files["unhashed"][argument[1:]])


OPTION_VALUES = {
    "--policies": ["static", "continuous,continuous_chunked", "fifo", ""],
    "--rate": ["5", "20", "0.001", "1e6", "0", "-1", "nan", "inf", "1e7", "x"],
    "--sweep-rate": ["5,40", "1,,2", "0,5", "inf", "5,inf", "5,5.0"],
    "--max-num-seqs": ["1", "4", "65536", "0", "70000", "4.5"],
    "--sweep-batch": ["4,8", "0,4", "x", "1"],
    "--chunk-size": ["1", "512", "0", "2000000"],
    "--seeds": ["1", "2", "0,3", "0", "-1", "101", "1,x", "1e12", "3,3"],
    "--num-requests": ["10", "50", "0", "-5", "1e12", "1000000000000", "nan"],
    "--slo-ttft-ms": ["2000", "0", "-3", "nan", "1e10"],
    "--slo-tpot-ms": ["12", "0", "inf"],
    "--slo-itl-ms": ["40", "0", "nan"],
    "--slo-ttft-pct": ["95", "101", "-1", "nan"],
    "--slo-tpot-pct": ["90", "100", "101", "nan"],
    "--slo-itl-pct": ["99", "0", "-1", "inf"],
    "--kv-blocks": ["1", "200", "0", "2000000000"],
    "--block-size": ["1", "16", "0", "1e9"],
    "--curve-context": ["1", "2000", "0", "2000000"],
    "--workload": ["exercise2", "capstone", "no_such.csv", "@trace", "@bad_trace"],
    "--cost-model": ["exercise2", "@cost", "@negative_cost", "no_such.json", "@fifo", "@deep_json", "@typo_cost"],
    "--request-rate": ["5", "0", "nan", "inf", "-inf", "Infinity"],
    "--burstiness": ["0.001", "1e6", "inf", "0.0009", "1e7", ""],
    "--max-concurrency": ["1", "4", "1000001", "-0", "inf"],
    "--percentile-metrics": ["ttft,tpot,itl,e2el", "client_queue_time", "TTFT"],
    "--capacity-users": ["1", "-1", "nan"],
    "--metadata": ["a=1", "9=x", "a=" + "v" * 300],
    "--result-date": ["20260228-235959", "20260230-000000", ""],
    "--num-prompts": ["10", "40", "0", "1e12"],
    "--trace": ["@trace", "@bad_trace", "@jsonl_trace", "@burst_trace", "@bom_trace", "@fifo", "@outdir", "none.csv"],
    "--trace-layout": ["servingplan", "azure", "burstgpt", "sharegpt"],
    "--trace-columns": ["arrival=arrival_s", "prompt_tokens=arrival_s", "x=y", "arrival=", ""],
    "--trace-timestamps": ["seconds", "datetime", "epoch"],
    "--max-num-batched-tokens": ["512", "4", "0", "2000000"],
    "--seed": ["0", "7", "-1", "4294967296"],
    "--goodput": ["ttft:2000", "tpot:12", "e2el:30000", "ttft:0", "x:5", "tpot"],
    "--metric-percentiles": ["99", "50,90,99", "101", "nan", ""],
    "--result-dir": ["@outdir", "@missing_dir", "@trace"],
    "--result-filename": ["r.json", "../x.json", "@long_name", "@link_name", "", "results.json", "notes.csv",
                          "pipe.json"],
    "--save-result": [None],
    "--save-detailed": [None],
    "--print-curve": [None],
    "--json": [None],
    "--append-result": [None],
    "--label": ["run1", "a/b", "", "..", "x" * 300],
    "--max-context": ["512", "0", "1e12", "x", "2.5", "1048577"],
    "--too-long": ["skip", "clip", "truncate", "SKIP"],
}


def test_every_cli_flag_is_fuzzed():
    """A new flag gets values here, or this fails: the generative suite covers every way in."""
    from servingplan.cli.main import build_parser
    flags = {option for action in build_parser()._actions for option in action.option_strings} - {"-h", "--help"}
    fuzzed = set(OPTION_VALUES) | set(LOAD_OPTION_VALUES)
    assert flags <= fuzzed, sorted(flags - fuzzed)


@st.composite
def cli_arguments(draw):
    options = draw(st.lists(st.sampled_from(sorted(OPTION_VALUES)), max_size=5, unique=True))
    argv = []
    for option in options:
        value = draw(st.sampled_from(OPTION_VALUES[option]))
        argv += [option] if value is None else [option, value]
    # a result file goes to the fixture's folder, never the working directory (the default)
    if ("--save-result" in argv or "--append-result" in argv) and "--result-dir" not in argv:
        argv += ["--result-dir", "@outdir"]
    return argv


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(cli_arguments())
def test_cli_arguments_are_refused_in_one_line_or_give_finite_figures(capsys, cli_files, argv):
    argv = [resolve(a, cli_files) for a in argv]
    # keep each run small: a few requests, one or two seeds
    if "--num-requests" not in argv and "--num-prompts" not in argv:
        argv += ["--num-requests", "40"]
    if "--seeds" not in argv and "--seed" not in argv and "--trace" not in argv:
        argv += ["--seeds", "1"]
    before = digest(hashed(cli_files))
    with hang_guard():
        try:
            code = main(argv + ["--json"])
        except SystemExit as exit_:
            code = exit_.code
    out, err = capsys.readouterr()
    assert digest(hashed(cli_files)) == before
    outdir = cli_files["unhashed"]["outdir"]
    assert (outdir / "link.json").is_symlink() and stat.S_ISFIFO(os.lstat(outdir / "pipe.json").st_mode)
    assert (outdir / "notes.csv").read_text() == cli_files["trace"].read_text()
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
    assert_result_files(cli_files["unhashed"]["outdir"])


def assert_result_files(directory: Path) -> None:
    """Every result file in `directory` a regular file of JSON objects, one a line, without NaN or
    Infinity (the lists of --save-detailed included)."""
    for path in directory.glob("*.json"):
        if path.is_symlink() or not path.is_file():
            continue  # the fixture's link and FIFO, which no run may replace (checked by the caller)
        for line in path.read_text().splitlines():
            saved = json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} in {path.name}"))
            assert isinstance(saved, dict)
            assert_figures(saved.values())


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
    assert_result_files(results)


# -- engine request mixes ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_model():
    from servingplan.profile.model import load_model
    return load_model("random", 0, architecture.QUICK_CONFIG_OVERRIDES)[0]


REQUEST = st.tuples(st.sampled_from([0.0, 0.01, 0.05, math.nan, math.inf, -1.0]),
                    st.sampled_from([1, 5, 20, 0, -3, 1000, 10**11]),
                    st.sampled_from([1, 3, 8, 0, -1, 24, 10**9]))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                HealthCheck.function_scoped_fixture])
@given(st.lists(REQUEST, min_size=1, max_size=4), st.sampled_from(["static", "continuous", "continuous_chunked"]))
def test_an_engine_serves_every_valid_request_and_refuses_the_rest(tiny_model, requests, policy):
    from servingplan.engine import Engine
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


# -- every key of the schemas, drawn from the schemas themselves ----------------------------------------
# New keys are fuzzed as soon as a schema lists them: the paths and the values come from the schema.

CONFIG_SCHEMA = yaml.safe_load((ROOT / "schemas" / "config.schema.yaml").read_text())
COST_SCHEMA = json.loads((ROOT / "schemas" / "costmodel.schema.json").read_text())


def resolved(schema: dict, node: dict) -> dict:
    while "$ref" in node:
        *_, section, name = node["$ref"].split("/")
        node = schema[section][name]
    return node


def schema_paths(schema: dict, node=None, path=()):
    """(path, sub-schema) of every property the schema lists, optional ones included; a list's items
    are reached through index 0."""
    node = resolved(schema, schema if node is None else node)
    yield path, node
    for key, child in node.get("properties", {}).items():
        yield from schema_paths(schema, child, path + (key,))
    if isinstance(node.get("items"), dict):
        yield from schema_paths(schema, node["items"], path + (0,))


def values_for(node: dict):
    """Values the sub-schema allows (near its bounds) and values it does not."""
    allowed = []
    if "enum" in node:
        allowed = list(node["enum"])
    elif node.get("type") in ("number", "integer"):
        low = node.get("minimum", node.get("exclusiveMinimum", 0))
        high = node.get("maximum", node.get("exclusiveMaximum", 10**6))
        allowed = [low, high, (low + high) / 2] if node["type"] == "number" else [int(low), int(high)]
    elif node.get("type") == "string":
        allowed = ["x", "a" * node.get("maxLength", 10), "a" * (node.get("maxLength", 10) + 1)]
    elif node.get("type") == "boolean":
        allowed = [True, False]
    return st.one_of(st.sampled_from(allowed or [None]), HOSTILE, st.just({}), st.just([]))


def typo(key: str):
    """A misspelling of `key`: one character dropped, doubled or appended."""
    return st.integers(0, max(0, len(key) - 1)).flatmap(lambda i: st.sampled_from(
        [key[:i] + key[i + 1:], key[:i] + key[i] + key[i:], key + "s"]))


CONFIG_PATHS = [(path, node) for path, node in schema_paths(CONFIG_SCHEMA) if path]


@st.composite
def schema_mutation(draw):
    path, node = draw(st.sampled_from(CONFIG_PATHS))
    if draw(st.integers(0, 4)) == 0 and node.get("properties"):
        key = draw(st.sampled_from(sorted(node["properties"])))
        return path + (draw(typo(key)),), draw(values_for(resolved(CONFIG_SCHEMA, node["properties"][key]))), True
    return path, draw(values_for(node)), False


@FAST
@given(st.lists(schema_mutation(), min_size=1, max_size=3))
def test_every_config_key_of_the_schema_is_refused_in_one_line_or_checks(mutations):
    config = copy.deepcopy(QUICK)
    for path, value, _ in mutations:
        set_path(config, path, value)
    with hang_guard():
        if config_refused(config):
            event("refused")
            return
    event("checked")
    # a misspelled key that survives the check would be a key silently ignored
    for path, _, misspelled in mutations:
        node = config
        for key in path[:-1]:
            node = node[key] if isinstance(node, dict) or isinstance(key, int) else None
        if misspelled and isinstance(node, dict) and path[-1] in node:
            pytest.fail(f"misspelled key {'.'.join(map(str, path))} was accepted")


COST_PATHS = [(path, node) for path, node in schema_paths(COST_SCHEMA) if path]
VALID_COST = costmodel.EXERCISE2.to_dict()


@FAST
@given(st.data())
def test_every_cost_model_key_of_the_schema_is_refused_in_one_line_or_loads(tmp_path, data):
    document = copy.deepcopy(VALID_COST)
    misspelled = None
    for _ in range(data.draw(st.integers(1, 3))):
        path, node = data.draw(st.sampled_from(COST_PATHS))
        if isinstance(path[-1], str) and data.draw(st.integers(0, 3)) == 0:
            misspelled = path[:-1] + (data.draw(typo(path[-1])),)
            if misspelled[-1] in (node.get("properties") or {}) or misspelled[-1] == path[-1]:
                misspelled = None
                continue
            set_path(document, misspelled, data.draw(values_for(node)))
        else:
            set_path(document, path, data.draw(values_for(node)))
    path = tmp_path / "cost.json"
    try:
        path.write_text(json.dumps(document, allow_nan=False))
    except ValueError:
        path.write_text(json.dumps(document))
    with hang_guard():
        try:
            model = costmodel.read_file(path)
        except ValueError as exc:
            assert_one_line(str(exc))
            if misspelled is not None and "is not a known key" in str(exc):
                event("misspelling named")
            return
    assert misspelled is None or misspelled[0] == "meta", f"misspelled key {misspelled} was accepted"
    for batch in (1, 8, 300):
        assert math.isfinite(model.decode_time(batch, batch * 100, 100)) and model.decode_time(batch, 0, 0) >= 0
    assert math.isfinite(model.prefill_time(100, 50)) and model.prefill_time(100, 50) > 0


# -- trace formats ---------------------------------------------------------------------------------------

ARRIVAL = mostly(st.one_of(st.floats(0, 1e4), st.sampled_from([0.0, 1e-320, 5e-7, 1e-6, 1e8]),
                           # magnitudes a float reaches, subnormal to far past the microsecond's resolution
                           st.sampled_from([5e-324, 2.2250738585072014e-308, 1e-300, 2.0 ** 33, 1e12, 1e20])),
                 st.sampled_from([1e300, -1.0, math.nan, math.inf, "x", "", None, True, [1]]), one_in=12)
# The clock a trace's rows read: seconds from its start (ARRIVAL, magnitudes mixed), or a clock of one
# magnitude with seconds or subnormal steps between rows: around 2**33 s (where float64 stops resolving a
# microsecond), integers past 2**53 and 1e20 whose text tells seconds apart where a float does not, or
# subnormals near 0.
CLOCKS = st.sampled_from([ARRIVAL, st.integers(2 ** 33 - 2, 2 ** 33 + 2), st.integers(2 ** 53, 2 ** 53 + 3),
                          st.integers(10 ** 20, 10 ** 20 + 3),
                          st.sampled_from([0.0, 5e-324, 1e-320, 2.2250738585072014e-308, 1e-300])])
TOKENS = mostly(st.integers(1, 2000), st.sampled_from([0, -1, 2**21, 1.5, "7", "", None, [3], {"a": 1}]), one_in=12)
DATE = mostly(
    st.builds(lambda second, digits, offset: f"2024-05-10 00:{second // 60:02d}:{second % 60:02d}.{digits}{offset}",
              st.integers(0, 3599), st.sampled_from(["0", "009930", "6805900"]),
              st.sampled_from(["", "+00:00", "-07:00"])),
    st.sampled_from(["2023-02-30 00:00:00", "0001-01-01 00:00:00", "9999-12-31 23:59:59", "12", "", "yesterday",
                     "2024-05-10T00:00:00Z", "2024-05-10 25:00:00"]), one_in=8)


@st.composite
def trace_documents(draw):
    """(file name, bytes, load_trace keywords, rows) for a CSV or JSONL trace in one of the layouts, with
    hostile headers (BOM, a column twice, one missing), cells and column mappings now and then; rows are
    the (arrival, prompt, output) values written, when the file names them in the layout's own columns."""
    layout = draw(st.sampled_from(sorted(workload.TRACE_LAYOUTS)))
    names = dict(workload.TRACE_LAYOUTS[layout])
    kwargs = {"layout": layout}
    if draw(st.integers(0, 5)) == 0:
        mapping = draw(st.dictionaries(st.sampled_from(["arrival", "prompt_tokens", "output_tokens"]),
                                       st.sampled_from(["a", "b", names["arrival"], names["prompt_tokens"]]),
                                       min_size=1))
        kwargs["columns"] = mapping
        names.update(mapping)
    # dates as the Azure traces write them (2023: seven fraction digits; 2024: a UTC offset), or seconds
    dated = draw(st.integers(0, 2)) == 0
    kwargs["timestamps"] = "datetime" if dated else "seconds"
    if draw(st.integers(0, 3)) == 0:
        kwargs["rate"] = draw(st.sampled_from([0.5, 5.0, 1e-9, 1e5]))
    rows = draw(st.lists(st.tuples(DATE if dated else draw(CLOCKS), TOKENS, TOKENS), max_size=8))
    written = None if "columns" in kwargs else rows
    header = [names["arrival"], names["prompt_tokens"], names["output_tokens"]]
    if draw(st.integers(0, 8)) == 0:
        header = draw(st.sampled_from([header + [header[1]], header[:2], [header[0], header[0], header[2]]]))
        written = None
    if layout == "burstgpt" and len(header) == 3 and draw(st.booleans()):
        # BurstGPT's own file: Model, Total tokens and Log Type beside the three read
        header = [header[0], "Model", header[1], header[2], "Total tokens", "Log Type"]
        rows = [(row[0], "ChatGPT", row[1], row[2], 0, "Conversation log") for row in rows]
    if draw(st.booleans()):
        lines = [{column: value for column, value in zip(header, row)} for row in rows]
        text = "".join(json.dumps(line) + "\n" for line in lines)
        if draw(st.integers(0, 10)) == 0:
            text += "[" * 100 + "]" * 100 + "\n"
        name = "trace.jsonl"
    else:
        text = ",".join(header) + "\n" + "".join(",".join("" if v is None else str(v) for v in row) + "\n"
                                                 for row in rows)
        name = "trace.csv"
    data = text.encode()
    if draw(st.integers(0, 10)) == 0:
        data = b"\xef\xbb\xbf" + data
    return name, data, kwargs, written


def exact_arrivals(rows) -> list[Fraction]:
    """The arrivals of the rows a trace keeps (both token counts > 0), as the exact numbers their text
    writes, from the earliest on, in order."""
    kept = [Fraction(str(arrival)) for arrival, prompt, output in rows
            if float(str(prompt)) > 0 and float(str(output)) > 0]
    return sorted(arrival - min(kept) for arrival in kept)


@FAST
@given(trace_documents())
def test_every_trace_format_is_refused_in_one_line_or_replays_finite(tmp_path, document):
    name, data, kwargs, written = document
    path = tmp_path / name
    path.write_bytes(data)
    with hang_guard():
        try:
            loaded = workload.load_trace(path, **kwargs)
        except ValueError as exc:
            assert_one_line(str(exc))
            return
        trace = loaded.trace
        assert np.isfinite(trace.arrival_s).all() and (np.diff(trace.arrival_s) >= 0).all()
        assert trace.duration_s <= workload.MAX_TRACE_SPAN_S
        assert (trace.prompt_tokens >= 1).all() and (trace.output_tokens >= 1).all()
        if "rate" in kwargs and len(trace) > 1:
            assert len(trace) / trace.duration_s == pytest.approx(kwargs["rate"])
        if written is not None and kwargs["timestamps"] == "seconds" and "rate" not in kwargs and len(trace):
            # arrivals a microsecond apart as written stay that far apart: none merged by float64's resolution
            exact = exact_arrivals(written)
            assert np.abs(trace.arrival_s - np.array(exact, dtype=float)).max() <= workload.MIN_TRACE_SPAN_S, exact
        if len(trace) >= 2:  # what the config check lets through to the workload stage
            described = workload.describe({"rate": 2.0, "trace": {"path": str(path), **kwargs}})
            json.dumps(described, allow_nan=False)
        if len(trace):
            result = simulate(trace, costmodel.EXERCISE2, "continuous_chunked", 16, 512)
            assert_time_passes(result)
            assert_figures(metrics.summarize(result, metrics.SLO(ttft_ms=1000)).values())


@FAST
@given(st.data())
def test_a_workload_csv_is_refused_in_one_line_or_replays_its_own_times_finite(tmp_path, data):
    """--workload's CSV keeps its own times, replayed from time 0, on any of the CLOCKS."""
    rows = data.draw(st.lists(st.tuples(data.draw(CLOCKS), TOKENS, TOKENS), max_size=8))
    path = tmp_path / "trace.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens\n" + "".join(
        ",".join("" if value is None else str(value) for value in row) + "\n" for row in rows))
    with hang_guard():
        try:
            trace = workload.load_trace_csv(path)
        except ValueError as exc:
            assert_one_line(str(exc))
            return
        assert np.isfinite(trace.arrival_s).all() and (np.diff(trace.arrival_s) >= 0).all()
        assert trace.duration_s <= workload.MAX_TRACE_SPAN_S
        if len(trace):
            result = simulate(trace, costmodel.EXERCISE2, "continuous_chunked", 16, 512)
            assert_time_passes(result)
            assert_figures(metrics.summarize(result, metrics.SLO(ttft_ms=1000)).values())


def assert_time_passes(result) -> None:
    """Every first token comes after its request's arrival (the prefill takes time): on a clock too coarse
    for a step, at 1e300 s, it came at the arrival itself."""
    started = np.isfinite(result.first_token_s)
    assert (result.first_token_s[started] > result.arrival_s[started]).all()


# -- hardware targets: kind and launch overhead, on every target of the list -----------------------------

TARGET_SCHEMA = CONFIG_SCHEMA["properties"]["hardware"]["items"]


@st.composite
def hardware_targets(draw):
    """0 to 9 targets, each valid but for a kind, launch_overhead_ms, core_speedup and kv_memory drawn from
    the schema's allowed values and hostile ones, present or absent, in any combination."""
    targets = []
    for i in range(draw(st.integers(0, 9))):
        target = {"name": f"t{i}", "bandwidth_gbs": draw(st.sampled_from([0.1, 320.0, 100000])),
                  "gflops": draw(st.sampled_from([0.1, 8100.0, 10000000]))}
        for key in ("kind", "launch_overhead_ms", "core_speedup", "kv_memory"):
            if draw(st.booleans()):
                target[key] = draw(values_for(TARGET_SCHEMA["properties"][key]))
        targets.append(target)
    return targets


@FAST
@given(hardware_targets())
def test_hardware_kind_and_launch_overhead_are_refused_in_one_line_or_carry_over_finite(targets):
    from servingplan.memory import kv_blocks, memory_plan
    from servingplan.plan import hardware
    from servingplan.plan.hardware import memory_for, target_kv_memory
    from test_planner import MACHINE
    with hang_guard():
        if config_refused({**copy.deepcopy(QUICK), "hardware": targets}):
            event("refused")
            return
        event("checked")
        arch = architecture.architecture(QUICK["model"])
        here = {"name": "here", "bandwidth_gbs": 20.0, "gflops": 100.0}
        for target in targets:
            model, rows = hardware.carry_over(costmodel.EXERCISE2, arch, here, target)
            overhead = hardware.launch_overhead_s(target)
            assert math.isfinite(overhead) and overhead >= 0
            assert target.get("kind", "cpu") == "gpu" or overhead == 0
            speedup = hardware.core_speedup(target)
            assert math.isfinite(speedup) and 0.01 <= speedup <= 100
            assert target.get("kind", "cpu") == "cpu" or "core_speedup" not in target
            for row in rows:
                assert math.isfinite(row["seconds_target"]) and row["seconds_target"] >= row["floor_target_s"] >= 0
            assert model.decode_fixed_s >= overhead and model.prefill_fixed_s >= overhead
            # the KV model its cells simulate by is the one its memory verdict judges by, and both are finite
            memory_cfg = memory_for({**QUICK, "hardware": targets}, target["name"])
            for cap in (1, 8):
                blocks = kv_blocks(MACHINE, memory_cfg, cap)
                plan = memory_plan(cap, MACHINE["memory"]["param_bytes"],
                                   MACHINE["memory"]["kv_bytes_per_token"], memory_cfg, 0, blocks)
                assert plan["kv_memory"] == target_kv_memory(target)["model"] and blocks >= 0
                assert math.isfinite(plan["judged_bytes"]) and plan["pool_blocks"] == blocks


# -- what --save-result and --append-result find at the output path -----------------------------------------

EXISTING_RESULT = st.sampled_from([
    None,  # no file yet
    b"",
    json.dumps({"date": "20260101-000000", "request_rate": 5.0, "completed": 3}).encode() + b"\n",
    # vLLM's json.dump writes NaN for an undefined figure: such a file is a result file all the same
    b'{"date": "20260101-000000", "request_rate": 5.0, "mean_ttft_ms": NaN}',
    b"arrival_s,prompt_tokens,output_tokens\n0,10,5\n",
    b"[1, 2]", b'{"date": "x"}', b"\xff\xfe{}", b"[" * 3000 + b"]" * 3000, b'{"date": 1, "date": 2}',
])


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(EXISTING_RESULT, st.sampled_from(["--save-result", "--append-result"]), st.sampled_from([None, "2", "1"]))
def test_a_result_file_is_written_only_onto_a_result_file(capsys, tmp_path_factory, existing, flag, seeds):
    directory = tmp_path_factory.mktemp("existing")
    path = directory / "out.json"
    if existing is not None:
        path.write_bytes(existing)
    argv = [flag, "--result-dir", str(directory), "--result-filename", "out.json", "--num-requests", "20", "--json",
            "--seeds", seeds or "1"]
    with hang_guard():
        code = main(argv)
    out, err = capsys.readouterr()
    if code != 0:
        assert code == 2
        assert_one_line(err)
        assert path.read_bytes() == existing if existing is not None else not path.exists()
        return
    event("written")
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [] if not existing or flag == "--save-result" else [line for line in existing.decode().splitlines()
                                                               if line.strip()]
    assert lines[:len(kept)] == kept and len(lines) == len(kept) + int(seeds or 1)
    for line in lines[len(kept):]:
        assert_figures(json.loads(line, parse_constant=lambda name: pytest.fail(f"{name} written")).values())


# -- carry_over_check: a boolean; it runs when it can measure something, and is skipped, not refused, otherwise

@FAST
@given(check=values_for(CONFIG_SCHEMA["properties"]["carry_over_check"]), with_targets=st.booleans(),
       threads=st.sampled_from([0, 1, 2, 4]))
def test_carry_over_check_is_refused_only_when_not_a_boolean_and_skipped_with_its_reason(check, with_targets, threads):
    from servingplan.config import carry_over_check_skipped
    from servingplan.profile.machine import resolve_threads
    config = copy.deepcopy(QUICK)
    config.update(carry_over_check=check, hardware=config["hardware"] if with_targets else [])
    config["profile"]["threads"] = threads
    with hang_guard():
        refused = config_refused(config)
    assert (refused is None) == isinstance(check, bool), (check, refused)
    if refused is None:
        expected = ("off" if not check else "no target" if not with_targets
                    else "one thread" if resolve_threads(threads) < 2 else None)
        assert carry_over_check_skipped(config) == expected
    event("refused" if refused else "accepted")


# -- engine llamacpp's section: each key in its bounds and the cross-field rules, else one line

LLAMACPP_SECTION = CONFIG_SCHEMA["properties"]["llamacpp"]["properties"]
LLAMACPP_OVERLAY = yaml.safe_load((ROOT / "config" / "llamacpp.yaml").read_text())


@FAST
@given(values=st.fixed_dictionaries({key: mostly(plausible(value), values_for(LLAMACPP_SECTION[key]), one_in=3)
                                     for key, value in LLAMACPP_OVERLAY["llamacpp"].items()}))
def test_llamacpp_settings_are_refused_in_one_line_exactly_when_out_of_their_bounds(values):
    config = {**copy.deepcopy(QUICK), **copy.deepcopy(LLAMACPP_OVERLAY), "llamacpp": values}
    with hang_guard():
        refused = config_refused(config)

    def integer(value, low, high):
        return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high

    cap, profiled = QUICK["validation"]["cap"], max(QUICK["profile"]["prefill_lengths"])
    n_batch = values["n_batch"]
    valid = (integer(values["threads"], 0, os.cpu_count()) and integer(n_batch, max(profiled, cap + 1), 65536)
             and integer(values["n_ubatch"], 1, n_batch)
             and integer(values["split_n_batch"], cap + 1, QUICK["workload"]["prompt"]["max"] - 1))
    assert (refused is None) == valid, (values, refused)
    event("refused" if refused else "accepted")
