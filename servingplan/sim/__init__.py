"""Discrete-event simulation of one LLM serving replica (and a fleet behind a router)."""
from servingplan.sim.scheduler import POLICIES, BlockManager, Scheduler, Seq, Step
from servingplan.sim.simulator import SimResult, simulate

__all__ = ["POLICIES", "BlockManager", "Scheduler", "Seq", "Step", "SimResult", "simulate"]
