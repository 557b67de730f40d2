# Planning: fleets and speed-ups (price-independent), memory, then the recommendation.
# The price is a parameter of `recommend` alone, so changing it reruns only `recommend` and the report.


rule fleet_cell:
    input:
        costmodel=COSTMODEL,
        machine=MACHINE_JSON,
        trace=TRACE_FILE,
        code=SIM_SOURCES + sources("planner.py"),
    output:
        "results/fleet/cells/{policy}_cap{cap}.json",
    params:
        **SIM_PARAMS,
        capacity=config["capacity"],
        cost=dict((k, v) for k, v in config["cost"].items() if k in ("max_replicas", "routers")),
    threads: 1
    resources:
        mem_mb=1000,
        runtime=30,
    log:
        "results/logs/fleet/{policy}_cap{cap}.log",
    benchmark:
        "results/benchmarks/fleet/{policy}_cap{cap}.tsv"
    script:
        "../scripts/fleet_cell.py"


# Each target machine of config `hardware`: the planner's cells re-run on the cost model carried over by
# the roofline, one job per target (its cells run one after another: a faster target's searches are short).
rule hardware_target:
    input:
        costmodel=COSTMODEL,
        machine=MACHINE_JSON,
        code=SIM_SOURCES + sources("planner.py", "hardware.py", "architecture.py"),
    output:
        "results/plan/hardware/{target}.json",
    params:
        **SIM_PARAMS,
        capacity=config["capacity"],
        cost=dict((k, v) for k, v in config["cost"].items() if k in ("max_replicas", "routers")),
        model=config["model"],
        # the roofline alone: a target's description or price reaches `recommend` only
        target=lambda wildcards: {k: HARDWARE[wildcards.target][k] for k in ("name", "bandwidth_gbs", "gflops")},
        cells=[[policy, cap] for policy in config["sweep"]["policies"] for cap in config["sweep"]["caps"]],
    wildcard_constraints:
        target=r"[A-Za-z0-9][A-Za-z0-9._-]*",
    threads: 1
    resources:
        mem_mb=1000,
        runtime=60,
    log:
        "results/logs/hardware/{target}.log",
    benchmark:
        "results/benchmarks/hardware/{target}.tsv"
    script:
        "../scripts/hardware_target.py"


rule memory:
    input:
        machine=MACHINE_JSON,
        latency=rules.collect.output.latency,
        code=sources("memory.py"),
    output:
        table=report("results/plan/memory.csv", caption="../reports/captions/memory.rst", category="Plan"),
        summary="results/plan/memory.json",
    params:
        memory=config["memory"],
        caps=config["sweep"]["caps"],
        rate=config["workload"]["rate"],
    threads: 1
    resources:
        mem_mb=500,
        runtime=5,
    log:
        "results/logs/memory.log",
    script:
        "../scripts/memory.py"


rule recommend:
    input:
        latency=rules.collect.output.latency,
        capacity=rules.collect.output.capacity,
        memory=rules.memory.output.table,
        fleet=expand("results/fleet/cells/{cell}.json", cell=CELLS),
        costmodel=COSTMODEL,
        machine=MACHINE_JSON,
        # the engine's measured serving memory judges the memory target (validate.smk is included after
        # this file, so its output is named by path); an imported cost model has no validation
        **({"validation": "results/validation/validation.json"} if PROFILED else {}),
        hardware=expand("results/plan/hardware/{target}.json", target=HARDWARE),
        trace=TRACE_FILE,
        code=sources("money.py", "planner.py", "seeds.py", "hardware.py", "workload.py"),
    output:
        report("results/plan/recommendation.json", caption="../reports/captions/recommendation.rst",
               category="Recommendation"),
        # each target machine's verdicts: they depend on the price, so they are decided here
        hardware="results/plan/hardware_verdicts.json",
    params:
        cost=config["cost"],
        slo=config["slo"],
        workload=config["workload"],
        memory=config["memory"],
        hardware=list(HARDWARE.values()),
        seeds=SEEDS,
    threads: 1
    resources:
        mem_mb=500,
        runtime=5,
    log:
        "results/logs/recommend.log",
    script:
        "../scripts/recommend.py"


rule exercise2:
    input:
        code=SIM_SOURCES + sources("exercise2.py"),
    output:
        answers=report("results/exercise2/answers.json", caption="../reports/captions/exercise2.rst",
                       category="Exercise 2"),
        cap_sweep="results/exercise2/cap_sweep.csv",
        chunk_sweep="results/exercise2/chunk_sweep.csv",
        curve="results/exercise2/curve.csv",
    params:
        exercise2=config["exercise2"],
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
