from servingplan.io import write_csv, write_json
from servingplan.pipeline import run_stage
from servingplan.plan import exercise2


def main(sm):
    outputs = exercise2.run(sm.params.exercise2, sm.params.seed)
    write_json(sm.output.answers, outputs.answers)
    write_csv(sm.output.cap_sweep, outputs.cap_sweep)
    write_csv(sm.output.chunk_sweep, outputs.chunk_sweep)
    write_csv(sm.output.curve, outputs.curve)


run_stage(snakemake, main)
