import pandas as pd

from servingplan.costmodel import load
from servingplan.io import read_json, write_json
from servingplan.llamacpp.validation import run_llamacpp_replay
from servingplan.pipeline import run_stage


def main(sm):
    p = sm.params
    replayed = run_llamacpp_replay(sm.input.gguf, load(sm.input.costmodel), pd.read_csv(sm.input.points),
                                   read_json(sm.input.profile), p.workload, p.validation, p.llamacpp, p.memory,
                                   p.model["seed"], p.server_logs, tiny=p.model["tiny"])
    write_json(sm.output.replay, replayed)


run_stage(snakemake, main)
