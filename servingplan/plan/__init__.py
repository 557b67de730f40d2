"""Stage plan: reads each machine's cost model and simulated cells and the config's cost and
hardware; writes results/machines/<machine>/{costmodel.json,carry_over.json,fleet,search,memory.csv,memory.json,
recommendation.json}, results/plan/{decision.json,options.csv,hardware_verdicts.json} and results/exercise2/;
run by rules/plan.smk.
"""
