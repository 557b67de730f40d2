# llama.cpp as a second engine (config `engine: llamacpp`, config/llamacpp.yaml; included by the Snakefile
# only then). The seeded GPT-2 converted to GGUF, llama.cpp's steps profiled into the torch profiler's
# files, the same fit, and the `llamacpp` policy validated against a real llama-server. Everything is
# under results/llamacpp/. The build (`make llamacpp`) is outside results/: its stamp is an input, so a
# run without it stops naming the missing file, and a rebuild reruns what it measured.
# Like the torch measurements (MEASURING_FIRST, common.smk) each measuring job takes every core, runs
# alone and locally: it measures this machine. One step below them in priority, so each engine's replay
# follows its own profile: the project's engine's profile, fit and replay first, then llama.cpp's (in cold
# runs 9 and 10, at equal priority, the llama.cpp profile ran between the torch profile and its replay:
# 11 to 16 minutes apart on a machine whose speed moves within minutes).
from servingplan.llamacpp import build as llamacpp_build

localrules: llamacpp_gguf, llamacpp_profile, llamacpp_server_terms, llamacpp_validate_replay

LLAMACPP_DIR = "results/llamacpp"
LLAMACPP_BUILT = str(llamacpp_build.build_dir() / ".built")
# what the GGUF depends on: the seed and whether the tiny model is served
LLAMACPP_MODEL = {"seed": config["seed"], "tiny": config["model"].get("tiny", False)}
LLAMACPP_MEASURING = MEASURING_FIRST - 1


rule llamacpp_gguf:
    priority: LLAMACPP_MEASURING
    input:
        built=LLAMACPP_BUILT,
        code=sources("llamacpp/gguf_model.py", "llamacpp/build.py", "profile/model.py", "architecture.py"),
    output:
        gguf=f"{LLAMACPP_DIR}/model.gguf",
    params:
        model=LLAMACPP_MODEL,
    threads: workflow.cores
    resources:
        mem_mb=4000,
        runtime=10,
    log:
        "results/logs/llamacpp_gguf.log",
    script:
        "../scripts/llamacpp_gguf.py"


rule llamacpp_profile:
    priority: LLAMACPP_MEASURING
    input:
        gguf=rules.llamacpp_gguf.output.gguf,
        built=LLAMACPP_BUILT,
        code=sources("llamacpp/profile.py", "llamacpp/build.py", "profile/measure.py", "profile/machine.py",
                     "profile/model.py", "roofline.py", "io.py", "pipeline.py"),
    output:
        points=f"{LLAMACPP_DIR}/profile/profile.csv",
        samples=f"{LLAMACPP_DIR}/profile/samples.csv",
        machine=f"{LLAMACPP_DIR}/profile/machine.json",
    params:
        # the torch profile's grid, rounds and references; its threads are torch's, llamacpp.threads are these
        profile=config_keys(config["profile"], drop=("threads",)),
        llamacpp=config_keys(config["llamacpp"], keep=("threads", "n_batch", "n_ubatch")),
        model=LLAMACPP_MODEL,
    threads: workflow.cores
    resources:
        mem_mb=4000,
        runtime=20,
    log:
        "results/logs/llamacpp_profile.log",
    benchmark:
        "results/benchmarks/llamacpp_profile.tsv"
    script:
        "../scripts/llamacpp_profile.py"


# the fit rule's own code (scripts/fit.py, servingplan.fit.step_model) on llama.cpp's profile
rule llamacpp_fit:
    priority: LLAMACPP_MEASURING
    input:
        points=rules.llamacpp_profile.output.points,
        samples=rules.llamacpp_profile.output.samples,
        machine=rules.llamacpp_profile.output.machine,
        code=sources("fit/step_model.py", "costmodel.py"),
    output:
        costmodel=f"{LLAMACPP_DIR}/fit/costmodel.json",
        report=f"{LLAMACPP_DIR}/fit/fit_report.json",
        predicted=f"{LLAMACPP_DIR}/fit/predicted_vs_measured.csv",
    params:
        fit=config["fit"],
        seed=config["seed"],
    threads: workflow.cores
    resources:
        mem_mb=1000,
        runtime=5,
    log:
        "results/logs/llamacpp_fit.log",
    script:
        "../scripts/fit.py"


