# One job per (policy, cap) cell, so `--cores N` or a cluster executor runs the cells in parallel.

SIM_PARAMS = dict(
    workload=config["workload"],
    slo=config["slo"],
    sweep=config["sweep"],
    memory=config["memory"],
    seeds=SEEDS,
)


rule workload:
    """What the simulations replay, described for the report: a trace file as read and as replayed."""
    input:
        trace=TRACE_FILE,
        code=sources("workload.py", "io.py", "pipeline.py"),
    output:
        report("results/workload/workload.json", caption="../reports/captions/workload.rst", category="Workload"),
    params:
        workload=config["workload"],
    threads: 1
    resources:
        mem_mb=1000,
        runtime=5,
    log:
        "results/logs/workload.log",
    script:
        "../scripts/workload.py"


rule sweep_cell:
    input:
        costmodel=COSTMODEL,
        machine=MACHINE_JSON,
        trace=TRACE_FILE,
        code=SIM_SOURCES,
    output:
        "results/sweep/cells/{policy}_cap{cap}.csv",
    params:
        **SIM_PARAMS,
    threads: 1
    resources:
        mem_mb=1000,
        runtime=15,
    log:
        "results/logs/sweep/{policy}_cap{cap}.log",
    benchmark:
        "results/benchmarks/sweep/{policy}_cap{cap}.tsv"
    script:
        "../scripts/sweep_cell.py"


rule chunk_cell:
    input:
        costmodel=COSTMODEL,
        machine=MACHINE_JSON,
        trace=TRACE_FILE,
        code=SIM_SOURCES + sources("planner.py"),
    output:
        "results/sweep/chunks/cap{cap}.csv",
    params:
        **SIM_PARAMS,
    threads: 1
    resources:
        mem_mb=1000,
        runtime=15,
    log:
        "results/logs/chunks/cap{cap}.log",
    benchmark:
        "results/benchmarks/chunks/cap{cap}.tsv"
    script:
        "../scripts/chunk_cell.py"


rule capacity_cell:
    input:
        costmodel=COSTMODEL,
        machine=MACHINE_JSON,
        trace=TRACE_FILE,
        code=SIM_SOURCES,
    output:
        "results/capacity/cells/{policy}_cap{cap}.json",
    params:
        **SIM_PARAMS,
        capacity=config["capacity"],
    threads: 1
    resources:
        mem_mb=1000,
        runtime=30,
    log:
        "results/logs/capacity/{policy}_cap{cap}.log",
    benchmark:
        "results/benchmarks/capacity/{policy}_cap{cap}.tsv"
    script:
        "../scripts/capacity_cell.py"


rule collect:
    input:
        sweep=expand("results/sweep/cells/{cell}.csv", cell=CELLS),
        capacity=expand("results/capacity/cells/{cell}.json", cell=CELLS),
        chunks=expand("results/sweep/chunks/cap{cap}.csv", cap=config["sweep"]["caps"]),
        code=sources("pipeline.py", "io.py", "planner.py"),
    output:
        latency=report("results/sweep/latency.csv", caption="../reports/captions/latency.rst", category="Simulation"),
        chunks="results/sweep/chunk_sweep.csv",
        capacity=report("results/capacity/capacity.csv", caption="../reports/captions/capacity.rst",
                        category="Simulation"),
    threads: 1
    resources:
        mem_mb=1000,
        runtime=5,
    log:
        "results/logs/collect.log",
    script:
        "../scripts/collect.py"
