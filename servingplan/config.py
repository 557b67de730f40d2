"""Configuration validation: every value is checked before any work starts.

A bad value gives one line naming the key, the value and what is allowed, and exit code 2.
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import jsonschema
import psutil
import yaml

from servingplan import architecture
from servingplan.memory import GB, largest_cap, reserved_tokens_per_seq
from servingplan.plan.hardware import HERE, machine_kind
from servingplan.profile.machine import resolve_threads
from servingplan.simulate.policies import CHUNK_BUDGETS, POLICIES, chunk_budget, chunks

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_PATH = ROOT / "schemas" / "config.schema.yaml"


PROFILE_SOURCE = "profile"
# A config is a few kilobytes and a few levels deep; YAML anchors can make a small file expand to
# billions of nodes, and every check below walks the expanded document.
MAX_CONFIG_BYTES = 1 << 20
MAX_CONFIG_NODES = 100_000
MAX_CONFIG_DEPTH = 32


class ConfigError(ValueError):
    pass


# JSON Schema counts 3.0 as an integer; here a count, a size or a seed must be written as one, since
# 3.0 would flow on as a float into seeds, ranges and array sizes.
_STRICT_INTEGERS = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
    "integer", lambda checker, instance: isinstance(instance, int) and not isinstance(instance, bool))
_Validator = jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=_STRICT_INTEGERS)


def _key(path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _allowed(error: jsonschema.ValidationError) -> str:
    v, kind = error.validator_value, error.validator
    if kind == "minimum":
        return f"must be >= {v}"
    if kind == "exclusiveMinimum":
        return f"must be > {v}"
    if kind == "maximum":
        return f"must be <= {v}"
    if kind == "exclusiveMaximum":
        return f"must be < {v}"
    if kind == "enum":
        return "allowed: " + ", ".join(map(str, v))
    if kind == "type":
        return f"must be of type {v}"
    if kind in ("minItems", "maxItems"):
        return f"needs {'at least' if kind == 'minItems' else 'at most'} {v} items"
    if kind in ("minLength", "maxLength"):
        return f"length must be {'>=' if kind == 'minLength' else '<='} {v}"
    if kind == "uniqueItems":
        return "items must be unique"
    if kind == "pattern":
        return error.schema.get("description", "must be one line without control characters (newline, tab, ...)")
    return error.message


def _schema_error(error: jsonschema.ValidationError, schema: dict) -> str:
    if error.validator == "required":
        missing = [k for k in error.validator_value if k not in error.instance]
        return f"config error: {_key(list(error.absolute_path) + [missing[0]])} is missing (required)"
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed))
        return (f"config error: {_key(list(error.absolute_path) + [extra[0]])} is not a known key "
                f"(allowed: {', '.join(allowed)})")
    return f"config error: {_key(error.absolute_path)} = {error.instance!r}: {_allowed(error)}"


def _check_length(key: str, spec: dict) -> None:
    dist = spec["dist"]
    needed = {"constant": ["value"], "uniform": ["min", "max"], "loguniform": ["min", "max"],
              "lognormal": ["min", "max", "mean", "sigma"]}[dist]
    for name in needed:
        if name not in spec:
            raise ConfigError(f"config error: {key}.{name} is missing (required for dist {dist})")
    unused = sorted(set(spec) - {"dist"} - set(needed))
    if unused:
        raise ConfigError(f"config error: {key}.{unused[0]} = {spec[unused[0]]!r}: not read with dist {dist} (which "
                          f"reads {', '.join(needed)}); remove it or change the dist")
    if dist != "constant" and spec["min"] > spec["max"]:
        raise ConfigError(f"config error: {key}.min = {spec['min']}: must be <= {key}.max ({spec['max']})")
    if dist == "lognormal" and not spec["min"] < spec["mean"] < spec["max"]:
        raise ConfigError(f"config error: {key}.mean = {spec['mean']}: must lie strictly between "
                          f"min ({spec['min']}) and max ({spec['max']})")


def _longest(spec: dict) -> int:
    return spec["value"] if spec["dist"] == "constant" else spec["max"]


def _non_finite(value, path=()):
    """(path, value) of the first NaN or infinity anywhere in `value`, or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        found = _non_finite(item, path + (key,))
        if found:
            return found
    return None


