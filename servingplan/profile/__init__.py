"""Stage profile: reads the config's `profile` grid and the model; writes
results/profile/<fingerprint>/{profile.csv,samples.csv,machine.json}; run by rules/profile.smk (and the
1-thread profile of rules/check.smk).

Profile GPT-2 on this machine (model, measure, machine, on the grid of grid.py, through the step functions
of kvpool.py); the step-time cost model is fitted to it by servingplan.fit.step_model.
"""
