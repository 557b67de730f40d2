# Profiling measures the machine the pipeline runs on, so it takes every core (nothing runs beside it
# to distort the timings) and always runs locally, even under a cluster executor. The grid is always
# the config's `profile` section; `model.tiny` (config/quick.yaml) swaps in the 2-layer model alone.
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
        profile=config["profile"],
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
