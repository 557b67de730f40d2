# How far the carry-over to another machine can be trusted, measured in this run (config
# `carry_over_check: true`, servingplan/check/carry_check.py): this machine profiled again at 1 thread and
# fitted, then the cost model fitted at the profile's threads carried to it by the same roofline method
# as every `hardware:` target, and each capacity cell compared with the 1-thread model's. The 1-thread
# profile measures the machine like the first, so it takes every core and stays local. It runs minutes after
# the profile, which reads the check's reference shapes at 1 thread in its own window (rules/profile.smk), and the
# check brings the 1-thread model to that window where the two disagree beyond their noise.
from servingplan.profile.grid import check_profile

localrules: profile_one_thread

CHECK_DIR = "results/check/one_thread"


rule profile_one_thread:
    # after the first profile (whose machine description it does not read) and, by priority, after the
    # fit and the real-time replay (MEASURING_FIRST, common.smk), which should run as close in time to
    # that profile as they can, but before the simulation jobs heat the machine for minutes
    priority: MEASURING_FIRST - 5
    input:
        after=rules.profile.output.machine,
        code=sources("profile/__init__.py", "profile/grid.py", "profile/machine.py", "profile/measure.py",
                     "profile/model.py", "fit/step_model.py", "io.py", "pipeline.py"),
    output:
        points=f"{CHECK_DIR}/profile.csv",
        samples=f"{CHECK_DIR}/samples.csv",
        machine=f"{CHECK_DIR}/machine.json",
    params:
        # the profile's grid thinned, in fewer rounds, without warm-up calls (servingplan/profile/grid.py)
        profile=canonical(check_profile(config["profile"])),
        model=config["model"],
        seed=config["seed"],
    threads: workflow.cores
    resources:
        mem_mb=4000,
        runtime=20,
    log:
        "results/logs/profile_one_thread.log",
    benchmark:
        "results/benchmarks/profile_one_thread.tsv"
    script:
        "../scripts/profile.py"


rule fit_one_thread:
    priority: LONG_JOBS_FIRST
    input:
        points=rules.profile_one_thread.output.points,
        samples=rules.profile_one_thread.output.samples,
        machine=rules.profile_one_thread.output.machine,
        code=sources("fit/step_model.py", "costmodel.py"),
    output:
        costmodel=f"{CHECK_DIR}/costmodel.json",
        report=f"{CHECK_DIR}/fit_report.json",
        predicted=f"{CHECK_DIR}/predicted_vs_measured.csv",
    params:
        fit=config["fit"],
        seed=config["seed"],
    threads: 1
    resources:
        mem_mb=1000,
        runtime=5,
    log:
        "results/logs/fit_one_thread.log",
    script:
        "../scripts/fit.py"


rule carry_over_check:
    priority: LONG_JOBS_FIRST
    input:
        costmodel=COSTMODEL,
        machine=rules.profile.output.machine,
        costmodel_one=rules.fit_one_thread.output.costmodel,
        machine_one=rules.profile_one_thread.output.machine,
        trace=TRACE_FILE,
        code=SIM_SOURCES + sources("check/carry_check.py", "plan/hardware.py", "roofline.py", "architecture.py",
                                   "plan/planner.py", "simulate/capacity.py", "seeds.py", "simulate/workload.py"),
    output:
        "results/check/carry_over_check.json",
    params:
        # what the capacity cells read (their cells are the config's policies and caps), and the model's shape
        # this machine at 1 thread: its own KV model (no machine wildcard here)
        **{**sim_params(drop=("chunk_sizes", "rates")), "memory": memory_of(HERE, keep=SIM_MEMORY_KEYS)},
        cells=config_keys(config["sweep"], keep=("policies", "caps")),
        capacity=config_keys(config["capacity"]),
        model=config_keys(config["model"]),
    threads: 1
    resources:
        mem_mb=1000,
        runtime=30,
    log:
        "results/logs/carry_over_check.log",
    benchmark:
        "results/benchmarks/carry_over_check.tsv"
    script:
        "../scripts/carry_over_check.py"
