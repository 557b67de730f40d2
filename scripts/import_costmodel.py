from servingplan.architecture import unmeasured_sizes
from servingplan.costmodel import read_file
from servingplan.io import write_json
from servingplan.pipeline import run_stage


def main(sm):
    read_file(sm.input.costmodel).save(sm.output.costmodel)
    write_json(sm.output.sizes, unmeasured_sizes(sm.params.model))


run_stage(snakemake, main)
