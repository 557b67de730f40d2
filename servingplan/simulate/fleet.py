"""Identical replicas behind a router: each arrival goes to one replica, chosen when it arrives."""
from __future__ import annotations

import itertools

from servingplan.costmodel import CostModel
from servingplan.simulate.misses import MissLimit
from servingplan.simulate.policies import DEFAULT_CHUNK_BUDGET
from servingplan.simulate.simulator import Replica, SimResult, Timeline, miss_watch, run_replicas
from servingplan.simulate.workload import Trace


def round_robin():
    turn = itertools.count()
    return lambda replicas, seq: next(turn) % len(replicas)


def join_shortest_queue():
    """Fewest requests waiting or running at the arrival instant; ties go to the lowest index."""
    return lambda replicas, seq: min(range(len(replicas)), key=lambda i: replicas[i].outstanding)


ROUTERS = {"round_robin": round_robin, "join_shortest_queue": join_shortest_queue}
# routers whose choice reads the replicas' state at the arrival instant (the others' replicas run alone)
READS_STATE = {"join_shortest_queue"}


def simulate_fleet(trace: Trace, cost: CostModel, policy: str, max_num_seqs: int, chunk_size: int,
                   kv_blocks: int | None, block_size: int, horizon_factor: float, replicas: int,
                   router: str, record_tokens: bool = False, chunk_budget: str = DEFAULT_CHUNK_BUDGET,
                   stop_when_unstable: bool = False, stop_when_missed: list[MissLimit] | None = None) -> SimResult:
    """`replicas` replicas behind `router`; the stops as in simulator.simulate."""
    if router not in ROUTERS:
        raise ValueError(f"router={router!r}: allowed {', '.join(ROUTERS)}")
    if replicas < 1:
        raise ValueError(f"replicas={replicas}: must be >= 1")
    timeline = Timeline(len(trace), record_tokens, miss_watch(trace, stop_when_missed))
    fleet = [Replica(cost, policy, max_num_seqs, chunk_size, kv_blocks, block_size, timeline, None, chunk_budget)
             for _ in range(replicas)]
    return run_replicas(trace, fleet, ROUTERS[router](), horizon_factor, policy, max_num_seqs, chunk_size,
                        stop_when_unstable, route_reads_state=router in READS_STATE)
