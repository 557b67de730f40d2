# servingplan: profile GPT-2 small on this machine, fit a step-time model, simulate serving policies,
# plan capacity, memory and cost, validate against a real engine, and render the capstone report.
#
# Paths: the repository's own files (this Snakefile's config.yaml, rules/, scripts/, schemas/, the
# report templates, the package sources every rule depends on) are found from workflow.basedir, so
# `snakemake -s <repo>/Snakefile` works from any directory. What the user names (--configfile,
# workload.trace.path, model.source) is relative to the working directory, as are results/ and logs:
# the directory snakemake runs in (the current one, or --directory).
import os
import sys

from servingplan.run_record import creates_report_only, report_refusal

configfile: os.path.join(workflow.basedir, "config.yaml")
# `snakemake --report results/snakemake_report.html`: the outputs marked report() in rules/, with
# their captions from reports/captions/
report: "reports/captions/workflow.rst"


include: "rules/common.smk"
include: "rules/profile.smk"
include: "rules/fit.smk"
include: "rules/simulate.smk"
include: "rules/plan.smk"
include: "rules/validate.smk"
if carry_over_check_skipped(config) is None:
    include: "rules/check.smk"
include: "rules/report.smk"
if engine(config) == LLAMACPP:
    include: "rules/llamacpp.smk"

# `snakemake --report` describes the run in results/ under this config: refuse any other config than
# the run's (servingplan/run_record.py), rather than file its outputs under the wrong settings
if creates_report_only(sys.argv):
    _refusal = report_refusal(CONFIG_HASH)
    if _refusal:
        print(_refusal, file=sys.stderr)
        raise SystemExit(2)


rule all:
    input:
        "results/report/report.html",
        "results/report/report.md",
    default_target: True
