"""Issue 12's probes, rerun as a user meets them: every bad config, CLI call, cost model, trace file,
engine request mix and report title runs in its own process, and each outcome is counted as

    clear error   non-zero exit, one line on stderr, no traceback
    traceback     a Python traceback (or a multi-line / empty error)
    silent        exit 0 on an input that is wrong, or any figure negative, NaN or infinite
    hang          still running after the probe's time limit
    works         a valid input (the probes include some) ran and gave finite, non-negative figures

    python benchmarks/input_probes.py            # about a minute or two
    python benchmarks/input_probes.py --heavy    # adds ITL over 300,000 requests (minutes, GBs)
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, str(ROOT / "scripts" / "serving_sim.py")]
BASE = yaml.safe_load((ROOT / "config.yaml").read_text())
INJECTION = "ok\n\n# Fake section\n[x](javascript:alert(3))"
# fast CLI defaults so a probe that is accepted runs in a second
SMALL = ["--num-requests", "100", "--seeds", "1", "--json"]


def classify(proc_or_timeout, expect_ok: bool, figures_ok=lambda out: True) -> str:
    if proc_or_timeout is None:
        return "hang"
    proc = proc_or_timeout
    err = proc.stderr.strip()
    if "Traceback" in err:
        return "traceback"
    if proc.returncode != 0:
        return "clear error" if len(err.splitlines()) == 1 else "traceback"
    if not expect_ok or not figures_ok(proc.stdout):
        return "silent"
    return "works"


def run(argv, timeout: float):
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None


def finite_json(out: str) -> bool:
    """Every number in the JSON rows finite and >= 0 (null is an honest 'undefined')."""
    def walk(value):
        if isinstance(value, dict):
            return all(walk(v) for v in value.values())
        if isinstance(value, list):
            return all(walk(v) for v in value)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return math.isfinite(value) and value >= 0
        return True
    try:
        return walk(json.loads(out, parse_constant=lambda name: math.nan))
    except ValueError:
        return False


def finite_curve(out: str) -> bool:
    try:
        return all(math.isfinite(float(c)) and float(c) >= 0 for line in out.splitlines()[2:] for c in line.split())
    except ValueError:
        return False


# -- configs ---------------------------------------------------------------------------------------------

def leaves(node, path=()):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from leaves(value, path + (key,))
    elif isinstance(node, list):
        yield path, node
        yield from leaves(node[0], path + (0,))
    else:
        yield path, node


def with_value(path, value, base=BASE):
    config = copy.deepcopy(base)
    node = config
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return config


SCHEMA = yaml.safe_load((ROOT / "schemas" / "config.schema.yaml").read_text())


def schema_type(path) -> str | None:
    """The JSON-schema type the config schema gives the value at `path`."""
    node = SCHEMA
    for key in path:
        while "$ref" in node:
            node = SCHEMA["definitions"][node["$ref"].split("/")[-1]]
        node = node["items"] if isinstance(key, int) else node["properties"][key]
    while "$ref" in node:
        node = SCHEMA["definitions"][node["$ref"].split("/")[-1]]
    return node.get("type")


def config_probes():
    """(name, config, expect_ok): every numeric leaf with NaN, infinities, a negative, a string, null and
    (integers) a fraction and 10**12; the issue's named cases; the shipped configs."""
    probes = [("config.yaml", BASE, True),
              ("config/quick.yaml", yaml.safe_load((ROOT / "config" / "quick.yaml").read_text()), True)]
    for path, value in leaves(BASE):
        name = ".".join(map(str, path))
        if schema_type(path) not in ("number", "integer"):
            probes.append((f"{name} = null", with_value(path, None), False))
            continue
        bad = [math.nan, math.inf, -math.inf, -1, "abc", None]
        if schema_type(path) == "integer":
            bad.append(2.5)
            if path[0] != "reference":
                bad.append(10**12)
        probes += [(f"{name} = {v!r}", with_value(path, v), False) for v in bad]
    named = [(("capacity", "tolerance"), 1e-300), (("capacity", "rate_max"), math.inf),
             (("sweep", "seeds"), 1_000_000), (("workload", "output", "sigma"), math.nan),
             (("sweep", "rates"), [math.inf]), (("workload", "rate"), math.nan), (("memory", "budget_gb"), 0.0001),
             (("report", "title"), INJECTION), (("profile", "decode_batches"), [1, 100000]),
             (("profile", "probe_bytes"), 2**40), (("validation", "cap"), 100000)]
    probes += [(f"{'.'.join(p)} = {v!r} (issue)", with_value(p, v), False) for p, v in named]
    return probes