def _check_shape(config) -> None:
    """Refuse a document that expands past MAX_CONFIG_NODES values or nests deeper than
    MAX_CONFIG_DEPTH, before anything walks it (iteratively, so a deep one cannot overflow the stack)."""
    stack, nodes = [(config, 0)], 0
    while stack:
        value, depth = stack.pop()
        nodes += 1
        if nodes > MAX_CONFIG_NODES:
            raise ConfigError(f"config error: (top level): more than {MAX_CONFIG_NODES:,} values (YAML anchors "
                              "expanded); a config has a few hundred")
        if depth > MAX_CONFIG_DEPTH:
            raise ConfigError(f"config error: (top level): nested deeper than {MAX_CONFIG_DEPTH} levels")
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        stack.extend((child, depth + 1) for child in children)


def _gb(n_bytes: float) -> str:
    return f"{n_bytes / GB:.4g} GB"


def _check_sizes(config: dict) -> list[str]:
    """What the model's shape rules out, known before anything is loaded or profiled (and a warning
    for what it makes doubtful)."""
    model = config["model"]
    try:
        arch = architecture.architecture(model)
    except (OSError, ValueError, AttributeError) as exc:
        raise ConfigError(f"config error: model.source = {model['source']!r}: its config.json cannot be read "
                          f"({' '.join(str(exc).split())})")
    name = "the tiny 2-layer GPT-2" if model.get("tiny", False) else (
        "GPT-2 small" if model["source"] == "random" else f"the checkpoint in {model['source']}")
    mem = config["memory"]
    if mem["max_context"] > arch["n_positions"]:
        raise ConfigError(f"config error: memory.max_context = {mem['max_context']}: must be <= the model's "
                          f"n_positions ({arch['n_positions']})")
    weights = architecture.weight_bytes(arch)
    kv_per_token = architecture.kv_bytes_per_token(arch)
    one_sequence = reserved_tokens_per_seq(mem["max_context"], mem["block_size"]) * kv_per_token
    if mem["budget_gb"] * GB < weights + one_sequence:
        raise ConfigError(
            f"config error: memory.budget_gb = {mem['budget_gb']}: must hold the weights of {name} "
            f"({architecture.weight_count(arch):,} float32 parameters, {_gb(weights)}) plus the KV cache of one "
            f"memory.max_context sequence ({_gb(one_sequence)}): at least {_gb(weights + one_sequence)}")
    available = psutil.virtual_memory().total
    validation = config["validation"]
    # the replay engine preallocates a KV slot of the longest request for every sequence it may run
    pool = validation["cap"] * (mem["max_context"] - 1) * kv_per_token
    if weights + pool > available:
        raise ConfigError(
            f"config error: validation.cap = {validation['cap']}: the engine's KV pool for that many "
            f"memory.max_context sequences and the weights need {_gb(weights + pool)} of memory; this machine "
            f"has {_gb(available)}")
    profile = config["profile"]
    # the profiler's KV pool holds its largest decode batch at its longest shape (a decode context or a
    # prompt), and the decode call copies that batch's past once more
    longest_shape = max(max(profile["decode_contexts"]) + 1, max(profile["prefill_lengths"]))
    largest_batch = max(profile["decode_batches"])
    largest_decode = largest_batch * (longest_shape + max(profile["decode_contexts"]) + 1) * kv_per_token
    if weights + largest_decode > available:
        raise ConfigError(
            f"config error: profile.decode_batches = {profile['decode_batches']}: its largest point "
            f"(batch {max(profile['decode_batches'])} at context {max(profile['decode_contexts'])}) needs "
            f"{_gb(weights + largest_decode)} of memory; this machine has {_gb(available)}")
    in_budget = largest_cap(mem["budget_gb"] * GB, weights, kv_per_token, mem["max_context"], mem["block_size"])
    if validation["cap"] > in_budget:
        return [f"config warning: validation.cap = {validation['cap']}: memory.budget_gb = {mem['budget_gb']} "
                f"reserves memory.max_context for only {in_budget} sequences beside the weights, so the validated "
                "replay can run out of KV blocks and preempt where a cap that fits would not"]
    return []


