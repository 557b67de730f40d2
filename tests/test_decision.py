"""The one decision across machines (results/plan/decision.json): every machine's options judged on the
pessimistic end of each interval, the cheapest meeting all four targets picked, else the closest with
what it misses."""
import copy

import pandas as pd
import pytest

from servingplan.plan import planner

SLO = {"ttft_ms": 300.0, "ttft_percentile": 90, "capacity_target_rate": 9.0}
COST = {"target_per_1k_tokens": 0.001}
BUDGET = 2e9


def judged(capacity_interval=(9.5, 14.0), latency_range=(200.0, 280.0), cost_interval=(0.0006, 0.0008),
           measured_bytes=None, measured_basis="measured", reserved_bytes=1.4e9, replicas=1, policy="continuous", cap=8, stable=True,
           latency_ms=None, router="round_robin", kv_model="slots", pool_blocks=384):
    """One configuration as recommend builds it, judged: each figure with its interval (`latency_ms`
    without a range: a latency known by one figure); an unstable configuration has no latency and no
    dollars, as recommend leaves them."""
    if not stable:
        latency_range, cost_interval = None, None
    row = {"policy": policy, "max_num_seqs": cap, "replicas": replicas, "router": None if replicas == 1 else router,
           "stable_today": stable,
           "latency_ms": latency_ms if latency_range is None else sum(latency_range) / 2,
           "latency_ms_range": None if latency_range is None else list(latency_range),
           "capacity_rps": sum(capacity_interval) / 2, "capacity_interval": list(capacity_interval),
           "capacity_never_met": False, "memory_kv_model": kv_model, "memory_bytes": reserved_bytes,
           "memory_reserved_bytes": reserved_bytes, "memory_used_peak_bytes": 0.9e9, "memory_pool_blocks": pool_blocks,
           "memory_fits": reserved_bytes <= BUDGET, "preemptions_max": 0, "memory_runtime_bytes": None,
           "memory_measured_bytes": measured_bytes,
           "memory_measured_basis": measured_basis if measured_bytes is not None else None,
           "budget_bytes": BUDGET, "cost_per_1k": None if cost_interval is None else sum(cost_interval) / 2,
           "cost_per_1k_interval": None if cost_interval is None else list(cost_interval)}
    if replicas > 1:
        row["replicas_searched"] = replicas
    return planner._judge(row, SLO, COST)


def option(measured=True, **figures):
    return planner._option(judged(**figures), SLO, COST, price=1.0, measured=measured)


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


def test_memory_is_judged_by_the_kv_model_and_a_measurement_is_reported_beside_it():
    # a measured resident figure over the budget does not fail weights + KV that fit (issue 34: the target
    # counts weights + KV; the serving runtime is a separate figure)
    measured = option(measured_bytes=2.1e9, reserved_bytes=1.4e9)
    memory = measured["verdicts"]["memory"]
    assert memory["basis"] == "slots" and measured["meets_all"] and memory["value"] == 1.4e9
    assert memory["resident_bytes"] == 2.1e9 and memory["resident_basis"] == "measured"
    assert "slots of KV" in memory["note"]
    assert option(reserved_bytes=2.5e9)["misses"] == ["memory"]
    paged = option(kv_model="paged", reserved_bytes=1.99e9, pool_blocks=1273)["verdicts"]["memory"]
    assert paged["basis"] == "paged" and paged["pass"] and "paged pool of 1273 KV blocks" in paged["note"]


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


def test_a_capacity_interval_whose_low_end_misses_fails_for_a_fleet_too_and_every_verdict_reads_its_pessimistic_end():
    fleet = option(replicas=3, latency_range=None, latency_ms=150.0, capacity_interval=(8.1, 30.0))
    capacity = fleet["verdicts"]["capacity"]
    assert capacity["value"] > 9.0 and capacity["judged"] == 8.1 and not capacity["pass"]
    single = option(latency_range=(250.0, 299.0), cost_interval=(0.0007, 0.00099))
    assert single["meets_all"]
    assert single["verdicts"]["latency"]["judged"] == 299.0 and single["verdicts"]["cost"]["judged"] == 0.00099
    assert single["verdicts"]["capacity"]["judged"] == single["verdicts"]["capacity"]["low"]


def test_an_unstable_configuration_has_no_cost_figure_and_ranks_after_every_option_with_one():
    unstable = option(stable=False, capacity_interval=(0.0, 0.0))
    assert unstable["usd_per_1k"] == {"value": None, "low": None, "high": None}
    cost, latency = unstable["verdicts"]["cost"], unstable["verdicts"]["latency"]
    assert (cost["pass"], cost["value"], cost["low"], cost["high"], cost["judged"]) == (False, None, None, None, None)
    assert cost["note"].startswith("unstable") and latency["value"] is None and not latency["pass"]
    assert unstable["stable"] is False and unstable["misses"] == ["latency", "capacity", "cost"]
    # a stable option missing more targets, and a dear one, still rank before it
    dear = option(cost_interval=(0.02, 0.03), capacity_interval=(1.0, 2.0), reserved_bytes=3e9,
                  latency_range=(400.0, 500.0))
    assert len(dear["misses"]) == 4
    decision = planner.decide([machine("here", unstable, dear, measured=True)])
    assert [o["stable"] for o in decision["options"]] == [True, False]
    assert decision["closest"]["usd_per_1k"]["high"] == 0.03


