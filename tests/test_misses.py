"""A run stopped once its SLO verdicts are settled failing (simulate.misses) gives the full run's verdicts: every
verdict it watched fails on the full run too, and a run the watch never stopped is the full run."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from servingplan.simulate import searches
from servingplan.simulate import simulate
from servingplan.simulate.capacity import Criterion, capacity_searches
from servingplan.simulate.fleet import ROUTERS, simulate_fleet
from servingplan.simulate.metrics import SLO, miss_limit, summarize
from servingplan.simulate.workload import generate

from conftest import GROWING

SPEC = {"num_requests": 200, "rate": 1.0, "prompt": {"dist": "uniform", "min": 16, "max": 512},
        "output": {"dist": "uniform", "min": 1, "max": 60}}

criteria = st.one_of(
    st.builds(lambda ttft, q: Criterion(SLO(ttft_ms=ttft, ttft_percentile=q)),
              st.floats(20.0, 3000.0), st.sampled_from([50, 90, 95, 99, 100])),
    st.builds(lambda ttft, tpot, q: Criterion(SLO(ttft_ms=ttft, ttft_percentile=q, tpot_ms=tpot, tpot_percentile=q)),
              st.floats(20.0, 3000.0), st.floats(5.0, 200.0), st.sampled_from([50, 90, 99])),
    st.builds(lambda ttft, tpot, goal: Criterion(SLO(ttft_ms=ttft, tpot_ms=tpot), attainment_goal=goal),
              st.floats(20.0, 3000.0), st.floats(5.0, 200.0), st.sampled_from([0.5, 0.9, 0.99, 1.0])),
)


def full_verdict(result, criterion) -> bool:
    return criterion.holds(summarize(result, criterion.slo))


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2 ** 16), requests=st.integers(2, 200), rate=st.floats(0.5, 40.0),
       policy=st.sampled_from(["static", "continuous", "continuous_chunked"]), cap=st.sampled_from([1, 2, 4, 16]),
       watched=st.lists(criteria, min_size=1, max_size=3))
def test_a_run_stopped_on_its_settled_misses_fails_every_verdict_it_watched(seed, requests, rate, policy, cap,
                                                                            watched):
    trace = generate({**SPEC, "num_requests": requests}, seed).with_rate(rate)
    full = simulate(trace, GROWING, policy, cap, 128, 400, 16)
    limits = [criterion.miss_limit(trace) for criterion in watched]
    stopped = simulate(trace, GROWING, policy, cap, 128, 400, 16, stop_when_missed=limits)
    if stopped.misses_settled:
        assert not any(full_verdict(full, criterion) for criterion in watched)
        assert stopped.truncated and stopped.steps <= full.steps
    else:
        assert np.array_equal(stopped.completion_s, full.completion_s, equal_nan=True)
        assert summarize(stopped, watched[0].slo) == summarize(full, watched[0].slo)


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2 ** 16), requests=st.integers(2, 200), rate=st.floats(1.0, 60.0),
       replicas=st.integers(2, 8), router=st.sampled_from(sorted(ROUTERS)), cap=st.sampled_from([1, 4]),
       criterion=criteria)
def test_a_fleet_stopped_on_its_settled_misses_fails_the_verdict_it_watched(seed, requests, rate, replicas, router,
                                                                            cap, criterion):
    trace = generate({**SPEC, "num_requests": requests}, seed).with_rate(rate)
    full = simulate_fleet(trace, GROWING, "continuous", cap, 512, 400, 16, 20.0, replicas, router)
    stopped = simulate_fleet(trace, GROWING, "continuous", cap, 512, 400, 16, 20.0, replicas, router,
                             stop_when_missed=[criterion.miss_limit(trace)])
    if stopped.misses_settled:
        assert not full_verdict(full, criterion)
    else:
        assert np.array_equal(stopped.completion_s, full.completion_s, equal_nan=True)


def test_the_limits_are_the_fewest_misses_that_settle_the_verdicts():
    outputs = np.array([1] * 10 + [5] * 90)
    slo = SLO(ttft_ms=300, ttft_percentile=90, tpot_ms=100, tpot_percentile=50)
    limit = miss_limit(slo, outputs)
    # p90 of 100 values lies between the 90th and 91st smallest: 11 misses, the 90th to the 100th, settle it;
    # p50 of the 90 multi-token replies' TPOT, between the 45th and 46th: 46 misses
    assert (limit.ttft_misses, limit.tpot_misses, limit.bad) == (11, 46, math.inf)
    # attainment 0.9 of 100 fails at 11 requests that can no longer be good
    assert miss_limit(slo, outputs, attainment_goal=0.9).bad == 11
    assert Criterion(SLO(), attainment_goal=0.0).miss_limit(generate(SPEC, 0)) is None


def test_a_stopped_run_has_no_figures_to_report():
    trace = generate(SPEC, 0).with_rate(40.0)
    criterion = Criterion(SLO(ttft_ms=50.0, ttft_percentile=90))
    stopped = simulate(trace, GROWING, "continuous", 4, stop_when_missed=[criterion.miss_limit(trace)])
    assert stopped.misses_settled and stopped.backlog_growth_s is None
    with pytest.raises(ValueError, match="no figures"):
        summarize(stopped, criterion.slo)


def test_a_verdict_that_holds_details_the_rates_in_their_own_order():
    slo = {"ttft_ms": 300.0, "ttft_percentile": 90}
    rates = {"today": 1.0, "capacity_target": 2.0}

    def run(rate, verdict_only=False):
        return [{"stable": True, "ttft_ms_p90": 100.0 * rate}], False

    full = searches._targets_hold(run, rates, slo)
    verdict = searches._targets_hold(run, rates, slo, verdict_only=True)
    assert verdict == full and full[0]
    assert list(verdict[1]) == list(full[1]) == ["today", "capacity_target"]
    # a run that stopped on its settled misses fails the verdict with no summary to detail
    assert searches._targets_hold(lambda rate, verdict_only=False: ([], True), rates, slo, verdict_only=True) == (False, {})


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2 ** 16), ttft_ms=st.floats(100.0, 3000.0), q=st.sampled_from([50, 90, 99]),
       goal=st.sampled_from([0.5, 0.9]), policy=st.sampled_from(["static", "continuous", "continuous_chunked"]),
       cap=st.sampled_from([1, 4]))
def test_capacity_searches_find_the_same_brackets_with_runs_stopped_on_their_misses(seed, ttft_ms, q, goal, policy,
                                                                                   cap):
    traces = [generate({**SPEC, "num_requests": 120}, seed + k) for k in range(2)]
    criteria = {"stable": Criterion(SLO(), attainment_goal=0.0),
                "ttft": Criterion(SLO(ttft_ms=ttft_ms, ttft_percentile=q)),
                "joint": Criterion(SLO(ttft_ms=ttft_ms, ttft_percentile=q, tpot_ms=40.0), attainment_goal=goal)}
    args = (traces, [0, 1], GROWING, policy, cap, 128, criteria, 0.05, 64.0, 0.05, 400, 16)
    stopped = capacity_searches(*args)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Criterion, "miss_limit", lambda self, trace: None)
        assert capacity_searches(*args) == stopped


def test_a_fleet_cell_is_the_same_with_runs_stopped_on_their_misses():
    # one replica fails the targets (runs stop on their misses), four meet them; the speed-up needed is about 2.8
    workload = {**SPEC, "num_requests": 120, "rate": 6.0}
    slo = {"ttft_ms": 300.0, "ttft_percentile": 90, "tpot_ms": 100.0, "capacity_target_rate": 12.0, "attainment_goal": 0.9}
    args = (GROWING, {"memory": {"param_bytes": 0, "kv_bytes_per_token": 200000}}, "continuous", 2, workload, slo,
            {"chunk_size": 512, "horizon_factor": 20.0}, {"block_size": 16, "budget_gb": 1.0, "kv_memory": "paged"}, [0, 1],
            {"rate_min": 0.05, "rate_max": 64.0, "tolerance": 0.05}, {"max_replicas": 8, "routers": sorted(ROUTERS)})
    full_runs, stops = searches.simulate_fleet, []

    def watched(*a, **k):
        result = full_runs(*a, **k)
        stops.append(result.misses_settled)
        return result

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(searches, "simulate_fleet", watched)
        stopped = searches.fleet_cell(*args)
        patch.setattr(searches, "simulate_fleet", lambda *a, stop_when_missed=None, **k: full_runs(*a, **k))
        assert searches.fleet_cell(*args) == stopped
    assert any(stops) and not all(stops)
    assert {found["replicas"] for found in stopped["fleets"].values()} == {4}
