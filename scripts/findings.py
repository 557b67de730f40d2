import pandas as pd

from servingplan.costmodel import read_written
from servingplan.io import write_json
from servingplan.pipeline import run_stage
from servingplan.report.findings import findings


def main(sm):
    chunks = pd.read_csv(sm.input.chunks)
    write_json(sm.output[0], findings(pd.read_csv(sm.input.latency), pd.read_csv(sm.input.capacity),
                                      chunks if not chunks.empty else None, read_written(sm.input.costmodel),
                                      sm.params.slo, sm.params.workload))


run_stage(snakemake, main)
