"""Stage check: reads the 1-thread profile and fit (results/check/one_thread/) and this machine's
fit; writes results/check/carry_over_check.json; run by rules/check.smk.
"""
