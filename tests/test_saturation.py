""""Keeps up" is judged at saturation: M/G/1 traces (one slot, a known service time per request) at a
given load of their own are stable below load 1 - LOAD_RESOLUTION and unstable from there on."""
import numpy as np
import pytest

from servingplan.capacity import Criterion, busy_floor, capacity, saturation_rate
from servingplan.metrics import SLO
from servingplan.sim import simulate
from servingplan.sim.simulator import LOAD_RESOLUTION
from servingplan.workload import generate

from conftest import fixed_cost

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
