"""Snakemake script: fit the step-time cost model to a profile.

input: points, meta (the profile's); params: fit (config section), seed;
output: cost_model, report, predictions.
"""
from servingplan.profiling.fit import run_fit

run_fit(snakemake.input.points, snakemake.input.meta, snakemake.params.fit, snakemake.params.seed,  # noqa: F821
        snakemake.output.cost_model, snakemake.output.report, snakemake.output.predictions)  # noqa: F821
