# Replays Poisson traces through the real engine on this machine and compares with the simulator.
# Like profiling it measures the machine, so it takes every core and stays local.
# With an imported cost model (costmodel.source a file) nothing asks for it: that model is not this machine.
localrules: validate


rule validate:
    # first in line once the cost model exists: the replays then run as close in time to the profile
    # as they can, before the simulation jobs heat the machine for minutes
    priority: 50
    input:
        costmodel=COSTMODEL,
        machine=rules.profile.output.machine,
        trace=TRACE_FILE,
        code=SIM_SOURCES + sources("serving/*.py", "profiling/*.py", "validation.py", "planner.py"),
    output:
        summary=report("results/validation/comparison.csv", caption="../reports/captions/validation.rst",
                       category="Validation"),
        requests="results/validation/requests.csv",
        steps="results/validation/steps.csv",
        steps_by_batch="results/validation/steps_by_batch.csv",
        meta="results/validation/validation.json",
    params:
        validation=config["validation"],
        workload=config["workload"],
        model=config["model"],
        profile=config["profile"],
        sweep=config["sweep"],
        memory=config["memory"],
        seed=config["seed"],
    threads: workflow.cores
    resources:
        mem_mb=4000,
        runtime=20,
    log:
        "results/logs/validate.log",
    benchmark:
        "results/benchmarks/validate.tsv"
    script:
        "../scripts/validate.py"