def run_config_probes(tmp: Path):
    outcomes = []
    for i, (name, config, expect_ok) in enumerate(config_probes()):
        path = tmp / f"config_{i}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        proc = run([sys.executable, "-m", "servingplan.config", str(path)], timeout=60)
        outcomes.append(("config", name, classify(proc, expect_ok), proc.stderr.strip() if proc else ""))
    return outcomes


# -- the CLI, cost models and traces ---------------------------------------------------------------------

def cost_documents():
    good = {"schema_version": 1, "name": "probe",
            "decode": {"fixed_s": 0.005, "per_seq_s": 0.0, "per_ctx_token_s": 4.3e-8},
            "prefill": {"fixed_s": 0.0, "per_token_s": 4.7e-5}}

    def changed(section, key, value):
        doc = copy.deepcopy(good)
        doc[section][key] = value
        return doc
    table = changed("decode", "batch_fixed_s", {"batches": [1, 8], "fixed_s": [0.004, -0.01]})
    return [
        ("valid", json.dumps(good), True),
        ("negative coefficients", json.dumps(changed("decode", "fixed_s", -0.03)), False),
        ("negative per-batch table", json.dumps(table), False),
        ("all zero", json.dumps({**good, "decode": {"fixed_s": 0, "per_seq_s": 0, "per_ctx_token_s": 0},
                                 "prefill": {"fixed_s": 0, "per_token_s": 0}}), False),
        ("NaN coefficient", json.dumps(changed("prefill", "per_token_s", math.nan)), False),
        ("infinite coefficient", json.dumps(changed("decode", "per_ctx_token_s", math.inf)), False),
        ("1e300 coefficient", json.dumps(changed("decode", "fixed_s", 1e300)), False),
        ("string coefficient", json.dumps(changed("decode", "fixed_s", "0.005")), False),
        ("missing key", json.dumps({**good, "prefill": {"fixed_s": 0.0}}), False),
        ("bad ctx_mode", json.dumps(changed("decode", "ctx_mode", "max")), False),
        ("table length mismatch", json.dumps(changed("decode", "batch_fixed_s",
                                                     {"batches": [1, 2], "fixed_s": [0.01]})), False),
        ("schema_version 2", json.dumps({**good, "schema_version": 2}), False),
        ("a JSON list", "[1, 2]", False),
        ("a JSON string", '"model"', False),
        ("not JSON", "decode: fast", False),
    ]


def trace_files():
    header = "arrival_s,prompt_tokens,output_tokens\n"
    return [
        ("valid", header + "".join(f"{i * 0.05},{100 + i},{20 + i % 7}\n" for i in range(60)), True),
        ("blank cell", header + "0.0,5,6\n0.1,,10\n", False),
        ("too many fields", header + "0.0,5,6,9\n0.1,5,10\n", False),
        ("too few fields", header + "0.0,5\n0.1,5,10\n", False),
        ("infinite arrival", header + "0.0,5,6\ninf,5,10\n", False),
        ("NaN arrival", header + "0.0,5,6\nnan,5,10\n", False),
        ("negative arrival", header + "-1,5,6\n", False),
        ("non-numeric cell", header + "0.1,abc,10\n", False),
        ("10^11 prompt tokens", header + "0.0,5,6\n0.1,100000000000,10\n0.2,5,6\n", False),
        ("zero output tokens", header + "0.0,5,0\n", False),
        ("fractional tokens", header + "0.0,5.5,6\n", False),
        ("empty file", "", False),
        ("missing column", "arrival_s,prompt_tokens\n0.0,5\n", False),
        ("header only", header, False),
    ]


