from servingplan.io import read_json, write_json
from servingplan.pipeline import run_stage
from servingplan.planner import decide, hardware_verdicts


def main(sm):
    recommendations = [read_json(p) for p in sm.input.recommendations]
    write_json(sm.output.decision, decide(recommendations))
    by_machine = {r["label"]["machine"]: r for r in recommendations}
    write_json(sm.output.hardware, hardware_verdicts(
        [(target, read_json(terms), by_machine[target["name"]])
         for target, terms in zip(sm.params.targets, sm.input.terms)]))


run_stage(snakemake, main)
