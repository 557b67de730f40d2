""""Keeps up" is judged at saturation: M/G/1 traces (one slot, a known service time per request) at a
given load of their own are stable below load 1 - LOAD_RESOLUTION and unstable from there on; a fleet of
such replicas likewise at a mean per-replica load of 1 - LOAD_RESOLUTION, whatever its router."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servingplan.simulate import POLICIES, simulate
from servingplan.simulate.capacity import Criterion, busy_floor, capacity, saturation_rate
from servingplan.simulate.fleet import ROUTERS, join_shortest_queue, simulate_fleet
from servingplan.simulate.metrics import SLO
from servingplan.simulate.simulator import LOAD_RESOLUTION, Replica, Timeline, run_replicas
from servingplan.simulate.workload import CAPSTONE, Trace, generate

from conftest import GROWING, fixed_cost

# prefill 0.5 s, then 0.25 s per further token: request i takes exactly 0.5 + 0.25 * (o_i - 1) s alone
MODEL = fixed_cost(decode_s=0.25, prefill_s=0.5)
SPEC = {"num_requests": 600, "rate": 1.0, "prompt": {"dist": "uniform", "min": 16, "max": 512},
        "output": {"dist": "uniform", "min": 1, "max": 40}}
SEEDS = (0, 1, 2)


def service_s(trace) -> np.ndarray:
    return 0.5 + 0.25 * (np.asarray(trace.output_tokens, dtype=float) - 1)


def at_load(seed: int, rho: float):
    """The seed's trace rescaled so that its own load, total service over its duration, is `rho`."""
    trace = generate(SPEC, seed)
    return trace.with_rate(rho * len(trace) / service_s(trace).sum())


@pytest.mark.parametrize("policy", ["static", "continuous"])
@pytest.mark.parametrize("rho, stable", [(0.95, True), (1.0 - 10 * LOAD_RESOLUTION, True), (1.00, False),
                                         (1.02, False), (1.05, False)])
def test_an_mg1_queue_keeps_up_exactly_below_its_own_saturation(policy, rho, stable):
    for seed in SEEDS:
        trace = at_load(seed, rho)
        result = simulate(trace, MODEL, policy, 1)
        # one slot: the backlog grows by the trace's total service minus its duration, (rho - 1) * duration
        assert result.backlog_growth_s == pytest.approx(service_s(trace).sum() - trace.duration_s,
                                                        abs=1e-9 * trace.duration_s)
        assert result.finished.all() and not result.truncated
        assert result.stable is stable


@pytest.mark.parametrize("rho", [0.95, 1.00, 1.02, 1.05])
def test_a_run_stopped_once_settled_unstable_has_the_full_runs_verdict(rho):
    trace = at_load(0, rho)
    full = simulate(trace, MODEL, "continuous", 1)
    stopped = simulate(trace, MODEL, "continuous", 1, stop_when_unstable=True)
    assert stopped.stable is full.stable
    if full.stable:
        assert np.array_equal(stopped.completion_s, full.completion_s)
    elif rho > 1.0:
        # the verdict settles when the busy time reaches the trace's duration, before the drain ends
        assert stopped.truncated and stopped.steps < full.steps


def test_the_busy_time_floor_is_exact_for_one_slot_and_a_bound_with_batching(growing_cost):
    # the engine time the trace needs, which bounds one slot's keeping up (capacity.saturation_rate)
    trace = at_load(0, 1.0)
    assert busy_floor(trace, MODEL, "static", 1) == pytest.approx(service_s(trace).sum(), rel=1e-12)
    heavy = generate({**SPEC, "rate": 50.0, "num_requests": 200}, 3)
    for policy in ("static", "continuous", "continuous_chunked"):
        for cap in (1, 4, 16):
            run = simulate(heavy, growing_cost, policy, cap, chunk_size=64, kv_blocks=60, block_size=16,
                           record_steps=True)
            assert busy_floor(heavy, growing_cost, policy, cap) <= run.step_table["duration_s"].sum()


def test_stable_capacity_of_one_slot_brackets_each_traces_own_saturation_rate():
    traces = [generate(SPEC, seed) for seed in SEEDS]
    found = capacity(traces, list(SEEDS), MODEL, "static", 1, 512, Criterion(SLO(), attainment_goal=0.0),
                     0.05, 64.0, 0.02)
    for trace, bracket in zip(traces, found["per_seed"]):
        saturation = len(trace) / service_s(trace).sum()
        assert saturation_rate(trace, MODEL, "static", 1) == pytest.approx(saturation, rel=1e-12)
        # stable at `lower`, unstable at `upper`: never judged stable at or above its own saturation rate
        assert bracket["lower"] < saturation <= bracket["upper"] * (1 + 1e-12)
        assert bracket["upper"] / bracket["lower"] - 1 <= 0.02


def fleet_at_load(seed: int, replicas: int, rho: float, requests: int = 600):
    """The seed's trace rescaled so that a fleet's mean per-replica load, total service over replicas x
    duration, is `rho`."""
    trace = generate({**SPEC, "num_requests": requests}, seed)
    return trace.with_rate(rho * replicas * len(trace) / service_s(trace).sum())


def round_robin_share(trace, replicas: int, r: int):
    """The requests round robin sends to replica r."""
    return Trace(trace.arrival_s[r::replicas], trace.prompt_tokens[r::replicas], trace.output_tokens[r::replicas])


def one_slot_fleet(trace, replicas: int, router: str):
    return simulate_fleet(trace, MODEL, "continuous", 1, 512, None, 16, 20.0, replicas, router)


