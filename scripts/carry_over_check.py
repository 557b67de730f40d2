from servingplan.check.carry_check import check
from servingplan.costmodel import read_written
from servingplan.io import read_json, write_json
from servingplan.pipeline import run_stage


def main(sm):
    settings = {"workload": sm.params.workload, "slo": sm.params.slo, "sweep": {**sm.params.sweep, **sm.params.cells},
                "memory": sm.params.memory, "capacity": sm.params.capacity, "seeds": sm.params.seeds}
    write_json(sm.output[0], check(read_written(sm.input.costmodel), read_json(sm.input.machine),
                                   read_written(sm.input.costmodel_one), read_json(sm.input.machine_one),
                                   sm.params.model, settings))


run_stage(snakemake, main)
