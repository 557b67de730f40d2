if PROFILED:

    rule fit:
        input:
            points=rules.profile.output.points,
            samples=rules.profile.output.samples,
            machine=rules.profile.output.machine,
            code=sources("fit/step_model.py", "costmodel.py"),
        output:
            costmodel=report("results/fit/costmodel.json", caption="../reports/captions/costmodel.rst",
                             category="Cost model"),
            report="results/fit/fit_report.json",
            predicted=report("results/fit/predicted_vs_measured.csv", caption="../reports/captions/predicted.rst",
                             category="Cost model"),
        params:
            fit=config["fit"],
            seed=config["seed"],
        # between the profile and the real-time replay (MEASURING_FIRST, common.smk): it claims every core
        # for its few seconds, so that no one-core job starts beside it and the replay, waiting for it,
        # finds the machine idle
        priority: MEASURING_FIRST
        threads: workflow.cores
        resources:
            mem_mb=1000,
            runtime=5,
        log:
            "results/logs/fit.log",
        script:
            "../scripts/fit.py"

else:

    rule import_costmodel:
        input:
            costmodel=COSTMODEL_SOURCE,
            code=sources("costmodel.py", "architecture.py"),
        output:
            costmodel=report("results/fit/costmodel.json", caption="../reports/captions/costmodel.rst",
                             category="Cost model"),
            sizes="results/fit/model_sizes.json",
        params:
            model=config["model"],
        threads: 1
        resources:
            mem_mb=500,
            runtime=5,
        log:
            "results/logs/import_costmodel.log",
        script:
            "../scripts/import_costmodel.py"


# What the simulation and planning stages read: the step-time model, and the model's weight and KV sizes
# (the profile's measurement of this machine, or derived from the architecture for an imported model).
COSTMODEL = "results/fit/costmodel.json"
MACHINE_JSON = rules.profile.output.machine if PROFILED else rules.import_costmodel.output.sizes