def check(config: dict) -> list[str]:
    """Raise ConfigError with one line for the first bad value; return one line for each setting that
    is allowed but probably not what was meant."""
    if not isinstance(config, dict):
        raise ConfigError(f"config error: (top level) = {config!r}: must be a mapping of sections")
    _check_shape(config)
    found = _non_finite(config)
    if found:
        raise ConfigError(f"config error: {_key(found[0])} = {found[1]!r}: must be a finite number")
    schema = yaml.safe_load(SCHEMA_PATH.read_text())
    schema["definitions"]["policy"]["enum"] = list(POLICIES)
    schema["properties"]["sweep"]["properties"]["chunk_budget"]["enum"] = list(CHUNK_BUDGETS)
    validator = _Validator(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: (list(map(str, e.absolute_path)), e.validator))
    if errors:
        raise ConfigError(_schema_error(jsonschema.exceptions.best_match(errors), schema))

    for part in ("prompt", "output"):
        _check_length(f"workload.{part}", config["workload"][part])
    c = config["capacity"]
    if c["rate_min"] >= c["rate_max"]:
        raise ConfigError(f"config error: capacity.rate_min = {c['rate_min']}: must be < capacity.rate_max "
                          f"({c['rate_max']})")
    longest = _longest(config["workload"]["prompt"]) + _longest(config["workload"]["output"])
    if config["memory"]["max_context"] < longest:
        raise ConfigError(f"config error: memory.max_context = {config['memory']['max_context']}: must cover "
                          f"the longest prompt + reply ({longest})")
    source = config["model"]["source"]
    if config["model"].get("tiny", False) and source != "random":
        raise ConfigError(f"config error: model.tiny = true with model.source = {source!r}: the tiny model is a "
                          "random 2-layer GPT-2, so model.source must be 'random' (or drop model.tiny)")
    if source != "random" and not (Path(source) / "config.json").is_file():
        raise ConfigError(f"config error: model.source = {source!r}: must be 'random' or a local directory "
                          "holding a transformers checkpoint (config.json + weights)")
    warnings = _check_sizes(config)
    _check_step_budget(config)
    warnings += _check_trace(config)
    if "trace" not in config["workload"]:
        _check_replay_rates(config, config["workload"]["num_requests"])
    _check_costmodel(config.get("costmodel"))
    # before the device check: llama.cpp's CPU build refuses cuda on every machine, GPU or not
    _check_llamacpp(config)
    _check_device(config["model"].get("device", "cpu"))
    _check_hardware(config.get("hardware", []), costmodel_source(config))
    _check_gpu_check(config.get("gpu_check"))
    return warnings


LLAMACPP = "llamacpp"


def engine(config: dict) -> str:
    """`torch` (the project's engine alone) or `llamacpp` (llama.cpp profiled, fitted and validated too)."""
    return config.get("engine", "torch")


