"""Issues 12 and 19's probes and those of the keys, flags and formats added since, rerun as a user
meets them: every bad config (every key the config schema lists, optional ones included, and a
misspelling of each section's keys; hardware targets' kind and launch overhead, the closed loop and
burstiness), CLI call (every flag, good and bad values), cost model (every key misspelled, the meta
keys the pipeline reads), trace file (CSV and JSONL, every layout: Azure 2023 and 2024, BurstGPT), output
path and the file found there (a vLLM result file to append to, or not), special file (FIFO, /dev/zero,
symlink, directory), engine request mix and free text reaching the report runs in its own process,
and each outcome is counted as

    clear error   non-zero exit, one line on stderr, no traceback (naming what the probe says it must)
    traceback     a Python traceback, or an error that is not that one clear line (several lines,
                  empty, or not naming the key, file or misspelled key meant)
    silent        exit 0 on an input that is wrong, or any figure negative, NaN or infinite, or a
                  result file that is not JSON objects, one a line
    hang          still running after the probe's time limit
    works         a valid input (the probes include some) ran and gave finite, non-negative figures

    nice python benchmarks/input_probes.py --jobs 2   # minutes; not a timing benchmark
    python benchmarks/input_probes.py --heavy         # adds ITL over 300,000 requests (minutes, GBs)
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import re
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
# the config and cost-model setter the generative suite uses too (tests/helpers.py)
sys.path.insert(1, str(ROOT / "tests"))
from helpers import set_path  # noqa: E402
CLI = [sys.executable, str(ROOT / "scripts" / "serving_sim.py")]
BASE = yaml.safe_load((ROOT / "config.yaml").read_text())
INJECTION = "ok\n\n# Fake section\n[x](javascript:alert(3))"
# fast CLI defaults so a probe that is accepted runs in a second
SMALL = ["--num-requests", "100", "--seeds", "1", "--json"]


def classify(proc_or_timeout, expect_ok: bool, figures_ok=lambda out: True, must_say=()) -> str:
    """The outcome of one probe; `must_say` holds a pattern its refusal must match (the key or file
    it names, the key meant by a misspelling): a refusal that says something else is no clear error."""
    if proc_or_timeout is None:
        return "hang"
    proc = proc_or_timeout
    err = proc.stderr.strip()
    if "Traceback" in err:
        return "traceback"
    if proc.returncode != 0:
        clear = len(err.splitlines()) == 1 and all(re.search(pattern, err) for pattern in must_say)
        return "clear error" if clear else "traceback"
    if not expect_ok or not figures_ok(proc.stdout):
        return "silent"
    return "works"


def run(argv, timeout: float):
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return None


class Finished:
    """What a probe process left: its exit code and its stdout and stderr text."""
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


# probes run at once (--jobs): each in its own forked process, so they share nothing but the files
# they name, and every probe writing a file names its own
JOBS = 1


def run_all(entry, argvs, timeouts, jobs: int | None = None):
    """`entry(argv)` (an entry point's main) for every argv of `argvs`, each in a child forked from this
    process, which has imported the package once: every probe still runs in its own process, with its
    own exit code and output, and one still running after its timeout is a hang (killed: outcome None),
    without paying Python's start-up per probe. At most `jobs` (default JOBS) run at once; the
    outcomes come in the order of `argvs`."""
    import io
    import multiprocessing
    import time
    import traceback
    from contextlib import redirect_stderr, redirect_stdout
    from multiprocessing.connection import wait

    def child(connection, argv):
        out, err = io.StringIO(), io.StringIO()
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = entry(argv)
            except SystemExit as exit_:
                code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
            except BaseException:
                traceback.print_exc()
                code = 1
        connection.send((code or 0, out.getvalue(), err.getvalue()))
        connection.close()

    context = multiprocessing.get_context("fork")
    outcomes, waiting, running = [None] * len(argvs), list(range(len(argvs))), {}
    while waiting or running:
        while waiting and len(running) < (jobs or JOBS):
            i = waiting.pop(0)
            receiver, sender = context.Pipe(duplex=False)
            process = context.Process(target=child, args=(sender, argvs[i]))
            process.start()
            sender.close()
            running[receiver] = (i, process, time.monotonic() + timeouts[i])
        ready = wait(list(running), timeout=max(0.0, min(end for _, _, end in running.values()) - time.monotonic()))
        for receiver in list(running):
            i, process, end = running[receiver]
            if receiver in ready:
                try:
                    code, out, err = receiver.recv()
                except EOFError:
                    code, out, err = process.exitcode, "", "Traceback: the probe process died"
                outcomes[i] = Finished(code, out, err)
            elif time.monotonic() < end:
                continue
            else:
                process.kill()  # still running after its time limit: a hang, outcome None
            process.join()
            receiver.close()
            del running[receiver]
    return outcomes


def config_entry(argv):
    """What `python -m servingplan.config PATH` runs."""
    from servingplan import config as config_module
    try:
        config = config_module.read(argv[0])
    except config_module.ConfigError as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(2)
    config_module.check_or_exit(config)
    print("config ok")
    return 0


def cli_entry(argv):
    """What `python scripts/serving_sim.py ARGS` runs."""
    from servingplan.cli.main import main as cli_main
    return cli_main(argv)


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


def schema_nodes(node=None, path=()):
    """(path, sub-schema) of every key the config schema lists, optional ones included."""
    node = SCHEMA if node is None else node
    while "$ref" in node:
        node = SCHEMA["definitions"][node["$ref"].split("/")[-1]]
    yield path, node
    for key, child in node.get("properties", {}).items():
        yield from schema_nodes(child, path + (key,))
    if isinstance(node.get("items"), dict):
        yield from schema_nodes(node["items"], path + (0,))


def trace_base(tmp: Path) -> dict:
    """config.yaml replaying a valid trace file, the base of every workload.trace probe."""
    path = tmp / "base_trace.csv"
    path.write_text("arrival_s,prompt_tokens,output_tokens\n" + "".join(f"{i / 6:.4f},{20 + i},{8 + i % 5}\n"
                                                                       for i in range(60)))
    config = copy.deepcopy(BASE)
    config["workload"]["trace"] = {"path": str(path)}
    return config


def special_files(tmp: Path) -> dict:
    fifo, zero = tmp / "fifo.csv", tmp / "zero.csv"
    if not fifo.exists():
        os.mkfifo(fifo)
        zero.symlink_to("/dev/zero")
    return {"FIFO": fifo, "link to /dev/zero": zero, "directory": tmp}


def issue19_trace_texts():
    """(name, file name, content, trace keys): trace files of issue 19, every one to be refused."""
    header = "arrival_s,prompt_tokens,output_tokens\n"
    return [
        ("span of 1e300 s", "span.csv", header + "0,10,5\n1e300,10,5\n", {}),
        ("one timestamp for every row", "burst.csv", header + "".join(f"3.5,{10 + i},5\n" for i in range(20)), {}),
        ("arrivals at 0 and 1e-320", "subnormal.csv", header + "0,10,5\n1e-320,12,6\n", {}),
        ("duplicated header", "dup.csv", "arrival_s,prompt_tokens,output_tokens,prompt_tokens\n0,100,5,7\n1,120,6,7\n", {}),
        ("BOM before the header", "bom.csv", "\ufeff" + header + "0,10,5\n1,12,6\n", {}),
        ("field over 128 KiB", "field.csv", header + "0,10,5\n1," + "9" * 200_000 + ",5\n", {}),
        ("deeply nested JSONL", "deep.jsonl", "[" * 50_000 + "]" * 50_000 + "\n", {}),
        ("JSONL key twice", "dupkey.jsonl", '{"arrival_s": 0, "prompt_tokens": 9, "output_tokens": 5, "prompt_tokens": 7}\n', {}),
        ("JSONL NaN", "nan.jsonl", '{"arrival_s": NaN, "prompt_tokens": 9, "output_tokens": 5}\n', {}),
        ("not UTF-8", "latin1.csv", None, {}),
        ("columns: two fields one column", "cols.csv", header + "0,10,5\n1,12,6\n",
         {"columns": {"prompt_tokens": "output_tokens"}}),
        ("columns: all three one column", "cols3.csv", header + "0,10,5\n1,12,6\n",
         {"columns": {"arrival": "prompt_tokens", "prompt_tokens": "prompt_tokens", "output_tokens": "prompt_tokens"}}),
        ("azure layout on a seconds file", "azure.csv", header + "0,10,5\n1,12,6\n", {"layout": "azure"}),
        ("datetime timestamps of seconds", "dt.csv", header + "0,10,5\n1,12,6\n", {"timestamps": "datetime"}),
        # the generative suite's find: the 0-token row at 1e300 s was skipped before the span was checked
        ("Azure seconds, a skipped row at 1e300 s beside 0 and 1e-320", "azure_skipped.csv",
         "TIMESTAMP,ContextTokens,GeneratedTokens\n1e+300,0,5\n0.0,10,5\n1e-320,12,6\n",
         {"layout": "azure", "timestamps": "seconds"}),
        ("seconds at 1e20, a second apart (one float)", "e20.csv",
         header + "100000000000000000000,10,5\n100000000000000000001,12,6\n", {}),
        ("subnormal seconds only", "subnormals.csv", header + "5e-324,10,5\n1e-320,12,6\n2.2e-308,9,4\n", {}),
        ("dates in the year 9999 (float64 resolves 31 us)", "y9999.csv",
         "TIMESTAMP,ContextTokens,GeneratedTokens\n9999-12-31 23:59:59,10,5\n9999-12-31 23:59:59.5,12,6\n",
         {"layout": "azure"}),
    ]


def write_trace_text(tmp: Path, name: str, text) -> Path:
    path = tmp / f"i19_{name}"
    if text is None:
        path.write_bytes(b"arrival_s,prompt_tokens,output_tokens\n0,10,5\n1,12,\xe96\n")
    else:
        path.write_text(text)
    return path


def config_probes_19(tmp: Path):
    """Every key the schema lists that config.yaml leaves out (workload.trace, costmodel, hardware, ...)
    with bad values; a misspelling of every section's first key; issue 19's trace and cost-model files."""
    base = trace_base(tmp)
    present = {path for path, _ in leaves(BASE)}
    probes = [("trace config (valid)", base, True)]
    for path, node in schema_nodes():
        if not path or path in present or path[-1] == 0:
            continue
        name = ".".join(map(str, path))
        start = base if path[:2] == ("workload", "trace") else BASE
        kind = node.get("type")
        if kind in ("number", "integer"):
            bad = [math.nan, -1, "abc", None] + ([2.5, 10**12] if kind == "integer" else [math.inf])
        elif kind == "string":
            bad = [None, 3, "", "x" * 5000]
        elif "enum" in node:
            bad = ["no_such", None, 3]
        elif kind == "object":
            bad = ["text", [], {"no_such_key": 1}]
        elif kind == "array":
            bad = ["text", [None], [{}]]
        else:
            bad = [None, "text"]
        probes += [(f"{name} = {v!r:.40}", set_path(copy.deepcopy(start), path, v), False) for v in bad]
    for path, node in schema_nodes():
        if node.get("type") == "object" and node.get("properties") and 0 not in path:
            first = sorted(node["properties"])[0]
            start = base if path[:2] == ("workload", "trace") else BASE
            config = copy.deepcopy(start)
            target = config
            for key in path:
                target = target.setdefault(key, {})
            target[first[:-1] or first + "x"] = 1
            probes.append((f"misspelled key {'.'.join(path + (first[:-1] or first + 'x',))}", config, False))
    for label, special in special_files(tmp).items():
        probes.append((f"workload.trace.path is a {label}", set_path(copy.deepcopy(base), ("workload", "trace", "path"),
                                                                     str(special)), False))
        probes.append((f"costmodel.source is a {label}", {**copy.deepcopy(BASE), "costmodel": {"source": str(special)},
                                                          "hardware": []}, False))
    for name, file_name, text, keys in issue19_trace_texts():
        path = write_trace_text(tmp, file_name, text)
        config = copy.deepcopy(base)
        config["workload"]["trace"] = {"path": str(path), **keys}
        probes.append((f"trace: {name}", config, False))
    for i, (name, text, ok) in enumerate(cost_documents_19()):
        path = tmp / f"config_cost_{i}.json"
        path.write_text(text)
        probes.append((f"costmodel.source: {name}", {**copy.deepcopy(BASE), "costmodel": {"source": str(path)},
                                                     "hardware": []}, ok))
    return probes


def config_probes_since_19(tmp: Path):
    """Keys added since issue 19's round, one case per good and bad value: hardware targets' kind,
    launch_overhead_ms and core_speedup, workload.max_concurrency and workload.burstiness (with a trace file too), and
    the cost model's meta keys the pipeline reads (speed_band, profiled_range) through costmodel.source."""
    gpu = next(i for i, target in enumerate(BASE["hardware"]) if target.get("kind") == "gpu")
    cpu = next(i for i, target in enumerate(BASE["hardware"]) if target.get("kind", "cpu") == "cpu")

    def at(path, value, base=BASE):
        return set_path(copy.deepcopy(base), path, value)
    probes = [(f"hardware[{cpu}].kind = 'cpu'", at(("hardware", cpu, "kind"), "cpu"), True)]
    probes += [(f"hardware[{gpu}].launch_overhead_ms = {v!r}", at(("hardware", gpu, "launch_overhead_ms"), v), True)
               for v in (0, 0.01, 2.5, 1000)]
    probes += [(f"hardware[{gpu}].kind = {v!r:.30}", at(("hardware", gpu, "kind"), v), False)
               for v in ("tpu", "GPU", "", None, 3, True, ["gpu"], {}, "g" * 5000)]
    probes += [(f"hardware[{gpu}].launch_overhead_ms = {v!r}", at(("hardware", gpu, "launch_overhead_ms"), v), False)
               for v in (math.nan, math.inf, -math.inf, -1, -1e-9, 1000.5, 1e300, 10**13, "2.5",
                         True, None, [], {})]
    probes += [(f"hardware[{cpu}].core_speedup = {v!r}", at(("hardware", cpu, "core_speedup"), v), True)
               for v in (0.01, 0.5, 1, 3.7, 100)]
    probes += [(f"hardware[{cpu}].core_speedup = {v!r}", at(("hardware", cpu, "core_speedup"), v), False)
               for v in (math.nan, math.inf, -1, 0, 0.009, 100.5, 1e300, "2", True, None, [], {})]
    probes += [(f"hardware[{gpu}].core_speedup on a gpu", at(("hardware", gpu, "core_speedup"), 2.0), False)]
    probes += [
        (f"hardware[{cpu}].launch_overhead_ms on a cpu", at(("hardware", cpu, "launch_overhead_ms"), 2.5), False),
        (f"hardware[{cpu}] kind cpu with launch_overhead_ms 0",
         at(("hardware", cpu, "launch_overhead_ms"), 0, at(("hardware", cpu, "kind"), "cpu")), False),
        ("hardware of 8 gpu targets", at(("hardware",), [{"name": f"g{i}", "bandwidth_gbs": 300 + i, "gflops": 8000,
                                                          "kind": "gpu", "launch_overhead_ms": i} for i in range(8)]),
         True),
        ("hardware of 9 targets", at(("hardware",), [{"name": f"g{i}", "bandwidth_gbs": 300, "gflops": 8000}
                                                     for i in range(9)]), False),
        ("hardware target misspelled kinds", at(("hardware", gpu, "kinds"), "gpu"), False),
        ("hardware target misspelled launch_overhead", at(("hardware", gpu, "launch_overhead"), 2.5), False),
        ("hardware with an imported cost model",
         {**copy.deepcopy(BASE), "costmodel": {"source": str(cost_file(tmp, "hw", {}))}}, False),
    ]
    probes += [(f"carry_over_check = {v!r}", at(("carry_over_check",), v), True) for v in (True, False)]
    probes += [(f"carry_over_check = {v!r:.30}", at(("carry_over_check",), v), False)
               for v in ("true", "yes", 1, 0, None, [], {}, math.nan)]
    probes += [
        # a check that cannot measure anything is skipped, not refused (the report says why)
        ("carry_over_check without hardware targets", at(("hardware",), [], at(("carry_over_check",), True)), True),
        ("carry_over_check with a 1-thread profile", at(("profile", "threads"), 1, at(("carry_over_check",), True)),
         True),
        ("misspelled carry_over_checks", at(("carry_over_checks",), True), False, "carry_over_checks"),
    ]
    probes += [(f"workload.max_concurrency = {v!r}", at(("workload", "max_concurrency"), v), True)
               for v in (1, 8, 1_000_000)]
    probes += [(f"workload.max_concurrency = {v!r}", at(("workload", "max_concurrency"), v), False)
               for v in (0, -1, 2.5, 8.0, 1_000_001, 10**12, math.nan, math.inf, "8", True, None, [8])]
    probes += [(f"workload.burstiness = {v!r}", at(("workload", "burstiness"), v), True)
               for v in (0.001, 0.5, 1, 1e6)]
    probes += [(f"workload.burstiness = {v!r}", at(("workload", "burstiness"), v), False)
               for v in (0, 0.0009, 1e-320, -1, 1e7, math.nan, math.inf, -math.inf, "1", True, None, [1])]
    base = trace_base(tmp)
    probes += [
        ("workload.max_concurrency with a trace file", at(("workload", "max_concurrency"), 4, base), True),
        ("workload.burstiness with a trace file (which keeps its own arrivals)",
         at(("workload", "burstiness"), 2.0, base), False, "burstiness"),
        ("workload.misspelled max_concurency", at(("workload", "max_concurency"), 4), False, "max_concurency"),
        # a rate spreading the workload past the 1e8 s a simulation replays (1e-320: the workload
        # description's replayed span and gap scale were infinite)
        ("workload.rate = 1e-320 with a trace file", at(("workload", "rate"), 1e-320, base), False, "workload.rate"),
        ("workload.rate = 6e-07 with a trace file (60 requests over 1e8 s)", at(("workload", "rate"), 6e-07, base),
         True),
        ("workload.rate = 1e-09", at(("workload", "rate"), 1e-09), False, "workload.rate"),
        ("sweep.rates with 1e-09", at(("sweep", "rates"), [1, 1e-09]), False, r"sweep\.rates\[1\]"),
        ("slo.capacity_target_rate = 1e-09", at(("slo", "capacity_target_rate"), 1e-09), False,
         "slo.capacity_target_rate"),
        ("capacity.rate_min = 1e-300", at(("capacity", "rate_min"), 1e-300), False, "capacity.rate_min"),
        ("exercise2.rate = 1e-09", at(("exercise2", "rate"), 1e-09), False, "exercise2.rate"),
    ]
    probes += llamacpp_probes(at)
    # the cost model's meta keys the pipeline reads, through costmodel.source (no hardware: a file has no probes)
    for name, text, ok, *say in cost_documents_since_19():
        path = tmp / f"meta_{len(probes)}.json"
        path.write_text(text)
        probes.append((f"costmodel.source: {name}", {**copy.deepcopy(BASE), "costmodel": {"source": str(path)},
                                                     "hardware": []}, ok, *say))
    return probes


LLAMACPP_OVERLAY = yaml.safe_load((ROOT / "config" / "llamacpp.yaml").read_text())


def llamacpp_probes(at):
    """`engine` and the `llamacpp:` section (issue 22): every key's good and bad values on
    config/llamacpp.yaml, and each cross-field refusal, naming its key."""
    llama = {**copy.deepcopy(BASE), **copy.deepcopy(LLAMACPP_OVERLAY)}
    probes = [("config/llamacpp.yaml", llama, True),
              ("engine = 'torch' (the default)", at(("engine",), "torch"), True)]
    probes += [(f"engine = {v!r:.30}", at(("engine",), v), False, "engine")
               for v in ("llama.cpp", "LLAMACPP", "", None, 3, True, ["llamacpp"], {})]
    good = {"threads": (0, 1, os.cpu_count()), "n_batch": (512, 2048, 65536), "n_ubatch": (1, 64, 512),
            "split_n_batch": (9, 128, 511)}
    for key, values in good.items():
        probes += [(f"llamacpp.{key} = {v!r}", at(("llamacpp", key), v, llama), True) for v in values]
        probes += [(f"llamacpp.{key} = {v!r:.30}", at(("llamacpp", key), v, llama), False, f"llamacpp.{key}")
                   for v in (math.nan, math.inf, -math.inf, -1, 2.5, 128.0, 10**12, "128", True, None, [128], {})]
    probes += [
        ("llamacpp.n_batch = 0", at(("llamacpp", "n_batch"), 0, llama), False, "llamacpp.n_batch"),
        ("llamacpp.threads above the machine's cores", at(("llamacpp", "threads"), (os.cpu_count() or 1) + 1, llama),
         False, "llamacpp.threads"),
        ("llamacpp.n_ubatch above n_batch", at(("llamacpp", "n_ubatch"), 4096, llama), False, "llamacpp.n_ubatch"),
        ("llamacpp.n_batch below the longest profiled prompt", at(("llamacpp", "n_batch"), 256,
                                                                  at(("llamacpp", "n_ubatch"), 256, llama)),
         False, "llamacpp.n_batch"),
        ("llamacpp.split_n_batch at the validation cap", at(("llamacpp", "split_n_batch"), 8, llama), False,
         "llamacpp.split_n_batch"),
        ("llamacpp.split_n_batch at the longest prompt", at(("llamacpp", "split_n_batch"), 512, llama), False,
         "llamacpp.split_n_batch"),
        ("engine llamacpp without its section", at(("engine",), "llamacpp"), False, "llamacpp"),
        ("a llamacpp section without engine llamacpp", {**copy.deepcopy(BASE), "llamacpp": LLAMACPP_OVERLAY["llamacpp"]},
         False, "llamacpp"),
        ("engine llamacpp with a checkpoint", at(("model", "source"), "no/such/dir", llama), False, "model.source"),
        ("engine llamacpp on cuda", at(("model", "device"), "cuda", llama), False, "model.device"),
        ("llamacpp misspelled n_batchs", at(("llamacpp", "n_batchs"), 2048, llama), False, "n_batchs"),
        ("llamacpp without n_ubatch", {**llama, "llamacpp": {k: v for k, v in llama["llamacpp"].items()
                                                             if k != "n_ubatch"}}, False, "llamacpp.n_ubatch"),
    ]
    return probes


def config_file_probes(tmp: Path):
    """Config files that are no plain YAML mapping: special files, anchors expanding to billions."""
    laughs = tmp / "laughs.yaml"
    laughs.write_text("a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8)))
    deep = tmp / "deep.yaml"
    deep.write_text("a: " + "[" * 20_000 + "]" * 20_000 + "\n")
    files = {"YAML anchors expanding to 10^9 values": laughs, "YAML nested 20,000 deep": deep}
    files.update({f"a {label}": path for label, path in special_files(tmp).items()})
    return files


def config_probes_since_34(tmp: Path):
    """Keys added since issue 34: how this machine's and each target's engine holds KV (memory.kv_memory,
    hardware[].kv_memory), and the GPU check a run reads (gpu_check)."""
    gpu = next(i for i, target in enumerate(BASE["hardware"]) if target.get("kind") == "gpu")

    def at(path, value, base=BASE):
        return set_path(copy.deepcopy(base), path, value)
    probes = [(f"memory.kv_memory = {v!r}", at(("memory", "kv_memory"), v), True) for v in ("paged", "slots")]
    probes += [(f"hardware[{gpu}].kv_memory = {v!r}", at(("hardware", gpu, "kv_memory"), v), True)
               for v in ("paged", "slots")]
    bad = ("Paged", "vllm", "", None, 0, True, ["paged"], {}, "p" * 5000)
    probes += [(f"memory.kv_memory = {v!r:.30}", at(("memory", "kv_memory"), v), False, "memory.kv_memory")
               for v in bad]
    probes += [(f"hardware[{gpu}].kv_memory = {v!r:.30}", at(("hardware", gpu, "kv_memory"), v), False,
                r"hardware\[\d\]\.kv_memory") for v in bad]
    probes += [("memory.misspelled kv_memroy", at(("memory", "kv_memroy"), "paged"), False, "kv_memroy")]
    not_json = tmp / "gpu_check_not_json.json"
    not_json.write_text("{not json")
    probes += [("gpu_check = null", at(("gpu_check",), None), True)]
    probes += [(f"gpu_check = {name}", at(("gpu_check",), value), False, "gpu_check")
               for name, value in (("a missing file", str(tmp / "no_such_check.json")), ("a directory", str(tmp)),
                                   ("a file that is not JSON", str(not_json)), ("an empty string", ""),
                                   ("a number", 3), ("a list", [str(not_json)]))]
    return probes


def run_config_probes(tmp: Path):
    outcomes = []
    files = config_file_probes(tmp)
    for (name, _), proc in zip(files.items(), run_all(config_entry, [[str(p)] for p in files.values()],
                                                      [60] * len(files))):
        outcomes.append(("config", f"config file: {name}", classify(proc, False), proc.stderr.strip() if proc else ""))
    probes = config_probes() + config_probes_19(tmp) + config_probes_since_19(tmp) + config_probes_since_34(tmp)
    argvs = []
    for i, (_, config, *_) in enumerate(probes):
        path = tmp / f"config_{i}.yaml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        argvs.append([str(path)])
    for (name, _, expect_ok, *must_say), proc in zip(probes, run_all(config_entry, argvs, [60] * len(argvs))):
        outcomes.append(("config", name, classify(proc, expect_ok, must_say=must_say), proc.stderr.strip() if proc else ""))
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


def cost_documents_19():
    good = {"schema_version": 1, "name": "probe",
            "decode": {"fixed_s": 0.005, "per_seq_s": 0.0, "per_ctx_token_s": 4.3e-8},
            "prefill": {"fixed_s": 0.0, "per_token_s": 4.7e-5}}

    def with_(path, value):
        doc = copy.deepcopy(good)
        return json.dumps(set_path(doc, path, value))
    table = {"batches": [1, 8], "fixed_s": [0.004, 0.006]}
    probes = [
        ("valid with a batch table and a speed band", with_(("meta",), {"speed_band": {"decode": [0.9, 1.2],
                                                                                       "prefill": [0.95, 1.1]}}), True),
        ("valid with every optional key", json.dumps({**good, "source": "probe", "decode": {
            **good["decode"], "ctx_mode": "padded_max", "batch_fixed_s": table}, "prefill": {
            **good["prefill"], "per_token_sq_s": 1e-9, "per_token_ctx_s": 1e-9}}), True),
        ("schema_version true", with_(("schema_version",), True), False),
        ("schema_version 1.0", with_(("schema_version",), 1.0), False),
        ("reversed speed_band", with_(("meta",), {"speed_band": {"decode": [1.3, 0.9]}}), False),
        ("speed_band of zeros", with_(("meta",), {"speed_band": {"decode": [0, 0]}}), False),
        ("deeply nested", "[" * 100_000 + "]" * 100_000, False),
        ("a key twice", '{"schema_version": 1, "schema_version": 1}', False),
        ("NaN literal", json.dumps(good).replace("0.005", "NaN"), False),
        ("name of 10,000 characters", with_(("name",), "x" * 10_000), False),
        ("name a number", with_(("name",), 3), False),
        ("source a list", with_(("source",), ["x"]), False),
        ("meta a list", with_(("meta",), []), False),
        ("batch table item 1.5", with_(("decode", "batch_fixed_s"), {"batches": [1.5], "fixed_s": [0.01]}), False),
        ("batch table duplicate batches", with_(("decode", "batch_fixed_s"), {"batches": [2, 2], "fixed_s": [0.1, 0.2]}), False),
        ("batch table without fixed_s", with_(("decode", "batch_fixed_s"), {"batches": [2]}), False),
        ("batch table with an extra key", with_(("decode", "batch_fixed_s"), {**table, "slope": 1}), False),
    ]
    for section, keys in (("", ["schema_version", "name", "source", "decode", "prefill", "meta"]),
                          ("decode", ["fixed_s", "per_seq_s", "per_ctx_token_s", "ctx_mode", "batch_fixed_s"]),
                          ("prefill", ["fixed_s", "per_token_s", "per_token_sq_s", "per_token_ctx_s"])):
        for key in keys:
            wrong = key[:-1]
            doc = copy.deepcopy(good)
            (doc[section] if section else doc)[wrong] = 0.001
            probes.append((f"misspelled key {section + '.' if section else ''}{wrong}", json.dumps(doc), False))
    return probes


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
        ("two rows at 1e300 s (replayed with TTFT 0)", header + "1e300,5,6\n1e300,5,7\n", False),
        ("arrivals at 0 and 1e8 s, the longest span", header + "0,5,6\n1e8,5,7\n", True),
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
        "--rate": ["0", "-3", "nan", "1e7", "x", "", "1e-12"],
        "--sweep-rate": ["1,,2", "0,5", "-inf", "nan,1", "1,1e-300"],
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
    return probes + cli_probes_19(tmp) + cli_probes_since_19(tmp)


def cli_probes_19(tmp: Path):
    """The flags, file formats and output paths added since issue 12."""
    good = tmp / "good19.csv"
    good.write_text("arrival_s,prompt_tokens,output_tokens\n" + "".join(f"{i * 0.05},{100 + i},{20 + i % 7}\n"
                                                                       for i in range(60)))
    jsonl = tmp / "good19.jsonl"
    jsonl.write_text("".join(json.dumps({"Timestamp": i * 0.1, "Request tokens": 50 + i, "Response tokens": 9})
                             + "\n" for i in range(40)))
    azure = tmp / "azure19.csv"
    azure.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:15:{10 + i // 10:02d}.{i % 10}000000,{30 + i},{5 + i % 3}\n" for i in range(40)))
    small = ["--num-requests", "60", "--json"]
    probes = [("--trace servingplan CSV", ["--trace", str(good), *small], True, finite_json),
              ("--trace burstgpt JSONL", ["--trace", str(jsonl), "--trace-layout", "burstgpt", "--json"], True,
               finite_json),
              ("--trace azure CSV at --request-rate 5", ["--trace", str(azure), "--trace-layout", "azure",
                                                         "--request-rate", "5", "--json"], True, finite_json),
              ("--trace-columns renaming", ["--trace", str(jsonl), "--trace-columns",
                                            "arrival=Timestamp,prompt_tokens=Request tokens,output_tokens=Response tokens",
                                            "--json"], True, finite_json),
              ("--goodput and --metric-percentiles", ["--goodput", "ttft:2000", "tpot:12", "e2el:30000",
                                                      "--metric-percentiles", "50,90,99", *SMALL], True, finite_json),
              ("--max-num-batched-tokens", ["--max-num-batched-tokens", "512", "--sweep-batch", "8,64", *SMALL], True,
               finite_json),
              ("--seed 7", ["--seed", "7", "--num-requests", "50", "--json"], True, finite_json),
              ("--num-prompts 30 --num-requests 30 agree", ["--num-prompts", "30", "--num-requests", "30", "--seeds",
                                                            "1", "--json"], True, finite_json)]
    bad_values = {
        "--trace-layout": ["sharegpt", ""], "--trace-timestamps": ["epoch", ""],
        "--trace-columns": ["arrival", "x=y", "arrival=", "prompt_tokens=arrival_s", "arrival=nope"],
        "--max-num-batched-tokens": ["0", "-1", "1e12", "4"], "--seed": ["-1", "4294967296", "x"],
        "--goodput": ["ttft", "x:5", "ttft:0", "ttft:nan", "tpot:-1"],
        "--metric-percentiles": ["101", "nan", "", "1,,2"], "--request-rate": ["0", "nan", "-inf", "1e-320"],
        "--num-prompts": ["0", "1e12", "nan"],
    }
    for option, values in bad_values.items():
        extra = ["--trace", str(good)] if option.startswith("--trace-") else []
        probes += [(f"{option} {v!r}", [option, v, *extra, *SMALL], False, finite_json) for v in values]
    probes += [
        ("--num-prompts 10 --num-requests 20", ["--num-prompts", "10", "--num-requests", "20", "--json"], False,
         finite_json),
        ("--rate 5 --request-rate 6", ["--rate", "5", "--request-rate", "6", *SMALL], False, finite_json),
        ("--seed with --seeds", ["--seed", "1", "--seeds", "2", "--json"], False, finite_json),
        ("--chunk-size with --max-num-batched-tokens", ["--chunk-size", "64", "--max-num-batched-tokens", "512",
                                                        *SMALL], False, finite_json),
        ("--goodput ttft with --slo-ttft-ms", ["--goodput", "ttft:100", "--slo-ttft-ms", "100", *SMALL], False,
         finite_json),
        ("--save-detailed without --save-result", ["--save-detailed", *SMALL], False, finite_json),
        ("--trace with --workload capstone", ["--trace", str(good), "--workload", "capstone", "--json"], False,
         finite_json),
        ("--trace with --seeds", ["--trace", str(good), "--seeds", "2", "--json"], False, finite_json),
        ("--trace missing", ["--trace", str(tmp / "none.csv"), "--json"], False, finite_json),
    ]
    for label, special in special_files(tmp).items():
        probes += [(f"--trace is a {label}", ["--trace", str(special), "--json"], False, finite_json),
                   (f"--workload is a {label}", ["--workload", str(special), "--json"], False, finite_json),
                   (f"--cost-model is a {label}", ["--cost-model", str(special), "--print-curve"], False, finite_curve)]
    for name, file_name, text, keys in issue19_trace_texts():
        path = write_trace_text(tmp, file_name, text)
        argv = ["--trace", str(path), "--request-rate", "5", "--json"]
        for key, value in keys.items():
            if key == "columns":
                argv += ["--trace-columns", ",".join(f"{k}={v}" for k, v in value.items())]
            else:
                argv += [f"--trace-{key}", str(value)]
        probes.append((f"--trace: {name}", argv, False, finite_json))
        if file_name.endswith(".csv") and not keys:
            probes.append((f"--workload: {name}", ["--workload", str(path), "--request-rate", "5", "--json"], False,
                           finite_json))
    for i, (name, text, ok) in enumerate(cost_documents_19()):
        path = tmp / f"cost19_{i}.json"
        path.write_text(text)
        probes.append((f"cost model: {name}", ["--cost-model", str(path), *SMALL], ok, finite_json))
    # output paths: each must be refused before any simulation, and never written through
    out = tmp / "out19"
    out.mkdir(exist_ok=True)
    blocker = tmp / "blocker19"
    blocker.write_text("x")
    link = out / "link.json"
    if not link.is_symlink():
        link.symlink_to(good)
    save = ["--save-result", *SMALL]
    probes += [
        ("--save-result into a folder", [*save, "--result-dir", str(out), "--result-filename", "r.json"], True,
         finite_json),
        ("--result-dir missing", [*save, "--result-dir", str(tmp / "missing19")], False, finite_json),
        ("--result-dir under a file", [*save, "--result-dir", str(blocker / "sub")], False, finite_json),
        ("--result-dir is a file", [*save, "--result-dir", str(blocker)], False, finite_json),
        ("--result-filename of 300 characters", [*save, "--result-dir", str(out), "--result-filename", "x" * 300],
         False, finite_json),
        ("--result-filename ../../x.json", [*save, "--result-dir", str(out), "--result-filename", "../../x.json"],
         False, finite_json),
        ("--result-filename a/b.json", [*save, "--result-dir", str(out), "--result-filename", "a/b.json"], False,
         finite_json),
        ("--result-filename empty", [*save, "--result-dir", str(out), "--result-filename", ""], False, finite_json),
        ("--result-filename ..", [*save, "--result-dir", str(out), "--result-filename", ".."], False, finite_json),
        ("--result-filename a symlink", [*save, "--result-dir", str(out), "--result-filename", "link.json"], False,
         finite_json),
        ("--result-filename a directory", [*save, "--result-dir", str(tmp), "--result-filename", "out19"], False,
         finite_json),
        ("--result-filename a FIFO", [*save, "--result-dir", str(tmp), "--result-filename", "fifo.csv"], False,
         finite_json),
        ("--result-filename /dev/null", [*save, "--result-dir", "/dev", "--result-filename", "null"], False,
         finite_json),
    ]
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


def cost_file(tmp: Path, name: str, changes: dict) -> Path:
    """A valid cost-model file with `changes` ({path tuple: value}) applied."""
    document = copy.deepcopy(GOOD_COST)
    for path, value in changes.items():
        set_path(document, path, value)
    path = tmp / f"cost_{name}.json"
    path.write_text(json.dumps(document))
    return path


GOOD_COST = {"schema_version": 1, "name": "probe",
             "decode": {"fixed_s": 0.005, "per_seq_s": 0.0, "per_ctx_token_s": 4.3e-8},
             "prefill": {"fixed_s": 0.0, "per_token_s": 4.7e-5}}


def cost_documents_since_19():
    """(name, text, expect_ok[, what the refusal must say]): the meta keys the pipeline reads
    (speed_band by the capacity stage, profiled_range by the CLI's extrapolation warning) and
    misspellings of every key, each to be named with the key meant."""
    def with_(changes):
        document = copy.deepcopy(GOOD_COST)
        for path, value in changes.items():
            set_path(document, path, value)
        return json.dumps(document)
    band = {"decode": [0.9, 1.2], "prefill": [0.95, 1.1]}
    ranges = {"prompt_tokens": [16, 512], "context_tokens": [17, 1024]}
    probes = [
        ("meta.profiled_range valid", with_({("meta",): {"profiled_range": ranges}}), True),
        ("meta.speed_band and profiled_range valid", with_({("meta",): {"speed_band": band, "profiled_range": ranges,
                                                                        "machine_fingerprint": "abc"}}), True),
        ("meta.profiled_range reversed", with_({("meta", "profiled_range"): {**ranges, "prompt_tokens": [512, 16]}}),
         False, "profiled_range"),
        ("meta.profiled_range of floats", with_({("meta", "profiled_range"): {**ranges, "context_tokens": [1.5, 9.0]}}),
         False, "profiled_range"),
        ("meta.profiled_range NaN", with_({("meta", "profiled_range"): {**ranges, "context_tokens": [1, math.nan]}}),
         False, "profiled_range"),
        ("meta.profiled_range negative", with_({("meta", "profiled_range"): {**ranges, "prompt_tokens": [-5, 9]}}),
         False, "profiled_range"),
        ("meta.profiled_range huge", with_({("meta", "profiled_range"): {**ranges, "context_tokens": [1, 10**15]}}),
         False, "profiled_range"),
        ("meta.profiled_range one item", with_({("meta", "profiled_range"): {**ranges, "prompt_tokens": [5]}}), False,
         "profiled_range"),
        ("meta.profiled_range without context_tokens", with_({("meta", "profiled_range"): {"prompt_tokens": [5, 9]}}),
         False, "context_tokens"),
        ("meta.profiled_range a string", with_({("meta", "profiled_range"): "16..512"}), False, "profiled_range"),
        ("meta.profiled_range.prompt_token misspelled", with_({("meta", "profiled_range"): {
            "prompt_token": [16, 512], "context_tokens": [17, 1024]}}), False, "did you mean .*prompt_tokens"),
        ("meta.speed_bnad misspelled", with_({("meta", "speed_bnad"): band}), False, "did you mean .*speed_band"),
        ("meta.profiled_rnage misspelled", with_({("meta", "profiled_rnage"): ranges}), False,
         "did you mean .*profiled_range"),
        ("meta.speed_band.decdoe misspelled", with_({("meta", "speed_band"): {"decdoe": [0.9, 1.2],
                                                                              "prefill": [0.9, 1.1]}}), False,
         "did you mean .*decode"),
        ("meta.speed_band without prefill", with_({("meta", "speed_band"): {"decode": [0.9, 1.2]}}), False,
         "prefill"),
        ("meta.speed_band infinite", with_({("meta", "speed_band"): {**band, "decode": [0.9, math.inf]}}), False,
         "speed_band"),
        ("meta.speed_band huge", with_({("meta", "speed_band"): {**band, "decode": [0.9, 1e300]}}), False,
         "speed_band"),
    ]
    # a key misspelled as a user would (a letter swapped, dropped or doubled): the refusal names the key meant
    for path, wrong in ((("schema_vesrion",), "schema_version"), (("nmae",), "name"), (("sourc",), "source"),
                        (("decoed",), "decode"), (("prefil",), "prefill"), (("decode", "fixd_s"), "fixed_s"),
                        (("decode", "per_seq"), "per_seq_s"), (("decode", "per_ctx_tokens_s"), "per_ctx_token_s"),
                        (("decode", "ctx_mdoe"), "ctx_mode"), (("decode", "batch_fixed"), "batch_fixed_s"),
                        (("decode", "batch_fixed_s", "batchs"), "batches"), (("prefill", "per_tokn_s"), "per_token_s"),
                        (("prefill", "per_token_sq"), "per_token_sq_s"), (("prefill", "per_token_cxt_s"),
                                                                          "per_token_ctx_s")):
        changes = {path: 0.001}
        if path[:2] == ("decode", "batch_fixed_s"):
            changes = {("decode", "batch_fixed_s"): {"batches": [1], "fixed_s": [0.004], path[-1]: [1]}}
        probes.append((f"misspelled key {'.'.join(path)}", with_(changes), False, f"did you mean .*{wrong}"))
    return probes


def trace_formats_since_19(tmp: Path):
    """(name, path, --trace options, expect_ok): each public trace layout as its data set writes it
    (Azure 2023: 7-digit fractions; Azure 2024: a UTC offset; BurstGPT: its six columns, failed
    requests logging 0 response tokens), as CSV and JSONL, and what each layout gets wrong."""
    def write(name, text):
        path = tmp / f"fmt_{name}"
        path.write_text(text)
        return path
    azure23 = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2023-11-16 18:15:{10 + i // 10:02d}.{i % 10}680590,{30 + i},{5 + i % 3}\n" for i in range(40))
    azure24 = "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(
        f"2024-05-10 00:00:{i // 10:02d}.{i % 10}09930+00:00,{300 + i},{20 + i % 9}\n" for i in range(40))
    burst = "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n" + "".join(
        f"{i * 0.7:.1f},ChatGPT,{200 + i},{0 if i % 9 == 4 else 30 + i},{230 + 2 * i},Conversation log\n"
        for i in range(40))
    burst_jsonl = "".join(json.dumps({"Timestamp": i * 0.5, "Model": "GPT-4", "Request tokens": 20 + i,
                                      "Response tokens": 9, "Total tokens": 29 + i, "Log Type": "API log"}) + "\n"
                          for i in range(30))
    azure_jsonl = "".join(json.dumps({"TIMESTAMP": f"2024-05-10T00:00:{i:02d}.5+00:00", "ContextTokens": 100 + i,
                                      "GeneratedTokens": 7}) + "\n" for i in range(30))
    good = [
        ("Azure 2023 CSV", write("azure23.csv", azure23), ["--trace-layout", "azure"], True),
        ("Azure 2024 CSV (UTC offset)", write("azure24.csv", azure24), ["--trace-layout", "azure"], True),
        ("Azure 2024 JSONL", write("azure24.jsonl", azure_jsonl), ["--trace-layout", "azure"], True),
        ("BurstGPT CSV with failed requests", write("burst.csv", burst), ["--trace-layout", "burstgpt"], True),
        ("BurstGPT JSONL", write("burst.jsonl", burst_jsonl), ["--trace-layout", "burstgpt"], True),
        ("BurstGPT CSV at --request-rate inf", write("burst_inf.csv", burst), ["--trace-layout", "burstgpt",
                                                                              "--request-rate", "inf"], True),
        ("Azure: one date for every row, a burst replayed as logged", write("azure_burst.csv", (
            "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "2024-05-10 00:00:00,10,5\n" * 5)), ["--trace-layout", "azure"],
         True),
        ("Azure CSV, max context 320, clip", write("azure_clip.csv", azure24), [
            "--trace-layout", "azure", "--max-context", "320", "--too-long", "clip"], True),
        ("a burst at 0 and 1e-320 s replayed as logged (no rate, every figure finite)", write("subnormal_burst.csv", (
            "arrival_s,prompt_tokens,output_tokens\n0,10,5\n1e-320,12,6\n")), [], True),
    ]
    bad = [
        ("Azure: a date that does not exist", "azure_bad_date.csv",
         azure23.replace("2023-11-16 18:15:10.0680590", "2023-02-30 18:15:10.0680590"), "azure"),
        ("Azure: seconds instead of dates", "azure_seconds.csv",
         "TIMESTAMP,ContextTokens,GeneratedTokens\n0,10,5\n1,12,6\n", "azure"),
        ("Azure: year 1 beside 2024", "azure_year1.csv",
         "TIMESTAMP,ContextTokens,GeneratedTokens\n0001-01-01 00:00:00,10,5\n2024-05-10 00:00:00,12,6\n", "azure"),
        ("Azure: 2024's columns missing one", "azure_missing.csv",
         "TIMESTAMP,ContextTokens\n2024-05-10 00:00:00,10\n2024-05-10 00:00:01,12\n", "azure"),
        ("Azure: dates with and without a UTC offset", "azure_mixed.csv",
         "TIMESTAMP,ContextTokens,GeneratedTokens\n2024-05-10 00:00:00,10,5\n2024-05-10 00:00:01+14:00,12,6\n",
         "azure"),
        ("BurstGPT: every request failed", "burst_failed.csv",
         "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n" + "".join(
             f"{i},ChatGPT,20,0,20,Conversation log\n" for i in range(5)), "burstgpt"),
        ("BurstGPT: negative timestamp", "burst_negative.csv",
         "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n-5,ChatGPT,20,9,29,x\n1,x,20,9,29,x\n",
         "burstgpt"),
        ("BurstGPT: token count 1e400", "burst_huge.jsonl",
         '{"Timestamp": 0, "Request tokens": 1e400, "Response tokens": 9}\n{"Timestamp": 1, "Request tokens": 3, '
         '"Response tokens": 9}\n', "burstgpt"),
        ("BurstGPT: token count true", "burst_bool.jsonl",
         '{"Timestamp": 0, "Request tokens": true, "Response tokens": 9}\n{"Timestamp": 1, "Request tokens": 3, '
         '"Response tokens": 9}\n', "burstgpt"),
        ("BurstGPT: token count an object", "burst_obj.jsonl",
         '{"Timestamp": 0, "Request tokens": {"n": 3}, "Response tokens": 9}\n', "burstgpt"),
        ("BurstGPT: token count 2**70", "burst_big.jsonl",
         '{"Timestamp": 0, "Request tokens": 1180591620717411303424, "Response tokens": 9}\n', "burstgpt"),
        ("BurstGPT JSONL: a line that is a list", "burst_list.jsonl", '[0, 20, 9]\n', "burstgpt"),
        ("JSONL: a blank file", "blank.jsonl", "\n\n", "servingplan"),
        ("JSONL: a line of 200,000 characters", "long_line.jsonl",
         json.dumps({"arrival_s": 0, "prompt_tokens": 9, "output_tokens": 5, "pad": "x" * 200_000}) + "\n",
         "servingplan"),
    ]
    # the generative suite's find, at its own pace: the 0-token row at 1e300 s was skipped before the span
    # was checked, and the burst left was accepted
    skipped = ("Azure seconds at its own pace, a skipped row at 1e300 s beside 0 and 1e-320", write(
        "azure_skipped.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n1e+300,0,5\n0.0,10,5\n1e-320,12,6\n"),
        ["--trace-layout", "azure", "--trace-timestamps", "seconds"], False)
    return good + [(name, write(file_name, text), ["--trace-layout", layout], False)
                   for name, file_name, text, layout in bad] + [skipped]


def result_file_probes(tmp: Path):
    """--append-result onto what is there: a vLLM result file (its runs kept, the new one added), or
    something else, refused before any run; and the output flags' good and bad values."""
    out = tmp / "append"
    out.mkdir(exist_ok=True)
    one = ["--num-requests", "30", "--seeds", "1", "--json"]
    append = ["--append-result", "--result-dir", str(out), *one, "--result-filename"]
    previous = {"date": "20260101-000000", "backend": "vllm", "request_rate": 5.0, "completed": 30}
    (out / "vllm.json").write_text(json.dumps(previous) + "\n" + json.dumps({**previous, "request_rate": 6.0}))
    (out / "trace.csv").write_text("arrival_s,prompt_tokens,output_tokens\n0,10,5\n")
    (out / "list.json").write_text("[1, 2, 3]")
    (out / "deep.json").write_text("[" * 50_000 + "]" * 50_000)
    (out / "latin1.json").write_bytes(b'{"label": "caf\xe9"}')
    (out / "empty.json").write_text("")
    with open(out / "sparse.json", "wb") as handle:
        handle.truncate(1 << 34)  # 16 GiB on paper, no blocks: a size check must refuse it unread
    (out / "dir.json").mkdir(exist_ok=True)
    for name, target in (("link.json", out / "vllm.json"), ("zero.json", "/dev/zero"), ("loop.json", out / "loop.json")):
        if not (out / name).is_symlink():
            (out / name).symlink_to(target)
    if not (out / "fifo.json").exists():
        os.mkfifo(out / "fifo.json")
    probes = [
        ("--append-result to a new file", [*append, "new.json"], True, finite_json),
        ("--append-result to a vLLM result file", [*append, "vllm.json"], True, finite_json),
        ("--append-result to an empty file", [*append, "empty.json"], True, finite_json),
        ("--append-result, two runs into one file", [*append, "two.json", "--sweep-batch", "4,8"], True, finite_json),
        ("--save-result --request-rate inf --max-concurrency 4", [
            "--save-result", "--result-dir", str(out), "--result-filename", "inf.json", "--request-rate", "inf",
            "--max-concurrency", "4", "--percentile-metrics", "ttft,client_queue_time", *one], True, finite_json),
        ("--save-result every option", ["--save-result", "--result-dir", str(out), "--result-filename", "all.json",
                                        "--label", "run-1", "--result-date", "20260228-235959", "--metadata", "a=1",
                                        "b=two words", "--percentile-metrics", "ttft,tpot,itl,e2el",
                                        "--metric-percentiles", "50,99.9", "--save-detailed", *one], True,
         finite_json),
    ]
    for file_name, say in (("trace.csv", "not a vLLM result"), ("list.json", "not a vLLM result"),
                           ("deep.json", "nested"), ("latin1.json", "UTF-8"),
                           ("sparse.json", "bytes"), ("dir.json", "directory"), ("link.json", "symlink"),
                           ("zero.json", "symlink"), ("loop.json", "symlink"), ("fifo.json", "FIFO")):
        probes.append((f"--append-result onto {file_name}", [*append, file_name], False, finite_json, say))
    probes.append(("--save-result replacing a trace file", ["--save-result", "--result-dir", str(out),
                                                           "--result-filename", "trace.csv", *one], False, finite_json,
                   "not a vLLM result"))
    probes.append(("--append-result onto /dev/null", ["--append-result", "--result-dir", "/dev", "--result-filename",
                                                       "null", *one], False, finite_json, "character device"))
    bad_values = {
        "--request-rate": ["-inf", "Infinity", "1e400", "5,6"], "--sweep-rate": ["5,inf,-inf", "inf,inf"],
        "--burstiness": ["0.0009", "1e7", "-inf", "", "1,2", "1e-320"],
        "--max-concurrency": ["", "1e3", "1000001", "nan", "inf", "-0"],
        "--percentile-metrics": ["TTFT", "ttft,", "client_queue_time", "x" * 300],
        "--capacity-users": ["-1", "nan", "2.5", "x", "1000001"],
        "--metadata": ["a=" + "v" * 300, "a\nb=1", "9=x", "=", "a b=1"],
        "--label": ["", "..", "x" * 300, "."],
        "--result-date": ["20260230-000000", "99999999-999999", "20260101-000000x", "", "2026-01-01 00:00:00"],
        "--max-context": ["2.5", "nan", "1048577", "", "1"],
        "--too-long": ["", "SKIP"],
        "--result-dir": ["/dev/null", "/proc/self/fd"],
    }
    for option, values in bad_values.items():
        needs = {"--label": ["--save-result", "--result-dir", str(out)], "--max-context": ["--trace", str(tmp / "good19.csv")],
                 "--too-long": ["--trace", str(tmp / "good19.csv"), "--max-context", "512"],
                 "--result-dir": ["--save-result"], "--metadata": ["--save-result", "--result-dir", str(out)],
                 "--result-date": ["--save-result", "--result-dir", str(out)],
                 "--percentile-metrics": ["--save-result", "--result-dir", str(out)],
                 "--capacity-users": ["--slo-ttft-ms", "2000"]}.get(option, [])
        probes += [(f"{option} {v[:40]!r}", [*needs, option, v, *one], False, finite_json) for v in values]
    probes += [
        ("--metadata of 51 pairs", ["--save-result", "--result-dir", str(out), "--metadata",
                                    *[f"k{i}=v" for i in range(51)], *one], False, finite_json),
        ("--metadata a key twice", ["--save-result", "--result-dir", str(out), "--metadata", "a=1", "a=2", *one],
         False, finite_json),
        ("--too-long skip without --max-context", ["--trace", str(tmp / "good19.csv"), "--too-long", "skip", "--json"],
         False, finite_json),
        ("--max-context 130 with --too-long clip", ["--trace", str(tmp / "good19.csv"), "--max-context", "130",
                                                    "--too-long", "clip", "--json"], True, finite_json),
        ("--sweep-rate 5,inf", ["--sweep-rate", "5,inf", *one], True, finite_json),
        ("--burstiness 1e6", ["--burstiness", "1e6", *one], True, finite_json),
        ("--burstiness 0.001", ["--burstiness", "0.001", *one], True, finite_json),
        ("--capacity-users 1 with an SLO", ["--capacity-users", "1", "--slo-ttft-ms", "2000", *one], True,
         finite_json),
        ("--percentile-metrics twice the same", ["--save-result", "--result-dir", str(out), "--result-filename",
                                                 "dup.json", "--percentile-metrics", "ttft,ttft", *one], False,
         finite_json, "given twice"),
        ("--seeds 3,3", ["--seeds", "3,3", "--num-requests", "30", "--json"], False, finite_json, "given twice"),
        ("--sweep-batch 4,4", ["--sweep-batch", "4,4", *one], False, finite_json, "given twice"),
        ("--sweep-rate 5,5.0", ["--sweep-rate", "5,5.0", *one], False, finite_json, "given twice"),
    ]
    return probes


def cli_probes_since_19(tmp: Path):
    """The flags, file formats and cost-model keys added since issue 19's round."""
    probes = result_file_probes(tmp)
    for name, path, options, ok in trace_formats_since_19(tmp):
        probes.append((f"--trace {name}", ["--trace", str(path), *options, "--json"], ok, finite_json))
    for i, (name, text, ok, *say) in enumerate(cost_documents_since_19()):
        path = tmp / f"cost_since19_{i}.json"
        path.write_text(text)
        probes.append((f"cost model: {name}", ["--cost-model", str(path), *SMALL], ok, finite_json, *say))
    return probes


def run_pipe_probe():
    """--print-curve into a pipe whose reader has gone (`| head -1`): quiet, SIGPIPE's exit code."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        proc = subprocess.run(CLI + ["--print-curve"], stdout=write_end, stderr=subprocess.PIPE, text=True,
                              timeout=120, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return [("cli", "--print-curve into a closed pipe", "hang", "")]
    finally:
        os.close(write_end)
    outcome = "works" if proc.stderr == "" and proc.returncode in (0, 141) else "traceback"
    return [("cli", "--print-curve into a closed pipe", outcome, proc.stderr[-300:])]


def run_cli_probes(tmp: Path, heavy: bool):
    probes = cli_probes(tmp)
    if heavy:
        probes.append(("ITL over 300,000 requests", ["--slo-itl-ms", "50", "--num-requests", "300000", "--seeds", "1",
                                                     "--sweep-batch", "64", "--json"], True, finite_json))
    outcomes = []
    finished = run_all(cli_entry, [argv for _, argv, *_ in probes],
                       [900 if "300,000" in name else 180 for name, *_ in probes])
    for (name, argv, ok, figures, *must_say), proc in zip(probes, finished):
        outcome = classify(proc, ok, figures, must_say)
        if outcome == "works" and ("--save-result" in argv or "--append-result" in argv):
            outcome = saved_result_outcome(argv)
        outcomes.append(("cli", name, outcome, proc.stderr.strip()[-300:] if proc else ""))
    return outcomes + run_pipe_probe()


def saved_result_outcome(argv) -> str:
    """A saved result must be a regular file whose every line is a JSON object (no NaN or Infinity):
    the --result-filename, or every file in --result-dir when each run is named as vLLM names it."""
    directory = Path(argv[argv.index("--result-dir") + 1])
    paths = ([directory / argv[argv.index("--result-filename") + 1]] if "--result-filename" in argv
             else list(directory.glob("*.json")))
    def refuse(name):
        raise ValueError(name)
    try:
        for path in paths:
            lines = [line for line in path.read_text().splitlines() if line.strip()]
            if not (path.is_file() and not path.is_symlink() and lines
                    and all(isinstance(json.loads(line, parse_constant=refuse), dict) for line in lines)):
                return "silent"
        return "works" if paths else "silent"
    except ValueError:
        return "silent"


# -- the engine and the report ---------------------------------------------------------------------------

ENGINE_SCRIPT = """
import json, math, sys
import numpy as np
from servingplan.architecture import QUICK_CONFIG_OVERRIDES
from servingplan.profile.model import load_model
from servingplan.engine import Engine
from servingplan.engine.engine import request_problem
from servingplan.simulate.workload import Trace
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


INJECTIONS = ["[x](javascript:alert(3))", "![](http://example.com/x.png)", "# heading", "a *b* _c_ `d`",
              "<script>alert(1)</script>", "ok | table | cell", "- item", "1. item", "> quote", "http://evil.example",
              "&#106;avascript"]
# what markdown_text's output must not start or contain unescaped (after the template's autoescaping)
LEADING_BLOCK = re.compile(r"^([-+=>]|\d+[.)])")
UNESCAPED = re.compile(r"(?<!\\)[*_`|~!#]|(?<!\\)://")


def run_title_probes():
    """Free text reaching report.md (the title, hardware fields, trace file names and column headers,
    cost-model names and sources all go through markdown_text) must render as text: no heading, list,
    quote, link, image, emphasis, code or table cell break."""
    sys.path.insert(0, str(ROOT))
    from servingplan.report.text import markdown_text
    outcomes = []
    for text in INJECTIONS:
        escaped = markdown_text(text)
        bad = MARKDOWN_STRUCTURE.search(escaped) or LEADING_BLOCK.match(escaped) or UNESCAPED.search(escaped)
        outcomes.append(("report text", text, "silent" if bad else "works", escaped))
    return outcomes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heavy", action="store_true", help="add the 300,000-request ITL probe")
    parser.add_argument("--details", action="store_true", help="print every probe that is not a clear error")
    parser.add_argument("--jobs", type=int, default=1, help="probes run at once (each in its own process)")
    args = parser.parse_args()
    global JOBS
    JOBS = max(1, args.jobs)
    os.chdir(ROOT)
    # imported once here, so every forked probe starts warm
    import servingplan.cli.main  # noqa: F401
    import servingplan.config  # noqa: F401
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
