from servingplan.costmodel import read_written
from servingplan.io import read_json, write_json
from servingplan.pipeline import run_stage
from servingplan.searches import fleet_cell


def main(sm):
    write_json(sm.output[0], fleet_cell(read_written(sm.input.costmodel), read_json(sm.input.machine),
                                        sm.wildcards.policy, int(sm.wildcards.cap), sm.params.workload,
                                        sm.params.slo, sm.params.sweep, sm.params.memory, sm.params.seeds,
                                        sm.params.capacity, sm.params.cost))


run_stage(snakemake, main)
