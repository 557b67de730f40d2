from servingplan.costmodel import read_written
from servingplan.io import read_json, write_csv, write_json
from servingplan.pipeline import run_stage
from servingplan.validate.validation import run_comparison


def main(sm):
    p = sm.params
    out = run_comparison(read_json(sm.input.replay), read_written(sm.input.costmodel), read_json(sm.input.machine),
                         p.workload, p.validation, p.sweep, p.memory, p.seed)
    write_csv(sm.output.summary, out["comparison"])
    write_csv(sm.output.requests, out["requests"])
    write_csv(sm.output.steps, out["steps"])
    write_csv(sm.output.steps_by_batch, out["steps_by_batch"])
    write_json(sm.output.meta, out["meta"])


run_stage(snakemake, main)
