import glob
import hashlib
import json
import os

from servingplan.config import (HERE, LLAMACPP, PROFILE_SOURCE, carry_over_check_skipped, check_or_exit,
                                costmodel_source, engine)
from servingplan.memory import SIM_MEMORY_KEYS
from servingplan.plan import names as display_names
# a GPU target that sets no launch_overhead_ms pays the host time per call a GPU check measured (config gpu_check)
from servingplan.plan.gpu_evidence import with_measured_launch_overhead
from servingplan.plan.hardware import kv_memory_of, memory_for
from servingplan.pipeline import canonical, config_keys
from servingplan.profile.machine import fingerprint, resolve_threads
from servingplan.seeds import simulation_seeds
from servingplan.simulate.policies import wildcard as policy_wildcard

check_or_exit(config)
# Every rule's params are built from this config: in canonical key order, the same values restated in
# another order (a re-saved config.yaml) give the same params and rerun nothing.
_canonical_config = canonical(config)
config.clear()
config.update(_canonical_config)

# The profile describes the machine snakemake was started on. Cluster jobs re-read this file on their
# node and inherit the submit host's environment, so they keep its fingerprint instead of their own.
MACHINE = os.environ.setdefault("SERVINGPLAN_MACHINE", fingerprint(config["profile"]["threads"],
                                                                   config["model"].get("device", "cpu")))
PROFILE_DIR = f"results/profile/{MACHINE}"
# `costmodel.source`: "profile" measures this machine (profile, fit, validate); the path of a cost-model
# JSON, relative to the working directory, replaces those three stages by import_costmodel (fit.smk).
COSTMODEL_SOURCE = costmodel_source(config)
PROFILED = COSTMODEL_SOURCE == PROFILE_SOURCE
SEEDS = simulation_seeds(config)
CELLS = [f"{policy}_cap{cap}" for policy in config["sweep"]["policies"] for cap in config["sweep"]["caps"]]
HARDWARE = {target["name"]: target for target in config.get("hardware", [])}
# The machines the planner sizes the service on: this one (HERE, its own cost model) and each target of
# config `hardware` (the cost model carried over to it by the roofline). Every simulation rule runs per
# {machine}: a machine's results are under results/machines/{machine}/.
MACHINES = [HERE, *HARDWARE]
MACHINE_DIR = "results/machines/{machine}"


def memory_of(name, keep=None):
    """The memory section as machine `name`'s jobs read it (the keys in `keep`), with that machine's KV
    model (kv_memory_of: configured, or its engine's default) as `kv_memory`, which drives both the
    simulation's admission and the memory verdict."""
    return config_keys(memory_for(config, name), keep=keep)


def machine_memory(keep=None):
    """memory_of as a params function of the job's machine wildcard."""
    return lambda wildcards: memory_of(wildcards.machine, keep)


def runtime_input(wildcards):
    """A paged pool on this machine sits beside the serving runtime measured there (serving_memory.json,
    validate.smk, included later: looked up when the job is built); slots, a target or an imported cost
    model read no measurement."""
    if wildcards.machine != HERE or not PROFILED or kv_memory_of(config, HERE)["model"] != "paged":
        return {}
    return {"serving_memory": rules.serving_memory.output[0]}


wildcard_constraints:
    policy=policy_wildcard(),
    cap=r"\d+",
    machine=r"[A-Za-z0-9][A-Za-z0-9._-]*",


def machine_path(name):
    """A per-machine output pattern as an input function: `name` under the job's machine directory."""
    return lambda wildcards: f"results/machines/{wildcards.machine}/{name}"


def machine_cells(pattern, **dimensions):
    """An input function: `pattern` (with {cell} or {cap}) under the job's machine directory, for each
    value of `dimensions`."""
    return lambda wildcards: expand(f"results/machines/{wildcards.machine}/{pattern}", **dimensions)


def repository_files(pattern):
    """Files of the repository (the directory of the Snakefile), whatever directory snakemake runs in,
    named relative to that directory: run from the repository they read `servingplan/...` as before."""
    return sorted(os.path.relpath(f) for f in glob.glob(os.path.join(workflow.basedir, pattern)))


def sources(*patterns):
    """Package sources a rule's results depend on: editing them reruns the rule (Snakemake does not
    follow imports by itself)."""
    return sorted(f for p in patterns for f in repository_files(f"servingplan/{p}"))


# A trace file is an input of every rule that reads it: editing the file reruns them. Its path, like
# every path the user names, is relative to the directory snakemake runs in.
TRACE_FILE = [config["workload"]["trace"]["path"]] if config["workload"].get("trace") else []
# memory.py sizes a cell's KV pool; engine/memory_probe.py reads the runtime a paged pool sits beside
SIM_SOURCES = sources("simulate/*.py", "costmodel.py", "io.py", "pipeline.py", "memory.py",
                      "engine/memory_probe.py")
CONFIG_HASH = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]


# The measurements of this machine run alone, one after another, before any simulation: the profile, the
# fit it feeds, the real-time replay (nearest in time to the profile it is compared with), then the
# 1-thread profile of carry_over_check. Each claims every core, and when one finishes, snakemake starts
# the ready job of highest priority that fits, so this priority hands the idle machine to the next
# measurement. Without it, one-core jobs ready beside the replay would take the freed cores one by one,
# and the replay would wait until every simulation had finished. A priority orders jobs without adding
# an input: a measurement that reruns reruns nothing after it.
MEASURING_FIRST = 50
# After the measurements, the longest single jobs start first (the serving-memory probe and the carry-over
# check's fit and capacity searches, 45 to 90 s each) so the short simulation cells fill the other cores
# beside them. At equal priority the check started last: in a cold run of 6393273 it began at 605 s of 655,
# and for its last 26 s ran alone on one of the two cores while the report waited for it.
LONG_JOBS_FIRST = 10
