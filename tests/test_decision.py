"""The one decision across machines (results/plan/decision.json): every machine's options judged on the
pessimistic end of each interval, the cheapest meeting all four targets picked, else the closest with
what it misses."""
import copy

import pytest

from servingplan import planner

SLO = {"ttft_ms": 300.0, "ttft_percentile": 90, "capacity_target_rate": 9.0}
COST = {"target_per_1k_tokens": 0.001}
BUDGET = 2e9


def judged(capacity_interval=(9.5, 14.0), latency_range=(200.0, 280.0), cost_interval=(0.0006, 0.0008),
           measured_bytes=None, reserved_bytes=1.4e9, replicas=1, policy="continuous", cap=8, stable=True):
    """One configuration as recommend builds it, judged: each figure with its interval."""
    row = {"policy": policy, "max_num_seqs": cap, "replicas": replicas, "router": None if replicas == 1 else "round_robin",
           "stable_today": stable,
           "latency_ms": None if latency_range is None else sum(latency_range) / 2,
           "latency_ms_range": None if latency_range is None else list(latency_range),
           "capacity_rps": sum(capacity_interval) / 2, "capacity_interval": list(capacity_interval),
           "capacity_never_met": False, "memory_bytes": reserved_bytes, "memory_measured_bytes": measured_bytes,
           "budget_bytes": BUDGET, "cost_per_1k": sum(cost_interval) / 2, "cost_per_1k_interval": list(cost_interval)}
    return planner._judge(row, SLO, COST)


def option(measured=True, **figures):
    return planner._option(judged(**figures), SLO, COST, demand=500.0, price=1.0, measured=measured)


def machine(name, *options, measured=False):
    return {"label": {"machine": name, "display_name": name.upper(), "measured": measured},
            "options": sorted(options, key=planner._rank),
            "routes": {"prefill_speedup": None, "replicas_to_keep_up": None, "replicas_usd_per_1k": None,
                       "cheapest_mix": None}}


def test_a_capacity_whose_low_end_misses_the_target_is_a_miss():
    # the T4 case of issue 18: 11 req/s (7.04 to 14) against 9 req/s
    fragile = option(capacity_interval=(7.04, 14.0))
    assert fragile["verdicts"]["capacity"]["value"] > 9.0 and not fragile["verdicts"]["capacity"]["pass"]
    assert fragile["misses"] == ["capacity"] and not fragile["meets_all"]
    assert option(capacity_interval=(9.0, 14.0))["verdicts"]["capacity"]["pass"]


def test_latency_and_cost_are_judged_on_their_pessimistic_ends():
    slow_seed = option(latency_range=(250.0, 310.0))
    assert slow_seed["verdicts"]["latency"]["value"] < 300.0 and slow_seed["misses"] == ["latency"]
    dear_end = option(cost_interval=(0.0008, 0.0011))
    assert dear_end["verdicts"]["cost"]["value"] < 0.001 and dear_end["misses"] == ["cost"]
    assert dear_end["usd_per_1k"] == {"value": pytest.approx(0.00095), "low": 0.0008, "high": 0.0011}


def test_memory_is_judged_on_the_measurement_when_there_is_one_else_on_the_reservation():
    measured = option(measured_bytes=2.1e9, reserved_bytes=1.4e9)
    assert measured["verdicts"]["memory"]["basis"] == "measured" and measured["misses"] == ["memory"]
    assert measured["verdicts"]["memory"]["value"] == 2.1e9
    reserved = option(reserved_bytes=1.4e9)
    assert reserved["verdicts"]["memory"]["basis"].startswith("reserved") and reserved["meets_all"]
    assert option(reserved_bytes=2.5e9)["misses"] == ["memory"]


def test_the_pick_is_the_cheapest_option_meeting_all_four_across_machines():
    here = machine("here", option(cost_interval=(0.0007, 0.0009)), option(capacity_interval=(5.0, 8.0)),
                   measured=True)
    laptop = machine("laptop", option(measured=False, cost_interval=(0.0001, 0.0002), latency_range=(290, 320)))
    gpu = machine("gpu", option(measured=False, cost_interval=(0.0003, 0.0005)),
                  option(measured=False, cost_interval=(0.0002, 0.0006), replicas=2))
    decision = planner.decide([here, laptop, gpu])
    pick = decision["pick"]
    # the laptop is cheaper but misses latency at its slow end; among those meeting all, the dear end ranks
    assert (pick["machine"], pick["replicas"], pick["usd_per_1k"]["high"]) == ("gpu", 1, 0.0005)
    assert pick["display_name"] == "GPU" and pick["measured"] is False and decision["closest"] is None
    ranked = decision["options"]
    assert [o["meets_all"] for o in ranked] == [True, True, True, False, False]
    assert [o["usd_per_1k"]["high"] for o in ranked[:3]] == [0.0005, 0.0006, 0.0009]
    lines = {m["machine"]: m for m in decision["machines"]}
    assert list(lines) == ["here", "laptop", "gpu"]
    assert lines["laptop"]["meets_all"] is False and lines["laptop"]["misses"] == ["latency"]
    assert lines["here"]["best"]["usd_per_1k"]["high"] == 0.0009 and lines["here"]["measured"] is True


def test_when_nothing_meets_all_four_the_closest_is_named_with_what_it_misses():
    here = machine("here", option(latency_range=(400, 500), capacity_interval=(1, 2), cost_interval=(0.01, 0.02)),
                   measured=True)
    laptop = machine("laptop", option(measured=False, cost_interval=(0.0017, 0.0018)),
                     option(measured=False, cost_interval=(0.0001, 0.0002), capacity_interval=(3, 4),
                            latency_range=(350, 400)))
    decision = planner.decide([here, laptop])
    assert decision["pick"] is None
    closest = decision["closest"]
    assert (closest["machine"], closest["misses"], closest["usd_per_1k"]["high"]) == ("laptop", ["cost"], 0.0018)
    assert all(not o["meets_all"] for o in decision["options"])


def test_the_routes_are_this_machines():
    routes = {"prefill_speedup": {"value": 2.0, "low": 1.8, "high": 2.3}, "replicas_to_keep_up": None,
              "replicas_usd_per_1k": None, "cheapest_mix": None}
    here = dict(machine("here", option(), measured=True), routes=routes)
    other = machine("gpu", option(measured=False))
    assert planner.decide([other, copy.deepcopy(here)])["routes"] == routes
    assert planner.decide([other])["routes"]["prefill_speedup"] is None
