# Validation in two jobs, and the serving memory of every (policy, cap).
# - validate_replay serves Poisson traces through the real engine on this machine. Like profiling it
#   measures the machine, so it takes every core and stays local. It depends on the engine, its step
#   functions, the scheduler it drives and the cost model (its load reference), never on the simulator.
# - validate sets the replay against the simulator: editing servingplan/simulate/ reruns only this job.
# With an imported cost model (costmodel.source a file) nothing asks for either: that model is not this machine.
# - serving_memory serves each policy's worst case at a few caps, forked processes side by side, reads their
#   peak resident memory and fits each policy's line against the cap, for the planner's memory verdict.
localrules: validate_replay, serving_memory

# what both the replay and a memory probe import: the engine, its KV pool and scheduler, the model loader
REPLAY_SOURCES = sources("engine/__init__.py", "engine/engine.py", "profile/kvpool.py", "simulate/workload.py",
                         "simulate/scheduler.py", "simulate/policies.py", "simulate/steps.py",
                         "profile/__init__.py", "profile/model.py", "profile/machine.py", "architecture.py", "io.py",
                         "pipeline.py", "config.py", "costmodel.py", "memory.py", "device.py")
# ... and the simulator's SimResult, the timeline class the engine fills (simulate/__init__.py, simulate/simulator.py,
# which imports simulate/llamacpp_slots.py for a policy the engine never serves): left out on purpose, so that
# editing the simulator reruns the comparison only (issue 20, item 3)

# the torch threads the engine serves with (profile.threads; 0 is every core of this machine)
ENGINE_THREADS = resolve_threads(config["profile"]["threads"])
# the validation config the replay reads; the comparison reads goal_pct too
VALIDATION_SWEEP = {k: config["sweep"][k] for k in ("chunk_size", "chunk_budget") if k in config["sweep"]}


rule validate_replay:
    # next after the fit (MEASURING_FIRST, common.smk): the replays run as close in time to the profile
    # as they can, before the simulation jobs heat the machine for minutes
    priority: MEASURING_FIRST
    input:
        costmodel=COSTMODEL,
        machine=rules.profile.output.machine,
        points=rules.profile.output.points,
        trace=TRACE_FILE,
        # what the replay imports (servingplan.validate.validation_replay), not the comparison's modules
        code=REPLAY_SOURCES + sources("validate/validation_replay.py", "validate/replay_file.py",
                                      "profile/measure.py", "profile/grid.py", "roofline.py"),
    output:
        replay="results/validation/replay.json",
    params:
        validation={k: v for k, v in config["validation"].items() if k != "goal_pct"},
        workload=config["workload"],
        model=config["model"],
        threads=config["profile"]["threads"],
        sweep=VALIDATION_SWEEP,
        memory=memory_of(HERE),
        seed=config["seed"],
    threads: workflow.cores
    resources:
        mem_mb=4000,
        runtime=20,
    log:
        "results/logs/validate_replay.log",
    benchmark:
        "results/benchmarks/validate_replay.tsv"
    script:
        "../scripts/validate_replay.py"


rule validate:
    input:
        replay=rules.validate_replay.output.replay,
        costmodel=COSTMODEL,
        machine=rules.profile.output.machine,
        trace=TRACE_FILE,
        code=SIM_SOURCES + sources("engine/replay.py", "validate/validation.py", "validate/replay_file.py",
                                   "engine/engine.py"),
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
        sweep={**VALIDATION_SWEEP, "horizon_factor": config["sweep"]["horizon_factor"]},
        memory=memory_of(HERE),
        seed=config["seed"],
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    log:
        "results/logs/validate.log",
    benchmark:
        "results/benchmarks/validate.tsv"
    script:
        "../scripts/validate.py"


# One job: it loads the model once and forks a process per distinct probe (a process's resident high-water
# mark never falls, servingplan/engine/memory_probe.py), each policy at the caps its line is fitted to and
# the one that checks it, as many at once as its threads, about 20 s for GPT-2 small. A resident-memory
# reading is not a timing, so the job need
# not have the machine alone: it runs beside the simulations, after the measurements (whose priority comes
# first, common.smk; the machine file it reads comes from the profile), and stays local, since a cluster
# node is not this machine. It serves with the engine's threads and claims as many cores; its priority
# starts it as soon as the measurements are done, so the simulations fill the other cores beside it.
rule serving_memory:
    input:
        **({"machine": rules.profile.output.machine} if PROFILED else {}),
        code=REPLAY_SOURCES + sources("engine/memory_probe.py"),
    output:
        "results/validation/serving_memory.json",
    params:
        model=config["model"],
        threads=config["profile"]["threads"],
        sweep=config_keys(config["sweep"], keep=("policies", "caps", "chunk_size", "chunk_budget")),
        memory=config_keys(config["memory"], keep=("max_context", "block_size")),
        seed=config["seed"],
    priority: LONG_JOBS_FIRST
    threads: min(ENGINE_THREADS, workflow.cores)
    resources:
        mem_mb=4000,
        runtime=5,
    log:
        "results/logs/serving_memory.log",
    benchmark:
        "results/benchmarks/serving_memory.tsv"
    script:
        "../scripts/validate_memory.py"
