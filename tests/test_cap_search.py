"""The decision searches the cap and judges memory as the machine's engine holds KV (issue 34): a cap
between the sweep grid's can be the answer, one KV model drives both the simulation's admission and the
memory verdict, and a pool the verdict does not allow never makes an option pass."""
import math

import pandas as pd
import pytest

from test_planner import MACHINE, small_config
from servingplan.costmodel import CostModel
from servingplan.memory import GB, kv_blocks, largest_cap_in_memory, slot_blocks
from servingplan.plan import cap_search as search_module
from servingplan.plan import planner
from servingplan.simulate import searches

# decode dominated by its fixed cost per step, so throughput grows with the batch: with the small config's
# workload, caps up to 4 miss the capacity target (9 req/s at the low end) and caps from 5 meet it
BATCHY = CostModel(decode_fixed_s=4e-3, decode_per_seq_s=1e-4, decode_per_ctx_token_s=1e-7, prefill_fixed_s=1e-3,
                   prefill_per_token_s=5e-5, ctx_mode="padded_max", name="batchy")
GRID = [1, 2, 4, 8]
SLOT_BYTES = 768 * 73728
WEIGHTS = MACHINE["memory"]["param_bytes"]
# six and a half slots of the longest context beside the weights: slots fit up to cap 6, so the grid's cap 8
# does not, and a paged pool of 312 blocks
BUDGET_GB = (WEIGHTS + 6.5 * SLOT_BYTES) / GB


def setup(kv_memory: str, budget_gb: float = BUDGET_GB) -> dict:
    config = small_config()
    config["sweep"].update(policies=["continuous"], caps=GRID)
    memory = {**config["memory"], "budget_gb": budget_gb, "kv_memory": kv_memory}
    return {"config": config, "memory": memory, "seeds": [0, 1]}


def grid(run: dict, runtime_bytes=None):
    """The grid's cells as the pipeline's rules compute them: latency, capacity and fleets per cap."""
    c, memory, seeds = run["config"], run["memory"], run["seeds"]
    args = (c["workload"], c["slo"], c["sweep"], memory, seeds)
    latency = pd.concat([planner.sweep_cell(BATCHY, MACHINE, "continuous", cap, *args, runtime_bytes=runtime_bytes)
                         for cap in GRID], ignore_index=True)
    capacity = pd.DataFrame([row for cap in GRID for row in planner.capacity_rows(searches.capacity_cell(
        BATCHY, MACHINE, "continuous", cap, *args, c["capacity"], runtime_bytes=runtime_bytes))])
    fleets = [searches.fleet_cell(BATCHY, MACHINE, "continuous", cap, *args, c["capacity"], c["cost"],
                                  runtime_bytes=runtime_bytes) for cap in GRID]
    return latency, capacity, fleets


def decide(run: dict, with_search: bool = True, runtime_bytes=None):
    """The plan stage for one machine: the grid, the cap search (or none), the memory table, the
    recommendation and the decision."""
    c, memory, seeds = run["config"], run["memory"], run["seeds"]
    latency, capacity, fleets = grid(run, runtime_bytes)
    found = search_module.cap_search(BATCHY, MACHINE, "continuous", c["workload"], c["slo"], c["sweep"], memory,
                                     seeds, c["capacity"], latency, capacity, runtime_bytes)
    found_list = [found] if with_search else []
    searched_latency, _ = planner.searched_frames(found_list)
    table, _ = planner.memory_table(MACHINE, planner.with_searched(latency, searched_latency), memory,
                                    c["workload"]["rate"], runtime_bytes)
    rec = planner.recommend(latency, capacity, table, fleets, c["cost"], c["slo"], c["workload"], seeds,
                            step_model=BATCHY, machine=MACHINE, searches=found_list,
                            kv_memory={"model": memory["kv_memory"], "basis": "configured"})
    return {"search": found, "memory": table, "recommendation": rec, "decision": planner.decide([rec]),
            "latency": latency}


@pytest.fixture(scope="module")
def slots():
    return decide(setup("slots"))


def test_only_a_cap_absent_from_the_grid_meets_all_four_and_the_decision_finds_it_and_its_range(slots):
    found = slots["search"]
    assert found["upper"] == {"cap": 6, "bound": "slots"}
    assert found["smallest_cap"] == 5 and found["range"] == [5, 6] and found["monotone"]
    # the grid's caps: 1, 2 and 4 miss latency or capacity, and 8 misses memory by its slots
    grid_only = decide(setup("slots"), with_search=False)["decision"]
    assert grid_only["pick"] is None
    assert {o["cap"]: o["misses"] for o in grid_only["options"] if o["replicas"] == 1}[8] == ["memory"]
    decision = slots["decision"]
    pick = decision["pick"]
    assert pick is not None and pick["cap"] in (5, 6) and pick["cap"] not in GRID and pick["searched"]
    line = decision["machines"][0]
    assert line["cap_range"]["low"] == 5 and line["cap_range"]["high"] == 6 and line["cap_range"]["bound"] == "slots"
    # every cap the search judged, grid or simulated, and no grid cap below the smallest meets both targets
    judged = {j["cap"]: j["met"] for j in found["judged"]}
    assert judged[4] is False and judged[5] is True and judged[6] is True
    assert set(found["simulated_caps"]) <= {5, 6} and found["simulated_caps"]