# llama-server's own prompt and decode steps against the tool's, paired in time, with the validation's slots and
# context (servingplan/llamacpp/server_terms.py): the fit with the terms that show a difference applied is the
# model the validation and the engine comparison simulate llama-server on
rule llamacpp_server_terms:
    priority: LLAMACPP_MEASURING
    input:
        gguf=rules.llamacpp_gguf.output.gguf,
        costmodel=rules.llamacpp_fit.output.costmodel,
        profile=rules.llamacpp_profile.output.machine,
        built=LLAMACPP_BUILT,
        code=sources("llamacpp/server_terms.py", "llamacpp/server.py", "llamacpp/client.py",
                     "llamacpp/server_log.py", "llamacpp/profile.py", "llamacpp/build.py", "costmodel.py", "io.py",
                     "pipeline.py"),
    output:
        pairs=f"{LLAMACPP_DIR}/server/pairs.csv",
        terms=f"{LLAMACPP_DIR}/server/terms.json",
        costmodel=f"{LLAMACPP_DIR}/server/costmodel.json",
    params:
        validation=config_keys(config["validation"], keep=("cap",)),
        memory=config_keys(config["memory"], keep=("max_context",)),
        model=LLAMACPP_MODEL,
        server_log="results/logs/llamacpp_server/server_terms.log",
    threads: workflow.cores
    resources:
        mem_mb=4000,
        runtime=20,
    log:
        "results/logs/llamacpp_server_terms.log",
    benchmark:
        "results/benchmarks/llamacpp_server_terms.tsv"
    script:
        "../scripts/llamacpp_server_terms.py"


rule llamacpp_validate_replay:
    priority: LLAMACPP_MEASURING
    input:
        gguf=rules.llamacpp_gguf.output.gguf,
        costmodel=rules.llamacpp_server_terms.output.costmodel,
        # the profile's points and settings: before, during and after each run its served shapes are re-timed as profiled
        points=rules.llamacpp_profile.output.points,
        profile=rules.llamacpp_profile.output.machine,
        built=LLAMACPP_BUILT,
        trace=TRACE_FILE,
        code=sources("llamacpp/validation.py", "llamacpp/server.py", "llamacpp/client.py", "llamacpp/server_log.py",
                     "llamacpp/build.py", "llamacpp/profile.py", "validate/validation_replay.py",
                     "simulate/workload.py", "costmodel.py", "io.py", "pipeline.py"),
    output:
        replay=f"{LLAMACPP_DIR}/validation/replay.json",
    params:
        validation=config_keys(config["validation"], keep=("rates_fraction", "trace_seconds", "min_requests", "cap",
                                                           "max_wall_s")),
        workload=config["workload"],
        llamacpp=config_keys(config["llamacpp"]),
        memory=config_keys(config["memory"], keep=("max_context",)),
        model=LLAMACPP_MODEL,
        server_logs="results/logs/llamacpp_server",
    threads: workflow.cores
    resources:
        mem_mb=4000,
        runtime=20,
    log:
        "results/logs/llamacpp_validate_replay.log",
    benchmark:
        "results/benchmarks/llamacpp_validate_replay.tsv"
    script:
        "../scripts/llamacpp_validate_replay.py"


rule llamacpp_validate:
    input:
        replay=rules.llamacpp_validate_replay.output.replay,
        costmodel=rules.llamacpp_server_terms.output.costmodel,
        terms=rules.llamacpp_server_terms.output.terms,
        code=SIM_SOURCES + sources("llamacpp/validation.py", "engine/replay.py", "validate/validation.py"),
    output:
        summary=f"{LLAMACPP_DIR}/validation/comparison.csv",
        steps=f"{LLAMACPP_DIR}/validation/steps.csv",
        steps_by_kind=f"{LLAMACPP_DIR}/validation/steps_by_kind.csv",
        meta=f"{LLAMACPP_DIR}/validation/validation.json",
    params:
        validation=config_keys(config["validation"], keep=("goal_pct",)),
        memory=config_keys(config["memory"], keep=("block_size",)),
        sweep=config_keys(config["sweep"], keep=("horizon_factor",)),
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    log:
        "results/logs/llamacpp_validate.log",
    script:
        "../scripts/llamacpp_validate.py"


# The engines compared on the same workload and targets, for the report (servingplan/llamacpp/compare.py)
rule engine_comparison:
    input:
        torch_costmodel=COSTMODEL,
        torch_validation=rules.validate.output.meta,
        llamacpp_costmodel=rules.llamacpp_server_terms.output.costmodel,
        llamacpp_validation=rules.llamacpp_validate.output.meta,
        trace=TRACE_FILE,
        code=SIM_SOURCES + sources("llamacpp/compare.py"),
    output:
        f"{LLAMACPP_DIR}/engines.json",
    params:
        workload=config_keys(config["workload"]),
        slo=config_keys(config["slo"], keep=("ttft_ms", "ttft_percentile", "tpot_ms")),
        validation=config_keys(config["validation"], keep=("cap", "policy", "rates_fraction")),
        sweep=config_keys(config["sweep"], keep=("chunk_size", "chunk_budget", "horizon_factor")),
        llamacpp=config_keys(config["llamacpp"], keep=("n_batch", "n_ubatch")),
        seed=config["seed"],
    threads: 1
    resources:
        mem_mb=1000,
        runtime=5,
    log:
        "results/logs/engine_comparison.log",
    script:
        "../scripts/engine_comparison.py"
