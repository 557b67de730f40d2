from servingplan.io import write_json
from servingplan.pipeline import run_stage
from servingplan.simulate.workload import describe


def main(sm):
    write_json(sm.output[0], describe(sm.params.workload))


run_stage(snakemake, main)
