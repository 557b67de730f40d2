"""A real continuous-batching GPT-2 engine driving the simulator's Scheduler with the wall clock."""
from servingplan.serving.engine import Engine, EngineRun, request_problem
from servingplan.serving.kvpool import KVPool
from servingplan.serving.replay import compare, predict_steps, replay, request_pairs

__all__ = ["Engine", "EngineRun", "KVPool", "request_problem", "compare", "predict_steps", "replay",
           "request_pairs"]
