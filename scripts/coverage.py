from servingplan.costmodel import read_written
from servingplan.io import write_json
from servingplan.pipeline import run_stage
from servingplan.report.coverage import coverage


def main(sm):
    write_json(sm.output[0], coverage(sm.params.workload, sm.params.seeds, read_written(sm.input.costmodel)))


run_stage(snakemake, main)
