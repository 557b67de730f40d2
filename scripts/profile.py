"""Snakemake script: profile the model on this machine.

params: profile, model (config sections), seed, quick; output: points, samples, machine (the meta JSON);
log: where the progress bar goes.
"""
from contextlib import redirect_stderr

from servingplan.profiling.measure import run_profile

params = snakemake.params  # noqa: F821 - injected by Snakemake
with open(snakemake.log[0], "w") as log, redirect_stderr(log):  # noqa: F821
    profile = run_profile(params.profile, params.model, params.seed, quick=bool(params.quick),
                          threads=params.profile["threads"] or snakemake.threads)  # noqa: F821
profile.write(snakemake.output.points, snakemake.output.samples, snakemake.output.machine)  # noqa: F821
