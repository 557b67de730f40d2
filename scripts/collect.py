import pandas as pd

from servingplan.io import read_json, write_csv
from servingplan.pipeline import run_stage
from servingplan.plan.planner import capacity_rows


def main(sm):
    write_csv(sm.output.latency, pd.concat([pd.read_csv(p) for p in sm.input.sweep], ignore_index=True))
    write_csv(sm.output.capacity, pd.DataFrame([row for p in sm.input.capacity for row in capacity_rows(read_json(p))]))


run_stage(snakemake, main)
