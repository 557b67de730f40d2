# Planning, per machine: fleets and speed-ups (price-independent), memory, then the machine's
# recommendation at its price; `decide` then picks across machines. A machine's price is a parameter of
# its `recommend` alone, so changing it reruns only that, `decide` and the report.


def machine_cost(wildcards):
    """The cost section as a machine's recommendation reads it: a target's own price per hour when its
    entry states one, else cost.price_per_hour."""
    price = HARDWARE.get(wildcards.machine, {}).get("price_per_hour")
    return config_keys({**config["cost"], **({"price_per_hour": price} if price is not None else {})})


def machine_label(name):
    """How the decision names a machine, and whether its numbers are measured (this machine's profile)
    or estimated (a carried-over cost model). An imported cost model is someone else's measurement."""
    if name == HERE:
        return {"machine": HERE, "display_name": "this machine", "measured": PROFILED}
    # the description without its parenthesised detail, or the name made readable (nvidia-t4 -> NVIDIA T4)
    return {"machine": name, "display_name": display_names.brief(display_names.machine(HARDWARE[name])),
            "measured": False}


rule carry_over:
    """A target machine's step-time model: this machine's carried over by the roofline."""
    input:
        costmodel=COSTMODEL,
        machine=MACHINE_JSON,
        code=sources("plan/hardware.py", "architecture.py", "costmodel.py"),
    output:
        costmodel=f"{MACHINE_DIR}/costmodel.json",
        terms=f"{MACHINE_DIR}/carry_over.json",
    params:
        model=config_keys(config["model"]),
        # the roofline and the kind of machine (a GPU's launch overhead, measured by config gpu_check's check
        # where the target sets none, with its basis; a CPU's core speed-up) alone: a target's description or
        # price reaches its recommendation only
        target=lambda wildcards: config_keys(
            with_measured_launch_overhead(HARDWARE[wildcards.machine], config.get("gpu_check")),
            keep=("name", "bandwidth_gbs", "gflops", "kind", "launch_overhead_ms", "launch_overhead_basis",
                  "core_speedup")),
    threads: 1
    resources:
        mem_mb=500,
        runtime=5,
    log:
        "results/logs/{machine}/carry_over.log",
    script:
        "../scripts/carry_over.py"


rule fleet_cell:
    input:
        unpack(runtime_input),
        costmodel=costmodel_of,
        machine=MACHINE_JSON,
        trace=TRACE_FILE,
        code=SIM_SOURCES,
    output:
        f"{MACHINE_DIR}/fleet/cells/{{policy}}_cap{{cap}}.json",
    params:
        **sim_params(drop=("chunk_sizes", "rates")),
        capacity=config_keys(config["capacity"]),
        cost=config_keys(config["cost"], keep=("max_replicas", "routers")),
    threads: 1
    resources:
        mem_mb=1000,
        runtime=30,
    log:
        "results/logs/{machine}/fleet/{policy}_cap{cap}.log",
    benchmark:
        "results/benchmarks/{machine}/fleet/{policy}_cap{cap}.tsv"
    script:
        "../scripts/fleet_cell.py"


rule cap_search:
    """One machine and policy: the largest cap memory allows, and the smallest that meets latency and
    capacity, found from the grid's verdicts by simulating the caps between (servingplan/plan/cap_search.py)."""
    input:
        unpack(runtime_input),
        costmodel=costmodel_of,
        machine=MACHINE_JSON,
        trace=TRACE_FILE,
        latency=rules.collect.output.latency,
        capacity=rules.collect.output.capacity,
        code=SIM_SOURCES + sources("plan/cap_search.py", "plan/planner.py", "seeds.py"),
    output:
        f"{MACHINE_DIR}/search/{{policy}}.json",
    params:
        **sim_params(drop=("chunk_sizes", "rates")),
        capacity=config_keys(config["capacity"]),
    threads: 1
    resources:
        mem_mb=1000,
        runtime=30,
    log:
        "results/logs/{machine}/search/{policy}.log",
    benchmark:
        "results/benchmarks/{machine}/search/{policy}.tsv"
    script:
        "../scripts/cap_search.py"


def measured_serving_memory(wildcards):
    """This machine's serving memory per (policy, cap), which the memory table reports beside the KV
    model's figure (validate.smk, included after this file, so looked up when the job is built)."""
    if wildcards.machine != HERE or not PROFILED:
        return {}
    return {"serving_memory": rules.serving_memory.output[0]}


