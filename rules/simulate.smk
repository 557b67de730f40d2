# One job per (machine, policy, cap) cell, so `--cores N` or a cluster executor runs the cells in
# parallel. A cell's params are the config keys it reads and no more: the policy and cap come from its
# wildcards, so adding a cap, a policy or a target adds cells and reruns none of the others.


def costmodel_of(wildcards):
    """The step-time model a machine's cells simulate: this machine's (fitted or imported), or the one
    carried over to a target by the roofline (rule carry_over, plan.smk)."""
    return COSTMODEL if wildcards.machine == HERE else f"results/machines/{wildcards.machine}/costmodel.json"


def sim_params(drop=()):
    return dict(
        workload=config_keys(config["workload"]),
        slo=config_keys(config["slo"]),
        sweep=config_keys(config["sweep"], drop=("caps", "policies", *drop)),
        memory=machine_memory(keep=SIM_MEMORY_KEYS),
        seeds=SEEDS,
    )


rule workload:
    """What the simulations replay, described for the report: a trace file as read and as replayed."""
    input:
        trace=TRACE_FILE,
        code=sources("simulate/workload.py", "io.py", "pipeline.py"),
    output:
        report("results/workload/workload.json", caption="../reports/captions/workload.rst", category="Workload"),
    params:
        workload=config_keys(config["workload"]),
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
        unpack(runtime_input),
        costmodel=costmodel_of,
        machine=MACHINE_JSON,
        trace=TRACE_FILE,
        code=SIM_SOURCES,
    output:
        f"{MACHINE_DIR}/sweep/cells/{{policy}}_cap{{cap}}.csv",
    params:
        **sim_params(drop=("chunk_sizes",)),
    threads: 1
    resources:
        mem_mb=1000,
        runtime=15,
    log:
        "results/logs/{machine}/sweep/{policy}_cap{cap}.log",
    benchmark:
        "results/benchmarks/{machine}/sweep/{policy}_cap{cap}.tsv"
    script:
        "../scripts/sweep_cell.py"


rule chunk_cell:
    input:
        unpack(runtime_input),
        costmodel=costmodel_of,
        machine=MACHINE_JSON,
        trace=TRACE_FILE,
        code=SIM_SOURCES + sources("plan/planner.py"),
    output:
        f"{MACHINE_DIR}/sweep/chunks/cap{{cap}}.csv",
    params:
        **sim_params(drop=("rates",)),
    threads: 1
    resources:
        mem_mb=1000,
        runtime=15,
    log:
        "results/logs/{machine}/chunks/cap{cap}.log",
    benchmark:
        "results/benchmarks/{machine}/chunks/cap{cap}.tsv"
    script:
        "../scripts/chunk_cell.py"


rule capacity_cell:
    input:
        unpack(runtime_input),
        costmodel=costmodel_of,
        machine=MACHINE_JSON,
        trace=TRACE_FILE,
        code=SIM_SOURCES,
    output:
        f"{MACHINE_DIR}/capacity/cells/{{policy}}_cap{{cap}}.json",
    params:
        **sim_params(drop=("chunk_sizes", "rates")),
        capacity=config_keys(config["capacity"]),
    threads: 1
    resources:
        mem_mb=1000,
        runtime=30,
    log:
        "results/logs/{machine}/capacity/{policy}_cap{cap}.log",
    benchmark:
        "results/benchmarks/{machine}/capacity/{policy}_cap{cap}.tsv"
    script:
        "../scripts/capacity_cell.py"


rule collect:
    """One machine's cells as its latency and capacity tables."""
    input:
        sweep=machine_cells("sweep/cells/{cell}.csv", cell=CELLS),
        capacity=machine_cells("capacity/cells/{cell}.json", cell=CELLS),
        code=sources("pipeline.py", "io.py", "plan/planner.py"),
    output:
        latency=report(f"{MACHINE_DIR}/latency.csv", caption="../reports/captions/latency.rst", category="Simulation"),
        capacity=report(f"{MACHINE_DIR}/capacity.csv", caption="../reports/captions/capacity.rst",
                        category="Simulation"),
    threads: 1
    resources:
        mem_mb=1000,
        runtime=5,
    log:
        "results/logs/{machine}/collect.log",
    script:
        "../scripts/collect.py"


rule collect_chunks:
    """One machine's chunk cells as its chunk table (the report's chunking comparison reads this
    machine's; the planner reads none)."""
    input:
        chunks=machine_cells("sweep/chunks/cap{cap}.csv", cap=config["sweep"]["caps"]),
        code=sources("pipeline.py", "io.py"),
    output:
        f"{MACHINE_DIR}/chunk_sweep.csv",
    threads: 1
    resources:
        mem_mb=1000,
        runtime=5,
    log:
        "results/logs/{machine}/collect_chunks.log",
    script:
        "../scripts/collect_chunks.py"
