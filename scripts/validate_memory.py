from servingplan.engine.memory_probe import measure
from servingplan.io import read_json, write_json
from servingplan.pipeline import run_stage
from servingplan.profile.kvpool import configure_allocator
from servingplan.profile.machine import configure_threads
from servingplan.profile.model import QUICK_CONFIG_OVERRIDES, load_model
from servingplan.simulate.policies import chunk_budget


def main(sm):
    p = sm.params
    # the engine's process settings: its malloc setting (before the model is loaded) and its threads;
    # the probes themselves run at one thread each, as many at once as the job's threads
    configure_allocator()
    configure_threads(p.threads or None)
    tiny = p.model.get("tiny", False)
    model, _ = load_model("random" if tiny else p.model["source"], p.seed, QUICK_CONFIG_OVERRIDES if tiny else None,
                          p.model.get("device", "cpu"))
    machine = read_json(sm.input.machine) if "machine" in sm.input.keys() else None
    write_json(sm.output[0], measure(model, p.sweep["policies"], p.sweep["caps"], p.memory["max_context"],
                                     p.sweep["chunk_size"], chunk_budget(p.sweep), p.memory["block_size"], machine,
                                     workers=sm.threads))


run_stage(snakemake, main)
