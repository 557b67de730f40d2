from servingplan.io import read_json, write_csv, write_json
from servingplan.pipeline import run_stage
from servingplan.plan.planner import decide, hardware_verdicts, options_table


def main(sm):
    recommendations = [read_json(p) for p in sm.input.recommendations]
    decision = decide(recommendations)
    write_json(sm.output.decision, decision)
    write_csv(sm.output.options, options_table(decision))
    by_machine = {r["label"]["machine"]: r for r in recommendations}
    write_json(sm.output.hardware, hardware_verdicts(
        [(target, read_json(terms), by_machine[target["name"]])
         for target, terms in zip(sm.params.targets, sm.input.terms)]))


run_stage(snakemake, main)
