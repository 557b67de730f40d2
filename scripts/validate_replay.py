import pandas as pd

from servingplan.costmodel import read_written
from servingplan.io import read_json, write_json
from servingplan.pipeline import run_stage
from servingplan.profile.kvpool import configure_allocator
from servingplan.profile.model import QUICK_CONFIG_OVERRIDES, load_model
from servingplan.validate.validation_replay import run_replay


def main(sm):
    p = sm.params
    # before the model is loaded, as in the profiler: set later, the same reference calls ran ~5% slower
    configure_allocator()
    tiny = p.model.get("tiny", False)
    model, _ = load_model("random" if tiny else p.model["source"], p.seed, QUICK_CONFIG_OVERRIDES if tiny else None,
                          p.model.get("device", "cpu"))
    replayed = run_replay(model, read_written(sm.input.costmodel), read_json(sm.input.machine), pd.read_csv(sm.input.points),
                          p.workload, p.validation, p.sweep, p.memory, p.seed, threads=p.threads or None)
    write_json(sm.output.replay, replayed)


run_stage(snakemake, main)
