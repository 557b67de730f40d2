from servingplan.costmodel import load
from servingplan.io import read_json, write_json
from servingplan.llamacpp.compare import engine_comparison
from servingplan.pipeline import run_stage


def main(sm):
    p = sm.params
    write_json(sm.output[0], engine_comparison(load(sm.input.torch_costmodel), load(sm.input.llamacpp_costmodel),
                                               read_json(sm.input.torch_validation),
                                               read_json(sm.input.llamacpp_validation), p.workload, p.slo,
                                               p.validation, p.sweep, p.llamacpp, p.seed))


run_stage(snakemake, main)