def _check_llamacpp(config: dict) -> None:
    """llama.cpp runs the seeded random GPT-2 converted to GGUF on this machine's CPU, beside a profiled torch
    run it is compared with; its batch sizes must let the profile time whole prompts and let every step of
    the validation carry prompt tokens beside a full set of decodes."""
    section = config.get(LLAMACPP)
    if engine(config) != LLAMACPP:
        if section is not None:
            raise ConfigError(f"config error: llamacpp = {{...}}: read only with engine: llamacpp (here "
                              f"{engine(config)!r}); set engine: llamacpp or remove the section")
        return
    if section is None:
        raise ConfigError("config error: llamacpp is missing (required with engine: llamacpp)")
    if costmodel_source(config) != PROFILE_SOURCE:
        raise ConfigError(f"config error: engine = 'llamacpp' with costmodel.source = {costmodel_source(config)!r}: "
                          "llama.cpp is profiled and validated on this machine, beside this machine's own profile; "
                          "use costmodel.source 'profile'")
    if config["model"]["source"] != "random":
        raise ConfigError(f"config error: engine = 'llamacpp' with model.source = {config['model']['source']!r}: "
                          "the GGUF is converted from the seeded random GPT-2; use model.source 'random'")
    if config["model"].get("device", "cpu") != "cpu":
        raise ConfigError(f"config error: engine = 'llamacpp' with model.device = {config['model']['device']!r}: "
                          "the pinned llama.cpp build runs on the CPU; use 'cpu'")
    if section["n_ubatch"] > section["n_batch"]:
        raise ConfigError(f"config error: llamacpp.n_ubatch = {section['n_ubatch']}: must be <= llamacpp.n_batch "
                          f"({section['n_batch']}), the batch it cuts into micro-batches")
    longest_profiled = max(config["profile"]["prefill_lengths"] + [config["profile"]["reference_prefill"]])
    if section["n_batch"] < longest_profiled:
        raise ConfigError(f"config error: llamacpp.n_batch = {section['n_batch']}: must be >= the longest profiled "
                          f"prompt ({longest_profiled}, profile.prefill_lengths), so each profiled prefill is one "
                          "llama_decode")
    cap = config["validation"]["cap"]
    longest_prompt = _longest(config["workload"]["prompt"])
    if not cap < section["split_n_batch"] < longest_prompt:
        raise ConfigError(f"config error: llamacpp.split_n_batch = {section['split_n_batch']}: must exceed "
                          f"validation.cap ({cap}), so a step of a full set of decodes still carries prompt tokens, "
                          f"and be below the longest prompt ({longest_prompt}), so it splits prompts")
    if section["n_batch"] <= cap:
        raise ConfigError(f"config error: llamacpp.n_batch = {section['n_batch']}: must exceed validation.cap "
                          f"({cap}), so a step of a full set of decodes still carries prompt tokens")
    threads = section["threads"]
    if threads > (os.cpu_count() or 1):
        raise ConfigError(f"config error: llamacpp.threads = {threads}: must be at most this machine's "
                          f"{os.cpu_count()} cores (0 = all of them): llama.cpp's threads spin while they wait")


def _check_hardware(targets: list[dict], costmodel: str) -> None:
    """Each target names its own output file and report row, so no two may share a name. A target's
    speed is scaled from the roofline probes of the machine the cost model was fitted on, which only a
    profiled run has."""
    if targets and costmodel != PROFILE_SOURCE:
        raise ConfigError(f"config error: hardware = [{len(targets)} targets]: needs costmodel.source 'profile' "
                          f"(here {costmodel!r}); a target is estimated from the roofline probes of the machine "
                          "the cost model was measured on, which an imported cost model does not carry")
    seen = set()
    for i, target in enumerate(targets):
        if target["name"] == HERE:
            raise ConfigError(f"config error: hardware[{i}].name = {HERE!r}: reserved for the machine the "
                              "pipeline runs on; give the target another name")
        if target["name"] in seen:
            raise ConfigError(f"config error: hardware[{i}].name = {target['name']!r}: must differ from every other "
                              "target's name")
        seen.add(target["name"])
        if target.get("launch_overhead_ms") is not None and machine_kind(target) != "gpu":
            raise ConfigError(f"config error: hardware[{i}].launch_overhead_ms = {target['launch_overhead_ms']!r}: "
                              "applies to kind gpu only (a CPU's host loop is in the terms measured here)")
        if target.get("core_speedup") is not None and machine_kind(target) != "cpu":
            raise ConfigError(f"config error: hardware[{i}].core_speedup = {target['core_speedup']!r}: applies to kind "
                              "cpu only (a GPU's host time per call is its launch_overhead_ms)")


def carry_over_check_skipped(config: dict) -> str | None:
    """Why a run of `config` does not check the carry-over (None: it does). The check carries this
    machine's model to itself at 1 thread, so it runs when asked (carry_over_check, on by default) and
    it can measure something: a target whose estimates it vouches for ("no target" otherwise; a target
    already demands a profiled cost model) and a profile of 2 or more threads to profile again at 1
    ("one thread"). A config that cannot be checked is not refused: `hardware: []` or a 1-core machine
    are ordinary runs, and the report says why the accuracy was not measured."""
    if not config.get("carry_over_check", False):
        return "off"
    if not config.get("hardware"):
        return "no target"
    if resolve_threads(config["profile"]["threads"]) < 2:
        return "one thread"
    return None


def costmodel_source(config: dict) -> str:
    """"profile", or the path of the cost-model JSON the run imports instead of profiling."""
    return config.get("costmodel", {}).get("source", PROFILE_SOURCE)


