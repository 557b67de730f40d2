rule fit:
    input:
        points=rules.profile.output.points,
        samples=rules.profile.output.samples,
        machine=rules.profile.output.machine,
        code=sources("profiling/fit.py", "costmodel.py"),
    output:
        costmodel=report("results/fit/costmodel.json", caption="../reports/captions/costmodel.rst",
                         category="Cost model"),
        report="results/fit/fit_report.json",
        predicted=report("results/fit/predicted_vs_measured.csv", caption="../reports/captions/predicted.rst",
                         category="Cost model"),
    params:
        fit=config["fit"],
        seed=config["seed"],
    threads: 1
    resources:
        mem_mb=1000,
        runtime=5,
    log:
        "results/logs/fit.log",
    script:
        "../scripts/fit.py"
