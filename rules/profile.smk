# Profiling measures the machine the pipeline runs on, so it takes every core (nothing runs beside it
# to distort the timings) and always runs locally, even under a cluster executor. The grid is always
# the config's `profile` section; `model.tiny` (config/quick.yaml) swaps in the 2-layer model alone.
from servingplan.profile.grid import check_references

localrules: profile


rule profile:
    # the first measurement (MEASURING_FIRST, common.smk): nothing else has run when it starts
    priority: MEASURING_FIRST
    input:
        sources("profile/__init__.py", "profile/grid.py", "profile/machine.py", "profile/measure.py",
                "profile/model.py", "fit/step_model.py", "io.py", "pipeline.py"),
    output:
        points=f"{PROFILE_DIR}/profile.csv",
        samples=f"{PROFILE_DIR}/samples.csv",
        machine=f"{PROFILE_DIR}/machine.json",
    params:
        # at 2 or more threads, the carry-over check's reference shapes read at 1 thread in this window too
        # (rules/check.smk: its 1-thread profile runs minutes later and is compared in this window); from the
        # profile section alone, so turning the check on or off keeps the profile
        profile={**config["profile"], "check_references": check_references(config["profile"])}
                if resolve_threads(config["profile"]["threads"]) >= 2 else config["profile"],
        model=config["model"],
        seed=config["seed"],
    threads: workflow.cores
    resources:
        mem_mb=4000,
        runtime=20,
    log:
        f"results/logs/profile_{MACHINE}.log",
    benchmark:
        f"results/benchmarks/profile_{MACHINE}.tsv"
    script:
        "../scripts/profile.py"
