import pandas as pd

from servingplan.costmodel import read_written
from servingplan.io import read_json, write_json
from servingplan.pipeline import run_stage
from servingplan.plan.planner import recommend


def main(sm):
    serving_memory = sm.input.get("serving_memory")
    write_json(sm.output[0], recommend(
        pd.read_csv(sm.input.latency), pd.read_csv(sm.input.capacity), pd.read_csv(sm.input.memory),
        [read_json(p) for p in sm.input.fleet], sm.params.cost, sm.params.slo, sm.params.workload, sm.params.seeds,
        step_model=read_written(sm.input.costmodel), machine=read_json(sm.input.machine), label=sm.params.label,
        serving_memory=read_json(serving_memory) if serving_memory else None,
        searches=[read_json(p) for p in sm.input.searches], kv_memory=sm.params.kv_memory))


run_stage(snakemake, main)
