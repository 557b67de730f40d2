"""Stage simulate: reads the cost model (results/fit/costmodel.json, or a target's
results/machines/<machine>/costmodel.json) and the config's workload and sweep; writes
results/workload/workload.json and results/machines/<machine>/{sweep,capacity}/cells, latency.csv,
capacity.csv, chunk_sweep.csv; run by rules/simulate.smk.

Discrete-event simulation of one LLM serving replica (and a fleet behind a router).
"""
from servingplan.simulate.scheduler import POLICIES, BlockManager, Scheduler, Seq, Step
from servingplan.simulate.simulator import SimResult, simulate

__all__ = ["POLICIES", "BlockManager", "Scheduler", "Seq", "Step", "SimResult", "simulate"]