@pytest.mark.parametrize("seed", SEEDS)
def test_a_round_robin_fleet_keeps_up_on_its_mean_load_though_one_replica_falls_behind(seed):
    # issue 18: 64 one-slot replicas at about 9 req/s, about 9 requests each, at a mean load of 0.8
    trace = fleet_at_load(seed, 64, 0.8)
    assert 8.0 < trace.mean_rate_rps < 10.0
    own_loads = [service_s(round_robin_share(trace, 64, r)).sum() / round_robin_share(trace, 64, r).duration_s
                 for r in range(64)]
    worst = int(np.argmax(own_loads))
    # a replica whose few requests carry more service than their span: judged on its own, it falls behind
    assert own_loads[worst] > 1.0
    assert not simulate(round_robin_share(trace, 64, worst), MODEL, "continuous", 1).stable
    fleet = one_slot_fleet(trace, 64, "round_robin")
    assert fleet.finished.all() and fleet.stable
    over = one_slot_fleet(fleet_at_load(seed, 64, 1.05), 64, "round_robin")
    assert over.finished.all() and not over.stable


@settings(max_examples=30)
@given(seed=st.integers(0, 2 ** 16), replicas=st.integers(2, 64), requests=st.integers(2, 300),
       rho=st.one_of(st.floats(0.8, 1.2), st.sampled_from([1.0 - 10 * LOAD_RESOLUTION, 1.0])),
       policy=st.sampled_from(["static", "continuous"]), router=st.sampled_from(sorted(ROUTERS)))
def test_a_one_slot_fleet_keeps_up_exactly_below_its_mean_load_of_one_whatever_its_router(seed, replicas,
                                                                                           requests, rho,
                                                                                           policy, router):
    trace = fleet_at_load(seed, replicas, rho, requests)
    fleet = simulate_fleet(trace, MODEL, policy, 1, 512, None, 16, 20.0, replicas, router)
    total = service_s(trace).sum()
    # each replica's backlog grows over the trace by its own service minus the duration, whichever requests
    # the router sent it (fewer requests than replicas leave some with none: minus the duration)
    assert fleet.backlog_growth_s == pytest.approx(total / replicas - trace.duration_s,
                                                   abs=1e-9 * trace.duration_s)
    assert fleet.finished.all() and not fleet.truncated
    assert fleet.stable is bool(total / replicas < trace.duration_s * (1.0 - LOAD_RESOLUTION))


def test_a_fleet_stopped_once_settled_unstable_has_the_full_runs_verdict():
    rng = np.random.default_rng(18)
    verdicts, stopped_early = {router: [] for router in ROUTERS}, {router: 0 for router in ROUTERS}
    for _ in range(40):
        replicas, cap, policy = int(rng.integers(2, 17)), int(rng.choice([1, 2, 4])), str(rng.choice(POLICIES))
        router = str(rng.choice(list(ROUTERS)))
        trace = generate({**CAPSTONE, "num_requests": int(rng.integers(20, 200))}, int(rng.integers(2 ** 16)))
        # around the rate at which the busy-time floor alone fills the fleet: both verdicts come up
        floor_rate = replicas * len(trace) / busy_floor(trace, GROWING, policy, cap)
        trace = trace.with_rate(rng.uniform(0.5, 1.5) * floor_rate)
        full, stopped = (simulate_fleet(trace, GROWING, policy, cap, 64, None, 16, 20.0, replicas, router,
                                        stop_when_unstable=stop) for stop in (False, True))
        assert stopped.stable is full.stable
        if full.stable:
            np.testing.assert_array_equal(stopped.completion_s, full.completion_s)
        stopped_early[router] += stopped.steps < full.steps
        verdicts[router].append(full.stable)
    # each router's cases take both verdicts and some stop early
    assert all(any(v) and not all(v) for v in verdicts.values()), verdicts
    assert all(stopped_early.values()), stopped_early


@pytest.mark.parametrize("rho", [0.8, 0.9])
def test_a_join_shortest_queue_fleet_keeps_up_on_its_mean_load_though_its_first_replica_falls_behind(rho):
    # 4 one-slot replicas, 200 requests: ties go to replica 0, which takes every arrival finding the fleet
    # idle, so it has little slack and its own growth is about its last request's time in the system
    busiest = []
    for seed in SEEDS:
        trace = fleet_at_load(seed, 4, rho, 200)
        timeline = Timeline(len(trace), False)
        fleet = [Replica(MODEL, "continuous", 1, 512, None, 16, timeline) for _ in range(4)]
        result = run_replicas(trace, fleet, join_shortest_queue(), 20.0, "continuous", 1, 512)
        busiest.append(max(r.backlog_growth() for r in fleet))
        assert result.backlog_growth_s == pytest.approx(service_s(trace).sum() / 4 - trace.duration_s,
                                                        abs=1e-9 * trace.duration_s)
        assert result.finished.all() and result.stable
        assert one_slot_fleet(trace, 4, "join_shortest_queue").stable
    # judged on its busiest replica, the fleet would have fallen behind on some seed
    assert max(busiest) > 0.0, busiest


def test_a_one_replica_fleet_of_either_router_is_simulate():
    for seed in SEEDS:
        for rho in (0.98, 1.02):
            trace = at_load(seed, rho)
            alone = simulate(trace, MODEL, "continuous", 1)
            for router in ROUTERS:
                one = one_slot_fleet(trace, 1, router)
                assert one.backlog_growth_s == alone.backlog_growth_s and one.stable is alone.stable
                np.testing.assert_array_equal(one.completion_s, alone.completion_s)
