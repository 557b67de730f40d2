"""Stage cli: the Exercise-2 serving simulator's command line (main.py); reads its flags, a trace
or a cost model; writes its table to stdout and, with --save-result, vLLM's result JSON; run by no rule
(scripts/serving_sim.py, `python -m servingplan.cli`).
"""
