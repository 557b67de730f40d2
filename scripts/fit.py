from servingplan.fit.step_model import run_fit
from servingplan.pipeline import run_stage


def main(sm):
    run_fit(sm.input.points, sm.input.samples, sm.input.machine, sm.params.fit, sm.params.seed,
            sm.output.costmodel, sm.output.report, sm.output.predicted)


run_stage(snakemake, main)
