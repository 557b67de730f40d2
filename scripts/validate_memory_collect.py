from servingplan.io import read_json, write_json
from servingplan.pipeline import run_stage
from servingplan.serving.memory_probe import collect


def main(sm):
    machine = read_json(sm.input.machine) if "machine" in sm.input.keys() else None
    write_json(sm.output[0], collect([read_json(path) for path in sm.input.cells], machine))


run_stage(snakemake, main)