rule memory:
    """Weights + KV per (policy, cap) on one machine, grid and searched caps: as its KV model judges it,
    the reservation, its simulations' peak, and the measured serving memory where there is one."""
    input:
        unpack(measured_serving_memory),
        machine=MACHINE_JSON,
        latency=rules.collect.output.latency,
        searches=machine_cells("search/{policy}.json", policy=config["sweep"]["policies"]),
        code=sources("memory.py", "plan/planner.py", "engine/memory_probe.py"),
    output:
        table=report(f"{MACHINE_DIR}/memory.csv", caption="../reports/captions/memory.rst", category="Plan"),
        summary=f"{MACHINE_DIR}/memory.json",
    params:
        memory=machine_memory(),
        rate=config["workload"]["rate"],
    threads: 1
    resources:
        mem_mb=500,
        runtime=5,
    log:
        "results/logs/{machine}/memory.log",
    script:
        "../scripts/memory.py"


rule recommend:
    """One machine's configurations judged against the four targets, at that machine's price."""
    input:
        unpack(measured_serving_memory),
        latency=rules.collect.output.latency,
        capacity=rules.collect.output.capacity,
        memory=rules.memory.output.table,
        fleet=machine_cells("fleet/cells/{cell}.json", cell=CELLS),
        searches=machine_cells("search/{policy}.json", policy=config["sweep"]["policies"]),
        costmodel=costmodel_of,
        machine=MACHINE_JSON,
        trace=TRACE_FILE,
        code=sources("plan/money.py", "plan/planner.py", "simulate/searches.py", "seeds.py", "simulate/workload.py",
                     "simulate/capacity.py"),
    output:
        report(f"{MACHINE_DIR}/recommendation.json", caption="../reports/captions/recommendation.rst",
               category="Recommendation"),
    params:
        cost=machine_cost,
        slo=config_keys(config["slo"]),
        workload=config_keys(config["workload"]),
        seeds=SEEDS,
        label=lambda wildcards: machine_label(wildcards.machine),
        # the machine's KV model and why (configured, or its engine's default), which the report states
        kv_memory=lambda wildcards: kv_memory_of(config, wildcards.machine),
    threads: 1
    resources:
        mem_mb=500,
        runtime=5,
    log:
        "results/logs/{machine}/recommend.log",
    script:
        "../scripts/recommend.py"


rule decide:
    """The one decision across machines: the cheapest deployment meeting all four targets (or the
    closest), the ranked options, one line per machine, and the routes to the targets."""
    input:
        recommendations=expand(f"{MACHINE_DIR}/recommendation.json", machine=MACHINES),
        terms=expand(f"{MACHINE_DIR}/carry_over.json", machine=list(HARDWARE)),
        code=sources("plan/planner.py", "plan/money.py", "plan/hardware.py"),
    output:
        decision=report("results/plan/decision.json", caption="../reports/captions/recommendation.rst",
                        category="Recommendation"),
        # every ranked option, one row each with display names (the report's table shows its head)
        options=report("results/plan/options.csv", caption="../reports/captions/recommendation.rst",
                       category="Recommendation"),
        # each target's verdicts and carry-over, in the layout the report's target section reads
        hardware="results/plan/hardware_verdicts.json",
    params:
        targets=[config_keys(target) for target in HARDWARE.values()],
    threads: 1
    resources:
        mem_mb=500,
        runtime=5,
    log:
        "results/logs/decide.log",
    script:
        "../scripts/decide.py"


rule exercise2:
    input:
        code=SIM_SOURCES + sources("plan/exercise2.py"),
    output:
        answers=report("results/exercise2/answers.json", caption="../reports/captions/exercise2.rst",
                       category="Exercise 2"),
        cap_sweep="results/exercise2/cap_sweep.csv",
        chunk_sweep="results/exercise2/chunk_sweep.csv",
        curve="results/exercise2/curve.csv",
    params:
        exercise2=config_keys(config["exercise2"]),
        seed=config["seed"],
    threads: 1
    resources:
        mem_mb=2000,
        runtime=20,
    log:
        "results/logs/exercise2.log",
    benchmark:
        "results/benchmarks/exercise2.tsv"
    script:
        "../scripts/exercise2.py"