def test_the_ranking_meets_all_first_then_fewest_misses_then_the_dear_end_then_fewer_replicas():
    options = [option(cost_interval=(0.0001, 0.0009), replicas=2, latency_range=None, latency_ms=100.0),
               option(cost_interval=(0.0005, 0.0009)),
               option(cost_interval=(0.0001, 0.0002), capacity_interval=(5.0, 8.0), latency_range=(400.0, 500.0)),
               option(cost_interval=(0.0003, 0.0004), capacity_interval=(5.0, 8.0)),
               option(cost_interval=(0.0001, 0.0002), capacity_interval=(5.0, 8.0)),
               option(stable=False, capacity_interval=(0.0, 0.0))]
    ranked = planner.decide([machine("gpu", *options)])["options"]
    assert [(len(o["misses"]), o["usd_per_1k"]["high"], o["replicas"]) for o in ranked] == [
        (0, 0.0009, 1), (0, 0.0009, 2), (1, 0.0002, 1), (1, 0.0004, 1), (2, 0.0002, 1), (3, None, 1)]
    assert [o["rank"] for o in ranked] == [1, 2, 3, 4, 5, 6]


def test_each_machines_best_is_its_best_option_not_its_first():
    # recommend's own order put the unstable single machine first: decide re-ranks
    here = {"label": {"machine": "here", "display_name": "this machine", "measured": True},
            "options": [option(stable=False, cap=1), option(capacity_interval=(5.0, 8.0), cap=16),
                        option(replicas=4, latency_range=None, latency_ms=120.0, cost_interval=(0.002, 0.002), cap=8)],
            "routes": None}
    gpu = {**machine("gpu"), "options": [option(measured=False, stable=False, cap=1),
                                         option(measured=False, cost_interval=(0.0004, 0.0006), cap=32)]}
    decision = planner.decide([here, gpu])
    lines = {m["machine"]: m for m in decision["machines"]}
    assert (lines["gpu"]["best"]["cap"], lines["gpu"]["meets_all"]) == (32, True)
    # this machine meets all four nowhere: of its two options missing one target, the cheaper at its dear end
    assert (lines["here"]["best"]["cap"], lines["here"]["misses"]) == (16, ["capacity"])
    assert lines["here"]["best"]["usd_per_1k"]["high"] == 0.0008 and lines["here"]["best"]["stable"]
    assert decision["pick"]["machine"] == "gpu" and decision["pick"]["cap"] == 32


def test_a_fleets_latency_is_judged_on_its_slowest_seed_like_one_machines():
    fleet = option(replicas=3, latency_range=(250.0, 310.0))
    latency = fleet["verdicts"]["latency"]
    assert latency["value"] == 280.0 and latency["judged"] == 310.0 and fleet["misses"] == ["latency"]
    assert "p90 TTFT" in latency["note"] and "3 replicas" in latency["note"] and "slowest seed" in latency["note"]
    assert option(replicas=3, latency_range=(250.0, 299.0))["verdicts"]["latency"]["pass"]
    assert "slowest seed" in option()["verdicts"]["latency"]["note"]


def decision_with_many_options():
    here = machine("here", *(option(stable=False, cap=cap, policy=policy, capacity_interval=(0.0, 0.0))
                             for cap in (1, 2, 4, 8) for policy in ("continuous", "static")), measured=True)
    laptop = machine("laptop", *(option(measured=False, replicas=r, latency_range=(160.0, 180.0),
                                        cost_interval=(0.0006 * r, 0.0006 * r), cap=8) for r in (3, 5, 9)))
    gpu = machine("gpu", *(option(measured=False, cost_interval=(0.0001 * k, 0.0002 * k), cap=2 ** k)
                           for k in range(1, 9)))
    return planner.decide([here, laptop, gpu])


def test_the_table_head_holds_the_pick_each_machines_best_then_the_next_ranked():
    decision = decision_with_many_options()
    head = decision["table_head"]
    assert len(decision["options"]) == 19 and len(head) == planner.TABLE_HEAD_ROWS
    assert decision["table_more"] == 19 - planner.TABLE_HEAD_ROWS
    ranks = [h["rank"] for h in head]
    assert ranks == sorted(ranks) and all(decision["options"][h["index"]]["rank"] == h["rank"] for h in head)
    assert head[0]["pick"] and head[0]["best_of"] == ["GPU"]
    for line in decision["machines"]:
        assert line["best"]["rank"] in ranks
        assert next(h for h in head if h["rank"] == line["best"]["rank"])["best_of"] == [line["display_name"]]
    # this machine's best is unstable, ranked after the 11 options with a cost, yet shown
    assert decision["machines"][0]["best"]["rank"] == 12 and decision["machines"][0]["best"]["stable"] is False


def test_options_csv_has_one_row_per_option_in_rank_order_with_display_names(tmp_path):
    from servingplan.io import write_csv
    decision = decision_with_many_options()
    write_csv(tmp_path / "options.csv", planner.options_table(decision))
    table = pd.read_csv(tmp_path / "options.csv")
    assert list(table["rank"]) == list(range(1, 20))
    assert set(table["machine"]) == {"HERE", "LAPTOP", "GPU"} and set(table["numbers"]) == {"measured", "estimated"}
    assert set(table["policy"]) == {"continuous batching", "static batching"}
    assert set(table["router"].dropna()) == {"round-robin router"}
    first = table.iloc[0]
    assert first["memory_gb"] == 1.4 and first["memory_basis"] == "slots"
    assert (first["cost_usd_per_1k_low"], first["cost_usd_per_1k_high"]) == (0.0001, 0.0002)
    assert (first["capacity_rps_low"], first["capacity_rps_high"]) == (9.5, 14.0)
    unstable = table[~table["keeps_up"]]
    assert len(unstable) == 8 and unstable["cost_usd_per_1k"].isna().all() and (unstable["cost_verdict"] == "fail").all()
    assert unstable["cost_note"].str.startswith("unstable").all()
    fleets = table[table["replicas"] > 1]
    assert fleets["latency_note"].str.contains("replicas; judged on the slowest seed").all()