def _check_costmodel(section: dict | None) -> None:
    if section is None or section["source"] == PROFILE_SOURCE:
        return
    source = section["source"]
    if not Path(source).exists():
        raise ConfigError(f"config error: costmodel.source = {source!r}: no such file (from {Path.cwd()}); must be "
                          f"{PROFILE_SOURCE!r} or the path of a cost-model JSON file, relative to that directory")
    from servingplan.costmodel import read_file
    try:
        read_file(source)
    except ValueError as exc:
        raise ConfigError(f"config error: costmodel.source = {exc}")


def _check_gpu_check(path: str | None) -> None:
    """config gpu_check (issue 36): the gpu_check.json of a GPU check (python -m servingplan.gpu_check),
    relative to the directory snakemake runs in, or null. A regular file holding the check's contract
    (servingplan.plan.gpu_evidence.read_check), made on a GPU with the full model and a CPU model carried over:
    the report quotes its errors and the GPU targets take its host time per call."""
    if path is None:
        return
    from servingplan.plan.gpu_evidence import read_check   # here: only a config naming a check reads one
    try:
        read_check(path)
    except ValueError as exc:
        raise ConfigError(f"config error: gpu_check = {' '.join(str(exc).split())}")


def _check_device(device: str) -> None:
    if device == "cpu":
        return
    # imported here: torch takes seconds to import, and a CPU run need not pay for it at every start
    import torch
    if not torch.cuda.is_available():
        raise ConfigError(f"config error: model.device = {device!r}: torch sees no CUDA GPU on this machine "
                          "(torch.cuda.is_available() is False); use 'cpu'")


def _check_step_budget(config: dict) -> None:
    """Counting every token of a step, a chunk must leave room for a prompt token beside the decodes
    of a full running set (vLLM requires max_num_batched_tokens >= max_num_seqs), or a step could
    carry no work."""
    sweep = config["sweep"]
    if chunk_budget(sweep) != "step_tokens":
        return
    validation = config["validation"]
    bounds = [("sweep.chunk_size", sweep["chunk_size"], sweep["chunk_size"], max(sweep["caps"]), "sweep.caps"),
              ("sweep.chunk_sizes", sweep["chunk_sizes"], min(sweep["chunk_sizes"]), max(sweep["caps"]), "sweep.caps")]
    if chunks(validation["policy"]):
        bounds.append(("sweep.chunk_size", sweep["chunk_size"], sweep["chunk_size"], validation["cap"],
                       "validation.cap"))
    for key, value, size, cap, cap_key in bounds:
        if size < cap:
            raise ConfigError(f"config error: {key} = {value}: with sweep.chunk_budget step_tokens every chunk "
                              f"must be >= the largest cap ({cap_key}: {cap}), so a step's decodes leave room "
                              "for prompt tokens")


