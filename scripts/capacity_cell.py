from servingplan.costmodel import read_written
from servingplan.engine.memory_probe import measured_runtime
from servingplan.io import read_json, write_json
from servingplan.pipeline import run_stage
from servingplan.simulate.searches import capacity_cell


def main(sm):
    machine = read_json(sm.input.machine)
    write_json(sm.output[0], capacity_cell(read_written(sm.input.costmodel), machine,
                                           sm.wildcards.policy, int(sm.wildcards.cap), sm.params.workload,
                                           sm.params.slo, sm.params.sweep, sm.params.memory, sm.params.seeds,
                                           sm.params.capacity,
                                           runtime_bytes=measured_runtime(sm.input.get("serving_memory"), machine)))


run_stage(snakemake, main)
