from servingplan.costmodel import load
from servingplan.io import read_json, write_csv, write_json
from servingplan.llamacpp.validation import run_llamacpp_comparison
from servingplan.pipeline import run_stage


def main(sm):
    p = sm.params
    out = run_llamacpp_comparison(read_json(sm.input.replay), load(sm.input.costmodel), p.validation, p.memory,
                                  p.sweep, read_json(sm.input.terms))
    write_csv(sm.output.summary, out["comparison"])
    write_csv(sm.output.steps, out["steps"])
    write_csv(sm.output.steps_by_kind, out["steps_by_kind"])
    write_json(sm.output.meta, out["meta"])


run_stage(snakemake, main)
