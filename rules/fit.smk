rule fit:
    input:
        points=rules.profile.output.points,
        samples=rules.profile.output.samples,
        machine=rules.profile.output.machine,
        code=sources("profiling/fit.py", "costmodel.py"),
    output:
        costmodel="results/fit/costmodel.json",
        report="results/fit/fit_report.json",
        predicted="results/fit/predicted_vs_measured.csv",
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