def test_the_search_checks_the_neighbour_and_states_verdicts_out_of_order_with_the_cap(monkeypatch):
    real = search_module._judge_latency_capacity

    def four_passes_five_fails(row, slo):
        judged = real(row, slo)
        if row["max_num_seqs"] in (4, 5):
            judged["latency_met"] = judged["capacity_met"] = row["max_num_seqs"] == 4
        return judged

    monkeypatch.setattr(search_module, "_judge_latency_capacity", four_passes_five_fails)
    found = decide(setup("slots"))["search"]
    # the smallest passing cap is the grid's 4 (3, between it and the failing 2, fails); its neighbour 5 is
    # simulated, fails, and is named; the range stops before it
    assert found["smallest_cap"] == 4 and 3 in found["simulated_caps"] and 5 in found["simulated_caps"]
    assert not found["monotone"] and found["out_of_order"] == [5] and found["range"] == [4, 4]


def test_one_input_judged_paged_and_as_slots_each_by_its_definition(slots):
    paged = decide(setup("paged"))
    pool = math.floor(6.5 * 48)
    for result, model in ((slots, "slots"), (paged, "paged")):
        table = result["memory"].set_index("max_num_seqs")
        for cap, row in table.iterrows():
            # the simulation's admission is the verdict's memory model: the pool each cell simulated
            simulated = result["latency"][result["latency"]["max_num_seqs"] == cap]["kv_blocks"]
            expected_pool = cap * slot_blocks(setup(model)["memory"]) if model == "slots" else pool
            assert row["pool_blocks"] == expected_pool and (simulated.empty or set(simulated) == {expected_pool})
            if model == "slots":
                # each slot holds the longest context: the pool never runs out, and memory is the reservation
                assert row["judged_bytes"] == row["total_reserved_bytes"] and row["fits"] == (cap <= 6)
                assert row["preemptions_max"] == 0
            else:
                # weights plus the pool the budget leaves: within it by construction, whatever the cap
                assert row["judged_bytes"] == WEIGHTS + pool * 16 * 73728 and row["fits"]
    # above the pool's blocks over the fewest any sequence holds (its prompt's) the cap never binds
    run = setup("paged")
    shortest = min(t.prompt_tokens.min() for t in planner.traces(run["config"]["workload"], run["seeds"]))
    assert paged["search"]["upper"] == {"cap": pool // math.ceil(shortest / 16), "bound": "pool"}
    # slots: cap 8 misses memory; paged: cap 8 passes it, its pool of 312 blocks within the budget
    def memory_verdict(result, cap):
        return next(o for o in result["decision"]["options"] if o["cap"] == cap and o["replicas"] == 1)["verdicts"]["memory"]
    assert not memory_verdict(slots, 8)["pass"] and memory_verdict(slots, 8)["basis"] == "slots"
    assert memory_verdict(paged, 8)["pass"] and memory_verdict(paged, 8)["basis"] == "paged"
    assert memory_verdict(paged, 8)["pool_blocks"] == pool


def test_an_option_passing_only_on_a_pool_its_memory_verdict_does_not_allow_cannot_meet_all_four():
    run = setup("paged")
    # the measured runtime leaves a pool of 40 blocks (640 tokens): about two sequences at once
    runtime = (BUDGET_GB * GB - WEIGHTS) - 40 * 16 * 73728 - 1.0
    assert kv_blocks(MACHINE, run["memory"], 8, runtime) == 40
    ignoring_runtime = decide(run)["decision"]
    with_runtime = decide(run, runtime_bytes=runtime)

    def cap8(decision):
        return next(o for o in decision["options"] if o["cap"] == 8 and o["replicas"] == 1)
    # on the pool the budget would give without the runtime, cap 8 meets every target
    assert cap8(ignoring_runtime)["meets_all"]
    # on the pool that fits beside the measured runtime, the same cap's latency and capacity fail
    option = cap8(with_runtime["decision"])
    assert option["verdicts"]["memory"]["pool_blocks"] == 40 and option["verdicts"]["memory"]["pass"]
    assert not option["meets_all"] and {"latency", "capacity"} & set(option["misses"])
    simulated = with_runtime["latency"][with_runtime["latency"]["max_num_seqs"] == 8]
    assert set(simulated["kv_blocks"]) == {40} and simulated["peak_kv_blocks"].max() <= 40
    # and no option, searched or not, meets all four on a pool it is not given
    assert all(o["verdicts"]["memory"]["pool_blocks"] == 40 for o in with_runtime["decision"]["options"])
    upper = largest_cap_in_memory(MACHINE, run["memory"], 16, runtime)
    assert upper == {"cap": 40, "bound": "pool"}
