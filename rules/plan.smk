# Planning: fleets and speed-ups (price-independent), memory, then the recommendation.
# The price is a parameter of `recommend` alone, so changing it reruns only `recommend` and the report.


rule fleet_cell:
    input:
        costmodel=rules.fit.output.costmodel,
        machine=rules.profile.output.machine,
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


rule memory:
    input:
        machine=rules.profile.output.machine,
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
        costmodel=rules.fit.output.costmodel,
        machine=rules.profile.output.machine,
        # the engine's measured serving memory judges the memory target (validate.smk is included after
        # this file, so its output is named by path)
        validation="results/validation/validation.json",
        trace=TRACE_FILE,
        code=sources("money.py", "planner.py", "seeds.py", "workload.py"),
    output:
        report("results/plan/recommendation.json", caption="../reports/captions/recommendation.rst",
               category="Recommendation"),
    params:
        cost=config["cost"],
        slo=config["slo"],
        workload=config["workload"],
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
