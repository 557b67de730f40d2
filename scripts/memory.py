import pandas as pd

from servingplan.engine.memory_probe import runtime_bytes
from servingplan.io import read_json, write_csv, write_json
from servingplan.pipeline import run_stage
from servingplan.plan.planner import memory_table, searched_frames, with_searched


def main(sm):
    machine = read_json(sm.input.machine)
    serving = sm.input.get("serving_memory")
    serving_memory = read_json(serving) if serving else None
    searched_latency, _ = searched_frames([read_json(p) for p in sm.input.searches])
    # a paged pool on this machine sits beside the measured runtime (as its simulations' pools did)
    runtime = (runtime_bytes(serving_memory, machine["memory"]["param_bytes"])
               if serving_memory and sm.params.memory["kv_memory"] == "paged" else None)
    table, summary = memory_table(machine, with_searched(pd.read_csv(sm.input.latency), searched_latency),
                                  sm.params.memory, sm.params.rate, runtime, serving_memory)
    write_csv(sm.output.table, table)
    write_json(sm.output.summary, summary)


run_stage(snakemake, main)
