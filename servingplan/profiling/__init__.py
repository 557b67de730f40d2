"""Profile GPT-2 on this machine (model, measure, machine) and fit the step-time cost model to it (fit)."""
