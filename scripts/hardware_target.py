from servingplan.costmodel import load
from servingplan.hardware import target_plan
from servingplan.io import read_json, write_json
from servingplan.pipeline import run_stage


def main(sm):
    write_json(sm.output[0], target_plan(load(sm.input.costmodel), read_json(sm.input.machine), sm.params.model,
                                         sm.params.target, [(p, int(c)) for p, c in sm.params.cells],
                                         sm.params.workload, sm.params.slo, sm.params.sweep, sm.params.memory,
                                         sm.params.seeds, sm.params.capacity, sm.params.cost))


run_stage(snakemake, main)