def cli_probes(tmp: Path):
    """(name, argv, expect_ok, figures check)."""
    probes = [
        ("source command (exercise)", ["--policies", "continuous_chunked", "--rate", "20", "--slo-ttft-ms", "2000",
                                       "--slo-tpot-ms", "12", "--sweep-batch", "8,32", *SMALL], True, finite_json),
        ("ITL bound", ["--slo-itl-ms", "50", *SMALL], True, finite_json),
        ("print curve", ["--print-curve"], True, finite_curve),
    ]
    bad_values = {
        "--rate": ["0", "-3", "nan", "1e7", "x", ""], "--sweep-rate": ["1,,2", "0,5", "-inf", "nan,1"],
        "--max-num-seqs": ["0", "-1", "4.5", "x", "1e12"], "--sweep-batch": ["0,4", "4,eight", ",", "1e12"],
        "--chunk-size": ["0", "-5", "1e12"], "--seeds": ["0", "-1", "1e12", "1000000000000", "1,x", "1,-2"],
        "--num-requests": ["0", "-5", "1e12", "1000000000000", "nan"],
        "--slo-ttft-ms": ["0", "-3", "nan", "inf"], "--slo-tpot-ms": ["0", "nan", "inf"],
        "--slo-itl-ms": ["0", "-1", "nan"], "--slo-ttft-pct": ["101", "-1", "nan"], "--slo-tpot-pct": ["200"],
        "--slo-itl-pct": ["inf"], "--kv-blocks": ["0", "-1", "1e12"], "--block-size": ["0", "1e9"],
        "--curve-context": ["0", "-1", "1e12"], "--policies": ["fifo", "static,fifo", ""],
        "--workload": ["no_such_trace.csv", str(tmp)], "--cost-model": ["no_such_model.json", str(tmp)],
    }
    for option, values in bad_values.items():
        probes += [(f"{option} {v!r}", [option, v, *SMALL], False, finite_json) for v in values]
    probes.append(("--num-requests 1000000 x 50 seeds", ["--num-requests", "1000000", "--seeds", "50"], False,
                   finite_json))
    probes.append(("unknown option", ["--frobnicate", "3"], False, finite_json))
    probes += load_shape_probes(tmp)
    for i, (name, text, ok) in enumerate(cost_documents()):
        path = tmp / f"cost_{i}.json"
        path.write_text(text)
        probes.append((f"cost model: {name}", ["--cost-model", str(path), *SMALL], ok, finite_json))
        probes.append((f"cost model: {name} --print-curve", ["--cost-model", str(path), "--print-curve"], ok,
                       finite_curve))
    for i, (name, text, ok) in enumerate(trace_files()):
        path = tmp / f"trace_{i}.csv"
        path.write_text(text)
        probes.append((f"trace: {name}", ["--workload", str(path), "--json"], ok, finite_json))
    return probes


