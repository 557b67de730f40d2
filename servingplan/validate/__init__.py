"""Stage validate: reads the profile, the fit and the workload; writes
results/validation/{replay.json,comparison.csv,requests.csv,steps.csv,steps_by_batch.csv,validation.json};
run by rules/validate.smk (llama.cpp's replay and comparison in rules/llamacpp.smk reuse it).
"""