def _check_trace(config: dict) -> list[str]:
    """A trace file is read once here, so a bad row, or a request longer than the context each sequence
    is reserved (unless the trace says to skip or clip it), stops the run before any work."""
    trace, workload = config["workload"].get("trace"), config["workload"]
    if trace is None:
        return []
    if workload.get("burstiness") is not None:
        raise ConfigError(f"config error: workload.burstiness = {workload['burstiness']!r}: shapes drawn arrivals; "
                          "workload.trace replays the file's own, so remove one of them")
    reserved_context = config["memory"]["max_context"]
    limit = trace.get("max_context", reserved_context)
    if limit > reserved_context:
        raise ConfigError(f"config error: workload.trace.max_context = {limit}: must be <= memory.max_context "
                          f"({reserved_context}), the context each sequence is reserved")
    if trace.get("too_long", "refuse") != "refuse" and "max_context" not in trace:
        raise ConfigError(f"config error: workload.trace.too_long = {trace['too_long']!r}: needs "
                          "workload.trace.max_context, the context requests are fitted to")
    # the sweep, the capacity search and the validation all rescale the trace to their own rates, with
    # workload.rate as today's load, so a rate of the trace's own could only contradict it
    if "rate" in trace and not math.isclose(trace["rate"], workload["rate"], rel_tol=1e-9):
        raise ConfigError(f"config error: workload.trace.rate = {trace['rate']}: the pipeline replays the trace at "
                          f"workload.rate ({workload['rate']}) as today's load, so it must equal that or be left out")
    # imported here: numpy and pandas would slow every snakemake start that has no trace
    from servingplan.simulate.workload import load_trace
    try:
        loaded = load_trace(**{**trace, "max_context": limit})
    except (OSError, ValueError) as exc:
        raise ConfigError(f"config error: workload.trace.path = {trace['path']!r}: {' '.join(str(exc).split())}")
    if len(loaded.trace) < 2:
        dropped = f"{loaded.skipped_zero_tokens} rows with 0 tokens"
        if loaded.too_long == "skip":
            dropped += f" and {loaded.too_long_requests} requests longer than the context"
        raise ConfigError(f"config error: workload.trace.path = {trace['path']!r}: {len(loaded.trace)} requests "
                          f"after skipping {dropped}; needs at least 2")
    own_rate = loaded.trace.mean_rate_rps
    if own_rate is None:
        raise ConfigError(f"config error: workload.trace.path = {trace['path']!r}: all {len(loaded.trace)} requests "
                          "arrive at one time (within 1 us); the pipeline replays a trace at workload.rate and the "
                          "sweep's rates by rescaling its arrival gaps, and a burst has none")
    _check_replay_rates(config, len(loaded.trace))
    if own_rate is not None and not math.isclose(own_rate, workload["rate"], rel_tol=0.01):
        return [f"config warning: workload.trace.path = {trace['path']!r} arrives at {own_rate:.4g} req/s on "
                f"average; the pipeline replays it at workload.rate ({workload['rate']:g} req/s) as today's load"]
    return []


def _check_replay_rates(config: dict, requests: int) -> None:
    """Every rate the stages draw or rescale the workload's `requests` to (today's, the sweep's, the
    capacity target, the capacity search's lowest, exercise 2's own) must keep them within the span a
    simulation replays: the stage would refuse a slower one hours into the run, and the workload
    description would quote an infinite replayed span."""
    from servingplan.simulate.workload import check_replay_rate
    rates = [("workload.rate", config["workload"]["rate"], requests),
             *((f"sweep.rates[{i}]", rate, requests) for i, rate in enumerate(config["sweep"]["rates"])),
             ("slo.capacity_target_rate", config["slo"]["capacity_target_rate"], requests),
             ("capacity.rate_min", config["capacity"]["rate_min"], requests),
             ("exercise2.rate", config["exercise2"]["rate"], config["exercise2"]["num_requests"])]
    for key, rate, count in rates:
        try:
            check_replay_rate(count, rate)
        except ValueError as exc:
            raise ConfigError(f"config error: {key} = {rate!r}: {exc}")


def read(path) -> dict:
    from servingplan.io import read_text_input
    try:
        return yaml.safe_load(read_text_input(path, "config", MAX_CONFIG_BYTES))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"config error: {' '.join(str(exc).split())}")
    except yaml.YAMLError as exc:
        raise ConfigError(f"config error: {path}: cannot be read as YAML ({str(exc).splitlines()[0]})")
    except RecursionError:
        raise ConfigError(f"config error: {path}: nested deeper than YAML can be read")


def load(path) -> dict:
    config = read(path)
    check(config)
    return config


def check_or_exit(config: dict) -> None:
    """For entry points: print the one-line reason and exit 2 instead of a traceback; print each
    warning on its own line and go on."""
    try:
        warnings = check(config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(2)
    for line in warnings:
        print(line, file=sys.stderr)


def overlaid(paths) -> dict:
    """config.yaml with each file of `paths` merged on top, key by key into nested sections, as
    `snakemake --configfile` merges its files onto the Snakefile's configfile."""
    config = read(ROOT / "config.yaml")
    for path in paths:
        if Path(path).resolve() != (ROOT / "config.yaml").resolve():
            config = _merged(config, read(path))
    return config


def _merged(base, overlay):
    if not (isinstance(base, dict) and isinstance(overlay, dict)):
        return overlay
    return {**base, **{key: _merged(base.get(key), value) for key, value in overlay.items()}}


if __name__ == "__main__":
    # python -m servingplan.config [OVERLAY.yaml ...]: the config snakemake would run with
    try:
        config = overlaid(sys.argv[1:])
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(2)
    check_or_exit(config)
    print("config ok")