def load_shape_probes(tmp: Path):
    """Issue 21's flags: vLLM's load shapes, the result file's options, --max-context and the users search."""
    out = tmp / "results"
    out.mkdir(exist_ok=True)
    long_trace = tmp / "long_trace.csv"
    long_trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,100,20\n1,900,20\n")
    probes = [
        ("rate inf", ["--rate", "inf", *SMALL], True, finite_json),
        ("burstiness 0.5", ["--burstiness", "0.5", *SMALL], True, finite_json),
        ("burstiness inf", ["--burstiness", "inf", *SMALL], True, finite_json),
        ("max concurrency 8", ["--max-concurrency", "8", *SMALL], True, finite_json),
        ("rate inf, max concurrency 1", ["--rate", "inf", "--max-concurrency", "1", *SMALL], True, finite_json),
        ("save result", ["--save-result", "--result-dir", str(out), "--metadata", "a=1", "--percentile-metrics",
                         "ttft,e2el", "--save-detailed", *SMALL], True, finite_json),
        ("append result", ["--append-result", "--result-dir", str(out), "--result-filename", "all.json", *SMALL],
         True, finite_json),
        ("capacity users", ["--capacity-users", "16", "--slo-ttft-ms", "2000", *SMALL], True, finite_json),
        ("max context skip", ["--trace", str(long_trace), "--max-context", "512", "--too-long", "skip", "--json"],
         True, finite_json),
    ]
    bad_values = {
        "--burstiness": ["0", "-1", "nan", "1e-9", "1e9", "x"], "--max-concurrency": ["0", "-1", "2.5", "1e12", "x"],
        "--percentile-metrics": ["", "ttft,,e2el", "goodput"], "--metadata": ["novalue", "=v", "1a=b"],
        "--result-date": ["2026", "20261301-000000", "x"], "--result-filename": ["a/b.json", ".."],
        "--label": ["a/b"], "--max-context": ["0", "-1", "1e12"], "--too-long": ["truncate"],
        "--capacity-users": ["0", "1e12"],
    }
    for option, values in bad_values.items():
        probes += [(f"{option} {v!r}", [option, v, *SMALL], False, finite_json) for v in values]
    probes += [
        ("metadata shadowing a result key", ["--save-result", "--result-dir", str(out), "--metadata", "completed=1",
                                             *SMALL], False, finite_json),
        ("two runs into one file without --append-result", ["--save-result", "--result-dir", str(out),
                                                            "--result-filename", "x.json", "--seeds", "2", "--json"],
         False, finite_json),
        ("result dir a file", ["--save-result", "--result-dir", str(long_trace), *SMALL], False, finite_json),
        ("max context without a trace", ["--max-context", "512", *SMALL], False, finite_json),
        ("burstiness on a trace file", ["--trace", str(long_trace), "--burstiness", "2", "--json"], False, finite_json),
        ("users without an SLO", ["--capacity-users", "8", *SMALL], False, finite_json),
    ]
    return probes


def run_cli_probes(tmp: Path, heavy: bool):
    probes = cli_probes(tmp)
    if heavy:
        probes.append(("ITL over 300,000 requests", ["--slo-itl-ms", "50", "--num-requests", "300000", "--seeds", "1",
                                                     "--sweep-batch", "64", "--json"], True, finite_json))
    outcomes = []
    for name, argv, ok, figures in probes:
        proc = run(CLI + argv, timeout=900 if "300,000" in name else 180)
        outcomes.append(("cli", name, classify(proc, ok, figures), proc.stderr.strip()[-300:] if proc else ""))
    return outcomes


# -- the engine and the report ---------------------------------------------------------------------------

ENGINE_SCRIPT = """
import json, math, sys
import numpy as np
from servingplan.architecture import QUICK_CONFIG_OVERRIDES
from servingplan.profiling.model import load_model
from servingplan.serving import Engine
from servingplan.serving.engine import request_problem
from servingplan.workload import Trace
arrivals, prompts, outputs = json.loads(sys.argv[1])
model = load_model("random", 0, QUICK_CONFIG_OVERRIDES)[0]
trace = Trace(np.array(arrivals, dtype=float), np.array(prompts, dtype=np.int64), np.array(outputs, dtype=np.int64))
run = Engine(model, "continuous", 4, threads=1).run(trace, max_wall_s=60.0)
n = model.config.n_positions
valid = [request_problem(p, o, n, a) is None for a, p, o in zip(arrivals, prompts, outputs)]
served = all(bool(f) for f, v in zip(run.result.finished, valid) if v)
refused = all(i in run.errors for i, v in enumerate(valid) if not v)
print(json.dumps({"served": served, "refused": refused, "truncated": bool(run.result.truncated)}))
"""


