localrules: report


# What only a profiled run has: the profile, the fit, the validation and the serving memory on this machine.
MEASURED_INPUTS = dict(
    profile=rules.profile.output.points,
    fit_report=rules.fit.output.report,
    predicted=rules.fit.output.predicted,
    validation=rules.validate.output.summary,
    validation_requests=rules.validate.output.requests,
    validation_meta=rules.validate.output.meta,
    # the serving process's peak memory per (policy, cap): the memory verdict's measurement and figure
    serving_memory=rules.serving_memory.output[0],
) if PROFILED else {}
# how far the targets' estimates can be trusted, when the run measures it (rules/check.smk)
if carry_over_check_skipped(config) is None:
    MEASURED_INPUTS["carry_over_check"] = rules.carry_over_check.output[0]
# the engines compared, when llama.cpp runs too (rules/llamacpp.smk, included after this file)
if engine(config) == LLAMACPP:
    MEASURED_INPUTS["engines"] = "results/llamacpp/engines.json"
# the GPU targets' estimates checked on a real GPU, when config gpu_check names a check (servingplan/gpu_check):
# the section on other machines quotes its errors
GPU_CHECK_INPUT = {"gpu_check": config["gpu_check"]} if config.get("gpu_check") else {}


# The comparisons the report states about the simulations, decided by the planner (servingplan/report/findings.py)
rule findings:
    input:
        latency=f"results/machines/{HERE}/latency.csv",
        capacity=f"results/machines/{HERE}/capacity.csv",
        chunks=f"results/machines/{HERE}/chunk_sweep.csv",
        costmodel=COSTMODEL,
        trace=TRACE_FILE,
        code=sources("report/findings.py", "seeds.py", "simulate/workload.py", "costmodel.py"),
    output:
        "results/plan/findings.json",
    params:
        slo=config_keys(config["slo"]),
        workload=config_keys(config["workload"]),
    threads: 1
    resources:
        mem_mb=500,
        runtime=5,
    log:
        "results/logs/findings.log",
    script:
        "../scripts/findings.py"


# How many simulated requests lie outside the range the cost model was profiled on (servingplan/report/coverage.py)
rule coverage:
    input:
        costmodel=COSTMODEL,
        trace=TRACE_FILE,
        code=sources("report/coverage.py", "simulate/workload.py", "costmodel.py"),
    output:
        "results/plan/coverage.json",
    params:
        workload=config_keys(config["workload"]),
        seeds=SEEDS,
    threads: 1
    resources:
        mem_mb=500,
        runtime=5,
    log:
        "results/logs/coverage.log",
    script:
        "../scripts/coverage.py"


rule report:
    input:
        **MEASURED_INPUTS,
        **GPU_CHECK_INPUT,
        machine=MACHINE_JSON,
        costmodel=COSTMODEL,
        # this machine's results (machine wildcard `here`, results/machines/here/), then the decision
        latency=f"results/machines/{HERE}/latency.csv",
        chunks=f"results/machines/{HERE}/chunk_sweep.csv",
        capacity=f"results/machines/{HERE}/capacity.csv",
        memory=f"results/machines/{HERE}/memory.csv",
        memory_summary=f"results/machines/{HERE}/memory.json",
        recommendation=f"results/machines/{HERE}/recommendation.json",
        fleet=expand(f"results/machines/{HERE}/fleet/cells/{{cell}}.json", cell=CELLS),
        decision=rules.decide.output.decision,
        options=rules.decide.output.options,
        hardware=rules.decide.output.hardware,
        findings=rules.findings.output[0],
        coverage=rules.coverage.output[0],
        exercise2=rules.exercise2.output.answers,
        ex2_caps=rules.exercise2.output.cap_sweep,
        ex2_chunks=rules.exercise2.output.chunk_sweep,
        ex2_curve=rules.exercise2.output.curve,
        workload=rules.workload.output[0],
        trace=TRACE_FILE,
        templates=repository_files("reports/templates/*.j2"),
        code=sources("report/__init__.py", "report/blocks.py", "report/figures.py", "report/measurement.py",
                     "report/outline.py", "report/precision.py", "report/render.py", "report/text.py", "plan/names.py",
                     "plan/gpu_evidence.py"),
    output:
        html=report("results/report/report.html", caption="../reports/captions/report_html.rst", category="Report"),
        md=report("results/report/report.md", caption="../reports/captions/report_md.rst", category="Report"),
        # the PNGs the Markdown links (the HTML embeds them)
        figures=report(directory("results/report/figures"), patterns=["{name}.png"],
                       caption="../reports/captions/figures.rst", category="Figures"),
        provenance="results/report/provenance.json",
    params:
        config=config,
        config_hash=CONFIG_HASH,
        machine=MACHINE,
    threads: 1
    resources:
        mem_mb=2000,
        runtime=10,
    log:
        "results/logs/report.log",
    script:
        "../scripts/report.py"
