from pathlib import Path

import pandas as pd

from servingplan.costmodel import load
from servingplan.hardware import target_verdicts
from servingplan.io import read_json, write_json
from servingplan.pipeline import run_stage
from servingplan.planner import recommend


def main(sm):
    validation = sm.input.get("validation")
    validation = read_json(validation) if validation and Path(validation).is_file() else None
    machine = read_json(sm.input.machine)
    write_json(sm.output[0], recommend(
        pd.read_csv(sm.input.latency), pd.read_csv(sm.input.capacity), pd.read_csv(sm.input.memory),
        [read_json(p) for p in sm.input.fleet], sm.params.cost, sm.params.slo, sm.params.workload, sm.params.seeds,
        step_model=load(sm.input.costmodel), machine=machine, validation=validation))
    write_json(sm.output.hardware, {"targets": [
        target_verdicts(read_json(path), target, machine, sm.params.cost, sm.params.slo, sm.params.workload,
                        sm.params.memory, sm.params.seeds)
        for path, target in zip(sm.input.hardware, sm.params.hardware)]})


run_stage(snakemake, main)