def engine_probes():
    nan = float("nan")
    return [
        ("three small requests", ([0.0, 0.01, 0.02], [12, 10, 9], [4, 5, 3]), True),
        ("10^11 prompt tokens among three", ([0.0, 0.01, 0.02], [12, 10**11, 9], [4, 5, 3]), False),
        ("10^8 prompt tokens among three", ([0.0, 0.01, 0.02], [12, 10**8, 9], [4, 5, 3]), False),
        ("NaN arrival", ([0.0, nan, 0.02], [12, 8, 9], [4, 5, 3]), False),
        ("infinite arrival", ([0.0, float("inf")], [12, 8], [4, 5]), False),
        ("negative arrival", ([-1.0, 0.0], [12, 8], [4, 5]), False),
        ("zero prompt tokens", ([0.0, 0.0], [0, 8], [4, 5]), False),
        ("zero output tokens", ([0.0, 0.0], [5, 8], [0, 5]), False),
        ("past n_positions", ([0.0, 0.0], [1000, 8], [100, 5]), False),
    ]


def run_engine_probes():
    outcomes = []
    for name, columns, ok in engine_probes():
        proc = run([sys.executable, "-c", ENGINE_SCRIPT, json.dumps(columns)], timeout=180)
        if proc is None or proc.returncode != 0:
            outcome = classify(proc, ok)
        else:
            result = json.loads(proc.stdout)
            # a bad request the engine refuses while serving the rest is a clear, per-request error
            handled = result["served"] and result["refused"] and not result["truncated"]
            outcome = ("works" if ok else "clear error") if handled else "silent"
        outcomes.append(("engine", name, outcome, proc.stderr.strip()[-300:] if proc else ""))
    return outcomes


# an unescaped link or image opener, a heading, or a line break
MARKDOWN_STRUCTURE = re.compile(r"(?<!\\)\[[^\]]*(?<!\\)\]\(|^#|\n")


def run_title_probes():
    """Titles the schema lets through must render as text in report.md: no heading, link or image."""
    sys.path.insert(0, str(ROOT))
    from servingplan.report.text import markdown_text
    titles = ["[x](javascript:alert(3))", "![](http://example.com/x.png)", "# heading", "a *b* _c_ `d`",
              "<script>alert(1)</script>", "ok | table | cell"]
    return [("report title", title, "silent" if MARKDOWN_STRUCTURE.search(markdown_text(title)) else "works", "")
            for title in titles]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heavy", action="store_true", help="add the 300,000-request ITL probe")
    parser.add_argument("--details", action="store_true", help="print every probe that is not a clear error")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        outcomes = (run_config_probes(Path(tmp)) + run_cli_probes(Path(tmp), args.heavy) + run_engine_probes()
                    + run_title_probes())
    kinds = ["clear error", "works", "traceback", "silent", "hang"]
    print(f"{'probes':<14}{'tried':>6}" + "".join(f"{k:>13}" for k in kinds))
    for group in dict.fromkeys(o[0] for o in outcomes):
        counts = Counter(o[2] for o in outcomes if o[0] == group)
        print(f"{group:<14}{sum(counts.values()):>6}" + "".join(f"{counts[k]:>13}" for k in kinds))
    counts = Counter(o[2] for o in outcomes)
    print(f"{'total':<14}{len(outcomes):>6}" + "".join(f"{counts[k]:>13}" for k in kinds))
    if args.details:
        for group, name, outcome, err in outcomes:
            if outcome not in ("clear error", "works"):
                print(f"{outcome}: {group}: {name}: {err}")
    return 0 if counts["traceback"] + counts["silent"] + counts["hang"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
