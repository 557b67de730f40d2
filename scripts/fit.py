"""Snakemake script: fit the step-time cost model to a profile.

input: points, machine (the profile's CSV and meta JSON); params: fit (config section), seed;
output: costmodel, report, predicted.
"""
from servingplan.profiling.fit import run_fit

run_fit(snakemake.input.points, snakemake.input.machine, snakemake.params.fit,  # noqa: F821
        snakemake.params.seed, snakemake.output.costmodel, snakemake.output.report,  # noqa: F821
        snakemake.output.predicted)  # noqa: F821
