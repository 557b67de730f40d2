from servingplan.costmodel import read_written
from servingplan.io import read_json, write_csv
from servingplan.pipeline import run_stage
from servingplan.planner import sweep_cell


def main(sm):
    frame = sweep_cell(read_written(sm.input.costmodel), read_json(sm.input.machine), sm.wildcards.policy,
                       int(sm.wildcards.cap), sm.params.workload, sm.params.slo, sm.params.sweep,
                       sm.params.memory, sm.params.seeds)
    write_csv(sm.output[0], frame)


run_stage(snakemake, main)
