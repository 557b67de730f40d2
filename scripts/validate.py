from servingplan.costmodel import load
from servingplan.io import read_json, write_csv, write_json
from servingplan.pipeline import run_stage
from servingplan.profiling.model import QUICK_CONFIG_OVERRIDES, load_model
from servingplan.serving.kvpool import configure_allocator
from servingplan.validation import run_validation


def main(sm):
    p = sm.params
    # before the model is loaded, as in the profiler: set later, the same reference calls ran ~5% slower
    configure_allocator()
    tiny = p.model.get("tiny", False)
    model, _ = load_model("random" if tiny else p.model["source"], p.seed, QUICK_CONFIG_OVERRIDES if tiny else None,
                          p.model.get("device", "cpu"))
    machine = read_json(sm.input.machine)
    out = run_validation(model, load(sm.input.costmodel), machine, machine, p.workload, p.validation, p.sweep,
                         p.memory, p.seed, threads=p.profile["threads"] or None)
    write_csv(sm.output.summary, out["comparison"])
    write_csv(sm.output.requests, out["requests"])
    write_csv(sm.output.steps, out["steps"])
    write_csv(sm.output.steps_by_batch, out["steps_by_batch"])
    write_json(sm.output.meta, out["meta"])


run_stage(snakemake, main)
