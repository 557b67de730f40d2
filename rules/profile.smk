# Profiling measures the machine the pipeline runs on, so it takes every core (nothing runs beside it
# to distort the timings) and always runs locally, even under a cluster executor.
localrules: profile


rule profile:
    input:
        sources("profiling/*.py", "io.py", "pipeline.py"),
    output:
        points=f"{PROFILE_DIR}/profile.csv",
        samples=f"{PROFILE_DIR}/samples.csv",
        machine=f"{PROFILE_DIR}/machine.json",
    params:
        profile=config["profile"],
        model=config["model"],
        seed=config["seed"],
        quick=config["model"].get("tiny", False),
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
