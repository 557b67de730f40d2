import pandas as pd

from servingplan.io import read_json, write_csv, write_json
from servingplan.pipeline import run_stage
from servingplan.planner import memory_table


def main(sm):
    table, summary = memory_table(read_json(sm.input.machine), pd.read_csv(sm.input.latency), sm.params.memory,
                                  sm.params.rate)
    write_csv(sm.output.table, table)
    write_json(sm.output.summary, summary)


run_stage(snakemake, main)
