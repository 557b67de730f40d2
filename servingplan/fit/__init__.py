"""Stage fit: reads results/profile/<fingerprint>/profile.csv; writes
results/fit/{costmodel.json,fit_report.json,predicted_vs_measured.csv}; run by rules/fit.smk (and the
1-thread fit of rules/check.smk, llamacpp_fit of rules/llamacpp.smk).
"""
