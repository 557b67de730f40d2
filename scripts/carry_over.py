from servingplan import architecture
from servingplan.costmodel import read_written
from servingplan.io import read_json, write_json
from servingplan.pipeline import run_stage
from servingplan.plan.hardware import carry_over, here_roofline


def main(sm):
    here = here_roofline(read_json(sm.input.machine))
    model, terms = carry_over(read_written(sm.input.costmodel), architecture.architecture(sm.params.model), here,
                              sm.params.target)
    write_json(sm.output.costmodel, model.to_dict())
    write_json(sm.output.terms, {"target": sm.params.target, "here": here, "terms": terms})


run_stage(snakemake, main)
