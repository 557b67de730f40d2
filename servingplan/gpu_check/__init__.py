"""The GPU check (issue 36): the GPU targets' estimates held against what a real GPU measures.

Reads results/fit/costmodel.json and results/profile/<fingerprint>/machine.json (--carry-from,
--machine-json) and config.yaml; writes DIR/gpu_check.json and DIR/gpu_check.md (`make gpu-check`:
results/gpu_check). No rule runs it: `python -m servingplan.gpu_check` (run.py) on a machine with a GPU;
the pipeline reads its file through servingplan.plan.gpu_evidence (config `gpu_check`).
"""
