from pathlib import Path

from servingplan.pipeline import run_stage
from servingplan.report import write_report


def main(sm):
    # every stage logs beside this one; their timestamps give the pipeline's wall time
    write_report(dict(sm.input.items()), sm.params.config, sm.params.config_hash, sm.params.machine,
                 sm.output.html, sm.output.md, sm.output.provenance, log_dir=Path(sm.log[0]).parent)


run_stage(snakemake, main)
