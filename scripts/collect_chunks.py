import pandas as pd

from servingplan.io import write_csv
from servingplan.pipeline import run_stage


def main(sm):
    write_csv(sm.output[0], pd.concat([pd.read_csv(p) for p in sm.input.chunks], ignore_index=True))


run_stage(snakemake, main)
