import pandas as pd

from servingplan.costmodel import read_written
from servingplan.engine.memory_probe import measured_runtime
from servingplan.io import read_json, write_json
from servingplan.pipeline import run_stage
from servingplan.plan.cap_search import cap_search


def main(sm):
    machine = read_json(sm.input.machine)
    write_json(sm.output[0], cap_search(
        read_written(sm.input.costmodel), machine, sm.wildcards.policy, sm.params.workload, sm.params.slo,
        sm.params.sweep, sm.params.memory, sm.params.seeds, sm.params.capacity, pd.read_csv(sm.input.latency),
        pd.read_csv(sm.input.capacity), runtime_bytes=measured_runtime(sm.input.get("serving_memory"), machine)))


run_stage(snakemake, main)
