from servingplan.pipeline import run_stage
from servingplan.profiling.fit import run_fit


def main(sm):
    run_fit(sm.input.points, sm.input.samples, sm.input.machine, sm.params.fit, sm.params.seed,
            sm.output.costmodel, sm.output.report, sm.output.predicted)


run_stage(snakemake, main)
