# servingplan: profile GPT-2 small on this machine, fit a step-time model, simulate serving policies,
# plan capacity, memory and cost, validate against a real engine, and render the capstone report.
configfile: "config.yaml"


include: "rules/common.smk"
include: "rules/profile.smk"
include: "rules/fit.smk"
include: "rules/simulate.smk"
include: "rules/plan.smk"
include: "rules/validate.smk"
include: "rules/report.smk"


rule all:
    input:
        "results/report/report.html",
        "results/report/report.md",
    default_target: True
