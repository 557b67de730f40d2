"""Snakemake script: profile the model on this machine.

params: profile, model (config sections), seed, quick (optional); output: points, samples, meta.
"""
from servingplan.profiling.measure import run_profile

params = snakemake.params  # noqa: F821 - injected by Snakemake
profile = run_profile(params.profile, params.model, params.seed, quick=bool(params.get("quick", False)),
                      threads=params.profile["threads"] or snakemake.threads)  # noqa: F821
profile.write(snakemake.output.points, snakemake.output.samples, snakemake.output.meta)  # noqa: F821
