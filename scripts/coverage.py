from servingplan.costmodel import load
from servingplan.coverage import coverage
from servingplan.io import write_json
from servingplan.pipeline import run_stage


def main(sm):
    write_json(sm.output[0], coverage(sm.params.workload, sm.params.seeds, load(sm.input.costmodel)))


run_stage(snakemake, main)
