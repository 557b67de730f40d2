"""Target machines (config `hardware`): the roofline carry-over of each cost-model term, the config's
checks, and the report's section giving each target's verdicts as an estimate from the roofline."""
from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path

import pandas as pd
import pytest
import yaml
from markupsafe import escape

import test_report
from servingplan import architecture, roofline
from servingplan.config import ConfigError, check
from servingplan.costmodel import CostModel
from servingplan.io import read_json, write_json
from servingplan.plan import hardware, planner
from servingplan.plan import names
from servingplan.plan.hardware import memory_for, target_kv_memory
from servingplan.report import blocks
from servingplan.report.render import write_report
from servingplan.seeds import simulation_seeds
from servingplan.simulate import searches

ROOT = Path(__file__).resolve().parent.parent
GPT2 = architecture.GPT2_SMALL
# a balance point of 1 FLOP per byte: a decode step's weight read is memory-bound at batch 1, and
# compute-bound from batch 4 up (2 FLOPs per weight per sequence against 4 bytes per weight)
HERE = {"name": "here", "bandwidth_gbs": 100.0, "gflops": 100.0}
# every term at or above its floor on HERE, as a fit against HERE's peaks leaves it
COST = CostModel(decode_fixed_s=5e-3, decode_per_seq_s=3e-3, decode_per_ctx_token_s=1e-6, prefill_fixed_s=6e-3,
                 prefill_per_token_s=2.5e-3, prefill_per_token_sq_s=2e-7, prefill_per_token_ctx_s=4e-7,
                 ctx_mode="padded_max", name="measured", meta={"speed_band": {"decode": [0.9, 1.1], "prefill": [0.95, 1.05]}},
                 decode_batch_fixed_s=((1, 7e-3), (4, 1.3e-2), (32, 9e-2)))


# a GPU that pays no launch overhead: every term keeps its efficiency, with nothing else in the way
EFFICIENCY = {"kind": "gpu", "launch_overhead_ms": 0.0}


def carried(target: dict, cost: CostModel = COST) -> tuple[CostModel, dict]:
    model, terms = hardware.carry_over(cost, GPT2, HERE, {"name": "target", **target})
    return model, {(t["term"], t["batch"]): t for t in terms}


def model_terms(model: CostModel) -> dict:
    return {**{term: getattr(model, term) for term in roofline.TERMS}, **dict(model.decode_batch_fixed_s)}


@pytest.mark.parametrize("kind", [{}, EFFICIENCY])
def test_a_target_identical_to_this_machine_gives_back_the_same_model(kind):
    model, terms = carried({"bandwidth_gbs": 100.0, "gflops": 100.0, **kind})
    assert model_terms(model) == pytest.approx(model_terms(COST), rel=1e-12)
    assert {k: v for k, v in model.meta.items() if k != "carry_over"} == COST.meta
    assert {t["scale"] for t in terms.values()} == {1.0}
    assert not any(t["clamped"] for t in terms.values()) and model.meta["carry_over"]["clamped_terms"] == []


def test_a_cpu_target_scales_each_terms_roofline_time_and_carries_the_time_above_it():
    """The rule the 1-thread check measured: on a CPU, a term's time above its floor here (host loop,
    kernels short of their peak) does not shrink with more bandwidth or FLOPs, only with faster cores."""
    for target in ({"bandwidth_gbs": 40.0, "gflops": 55.0}, {"bandwidth_gbs": 400.0, "gflops": 800.0}):
        for speedup in (None, 0.5, 2.0):
            entry = {**target, **({"core_speedup": speedup} if speedup else {})}
            model, terms = carried(entry)
            for (term, batch), row in terms.items():
                here_floor = roofline.floor(roofline.batch_work(GPT2, batch) if batch else roofline.term_work(GPT2)[term],
                                            100.0, 100.0)[0]
                expected = row["roofline_target_s"] + (row["seconds_here"] - here_floor) / (speedup or 1.0)
                assert row["rule"] == "roofline share" and row["above_floor_here_s"] == pytest.approx(row["seconds_here"] - here_floor)
                assert row["seconds_target"] == pytest.approx(max(expected, row["roofline_target_s"]), rel=1e-12)
                assert row["ratio"] == pytest.approx(row["seconds_target"] / row["seconds_here"], rel=1e-12)
            notes = model.meta["carry_over"]
            assert notes["rule"] == "roofline share" and notes["core_speedup"] == (speedup or 1.0)
            assert notes["core_speedup_configured"] == (speedup is not None)
    # a batch-1 step four times its floor here: four times the bandwidth takes off a quarter of its floor only
    model, terms = carried({"bandwidth_gbs": 400.0, "gflops": 400.0})
    row = terms[("decode_batch_fixed_s", 1)]
    assert row["bound_here"] == row["bound_target"] == "memory"
    assert row["seconds_target"] == pytest.approx(7e-3 - 0.75 * row["roofline_here_s"], rel=1e-12)
    # a GPU target of the same rates keeps the term's efficiency: a quarter of its time
    assert carried({"bandwidth_gbs": 400.0, "gflops": 400.0, **EFFICIENCY})[1][("decode_batch_fixed_s", 1)][
        "seconds_target"] == pytest.approx(7e-3 / 4, rel=1e-12)


def test_the_carry_over_scales_from_the_median_probe_reading_not_from_one_quiet_minutes_peak():
    """Two of five bandwidth readings of a profile caught the neighbours quiet (the machine's two cores
    drew twice the usual bandwidth): the calls ran at the typical reading, HERE's, so the carry-over
    starts from it and a target with twice its rates halves the memory-bound terms."""
    rates = [(100.0, 98.0), (190.0, 99.0), (95.0, 100.0), (104.0, 103.0), (200.0, 101.0)]
    readings = [{"label": str(i), "bandwidth_gbs": bandwidth, "gemm_gflops": gflops}
                for i, (bandwidth, gflops) in enumerate(rates)]
    peak = {"bandwidth_gbs": 200.0, "gemm_gflops": 103.0, "readings": readings,
            "seen": {"bandwidth_gbs": 100.0, "gemm_gflops": 100.0, "readings": 5}}
    here = hardware.here_roofline({"roofline": peak})
    assert (here["bandwidth_gbs"], here["gflops"], here["readings"]) == (100.0, 100.0, 5)
    assert (here["peak_bandwidth_gbs"], here["peak_gflops"]) == (200.0, 103.0)
    twice = {"name": "twice", "bandwidth_gbs": 200.0, "gflops": 200.0, **EFFICIENCY}
    from_here = hardware.carry_over(COST, GPT2, here, twice)[0]
    assert from_here == hardware.carry_over(COST, GPT2, HERE, twice)[0]
    assert from_here.decode_fixed_s == pytest.approx(COST.decode_fixed_s / 2, rel=1e-12)
    # from the peak the weight read would look as fast there as here
    from_peak = hardware.carry_over(COST, GPT2, {"name": "here", "bandwidth_gbs": 200.0, "gflops": 103.0}, twice)[0]
    assert from_peak.decode_fixed_s == pytest.approx(COST.decode_fixed_s, rel=1e-12)


def test_a_memory_bound_term_scales_with_bandwidth_alone():
    # from 200 GFLOP/s up the target does the attention's 0.5 FLOP per KV byte faster than it reads them
    for gflops in (200.0, 1000.0, 50000.0):
        model, terms = carried({"bandwidth_gbs": 400.0, "gflops": gflops, **EFFICIENCY})
        # the weights streamed once per call: no FLOPs at all
        assert terms[("decode_fixed_s", None)]["bound_target"] == "memory"
        assert model.decode_fixed_s == pytest.approx(COST.decode_fixed_s / 4, rel=1e-12)
        assert model.prefill_fixed_s == pytest.approx(COST.prefill_fixed_s / 4, rel=1e-12)
        # a cached token's keys and values are read for 0.5 FLOP per byte: memory-bound on both machines
        assert terms[("decode_per_ctx_token_s", None)]["bound_here"] == "memory"
        assert terms[("decode_per_ctx_token_s", None)]["bound_target"] == "memory"
        assert model.decode_per_ctx_token_s == pytest.approx(COST.decode_per_ctx_token_s / 4, rel=1e-12)


def test_a_compute_bound_term_scales_with_the_float32_rate_alone():
    for bandwidth in (100.0, 900.0, 3000.0):
        model, terms = carried({"bandwidth_gbs": bandwidth, "gflops": 800.0, **EFFICIENCY})
        assert terms[("prefill_per_token_s", None)]["bound_here"] == "compute"
        assert terms[("prefill_per_token_s", None)]["bound_target"] == "compute"
        assert model.prefill_per_token_s == pytest.approx(COST.prefill_per_token_s / 8, rel=1e-12)
        assert model.decode_per_seq_s == pytest.approx(COST.decode_per_seq_s / 8, rel=1e-12)
        assert model.prefill_per_token_sq_s == pytest.approx(COST.prefill_per_token_sq_s / 8, rel=1e-12)


def test_each_batch_of_the_decode_table_is_scaled_by_its_own_bound():
    # 1.5x the bandwidth, the same FLOP rate: batch 1, still bound by its weight read, gets 1.5x faster;
    # a large batch, bound by its products, not at all
    model, terms = carried({"bandwidth_gbs": 150.0, "gflops": 100.0, **EFFICIENCY})
    assert terms[("decode_batch_fixed_s", 1)]["bound_here"] == terms[("decode_batch_fixed_s", 1)]["bound_target"] == "memory"
    assert terms[("decode_batch_fixed_s", 32)]["bound_here"] == "compute"
    table = dict(model.decode_batch_fixed_s)
    assert table[1] == pytest.approx(7e-3 / 1.5, rel=1e-12)
    assert table[32] == pytest.approx(9e-2, rel=1e-12)
    # batch 4 is compute-bound here; more bandwidth only lowers its memory time, so it keeps its time
    assert terms[("decode_batch_fixed_s", 4)]["bound_target"] == "compute"
    assert table[4] == pytest.approx(1.3e-2, rel=1e-12)


def test_a_term_changing_bound_scales_by_the_ratio_of_the_two_roofline_times():
    # 20x the FLOP rate, the same bandwidth: batch 32 was compute-bound and becomes memory-bound, so it
    # gains less than the FLOP rate alone would say
    model, terms = carried({"bandwidth_gbs": 100.0, "gflops": 2000.0, **EFFICIENCY})
    term = terms[("decode_batch_fixed_s", 32)]
    work = roofline.batch_work(GPT2, 32)
    assert (term["bound_here"], term["bound_target"]) == ("compute", "memory")
    expected = (work.bytes / 100e9) / (work.flops / 100e9)
    assert 1 / 20 < expected < 1 and term["scale"] == pytest.approx(expected, rel=1e-12)
    assert dict(model.decode_batch_fixed_s)[32] == pytest.approx(9e-2 * expected, rel=1e-12)


TARGETS = [{"bandwidth_gbs": bw, "gflops": gf, **extra} for bw in (0.5, 100.0, 320.0, 3000.0)
           for gf in (1.0, 100.0, 8100.0) for extra in ({}, {"core_speedup": 0.05}, {"core_speedup": 50.0},
                                                      {"kind": "gpu"}, {"kind": "gpu", "launch_overhead_ms": 0.2})]


@pytest.mark.parametrize("cost", [COST, dataclasses.replace(COST, decode_per_seq_s=1e-5, prefill_per_token_s=1e-6,
                                                            decode_fixed_s=1e-5, decode_batch_fixed_s=((32, 1e-4),))])
def test_no_carried_term_beats_its_targets_floor(cost):
    """Whatever the target and even from a model faster than this machine's own floors, every carried
    term is at least the target's roofline time of its work (and a GPU call its launch overhead)."""
    for target in TARGETS:
        model, rows = hardware.carry_over(cost, GPT2, HERE, {"name": "target", **target})
        floors = roofline.term_floors(GPT2, target["bandwidth_gbs"], target["gflops"])
        for term in roofline.TERMS:
            assert getattr(model, term) >= floors[term][0]
        for batch, seconds in model.decode_batch_fixed_s:
            assert seconds >= roofline.floor(roofline.batch_work(GPT2, batch), target["bandwidth_gbs"], target["gflops"])[0]
        overhead = hardware.launch_overhead_s(target)
        assert model.decode_fixed_s >= overhead and model.prefill_fixed_s >= overhead
        assert all(seconds >= overhead for _, seconds in model.decode_batch_fixed_s)
        for row in rows:
            assert row["seconds_target"] == max(row["seconds_scaled"], row["floor_target_s"])
            assert row["floor_target_s"] >= row["roofline_target_s"]


def test_a_term_faster_than_the_floor_here_is_clamped_to_the_targets_floor_and_says_so():
    # 1 us per decoding sequence is 247 MFLOP at 247 TFLOP/s: no machine of 100 GFLOP/s does that
    cost = dataclasses.replace(COST, decode_per_seq_s=1e-6)
    model, rows = hardware.carry_over(cost, GPT2, HERE, {"name": "target", "bandwidth_gbs": 200.0, "gflops": 400.0})
    row = next(r for r in rows if r["term"] == "decode_per_seq_s")
    floor = roofline.term_work(GPT2)["decode_per_seq_s"].flops / 400e9
    assert row["efficiency_here"] > 1 and row["seconds_scaled"] < floor
    assert row["clamped"] and row["clamped_to"] == "roofline"
    assert model.decode_per_seq_s == row["seconds_target"] == pytest.approx(floor)
    assert model.meta["carry_over"]["clamped_terms"] == ["decode_per_seq_s"]
    # a model the fit held at this machine's floors carries to the target's floors, unclamped
    floors = {term: seconds for term, (seconds, _) in roofline.term_floors(GPT2, 100.0, 100.0).items()}
    at_floor = CostModel(**floors, ctx_mode="padded_max")
    model, rows = hardware.carry_over(at_floor, GPT2, HERE, {"name": "target", "bandwidth_gbs": 200.0, "gflops": 400.0})
    assert not any(row["clamped"] for row in rows)
    for term, (seconds, _) in roofline.term_floors(GPT2, 200.0, 400.0).items():
        assert getattr(model, term) == pytest.approx(seconds, rel=1e-12)


def test_a_gpu_target_floors_every_model_call_at_its_launch_overhead():
    t4 = {"name": "t4", "bandwidth_gbs": 320.0, "gflops": 8100.0, "kind": "gpu"}
    model, rows = hardware.carry_over(COST, GPT2, HERE, t4)
    default = hardware.DEFAULT_GPU_LAUNCH_OVERHEAD_MS / 1000
    # the weights' read alone (about 1.5 ms at 320 GB/s) is shorter than the host's launches
    assert roofline.term_floors(GPT2, 320.0, 8100.0)["decode_fixed_s"][0] < default
    assert model.decode_fixed_s == model.prefill_fixed_s == default
    by_term = {(r["term"], r["batch"]): r for r in rows}
    assert by_term[("decode_fixed_s", None)]["clamped_to"] == "launch overhead"
    assert by_term[("decode_per_seq_s", None)]["launch_overhead_s"] == 0.0
    assert all(seconds >= default for _, seconds in model.decode_batch_fixed_s)
    carried = model.meta["carry_over"]
    assert carried["target_kind"] == "gpu" and carried["launch_overhead_s"] == default
    assert carried["launch_overhead_basis"] == hardware.LAUNCH_OVERHEAD_BASIS and carried["leaves_out"]
    assert "decode_fixed_s" in carried["clamped_terms"]
    # a configured overhead replaces the default; a CPU target has none
    model, _ = hardware.carry_over(COST, GPT2, HERE, {**t4, "launch_overhead_ms": 0.0})
    assert model.decode_fixed_s < default and model.meta["carry_over"]["launch_overhead_basis"] is None
    model, _ = hardware.carry_over(COST, GPT2, HERE, {**t4, "launch_overhead_ms": 9.0})
    assert model.decode_fixed_s == 9e-3
    assert model.meta["carry_over"]["launch_overhead_basis"].startswith("as configured")
    model, _ = hardware.carry_over(COST, GPT2, HERE, {**t4, "kind": "cpu"})
    assert model.meta["carry_over"]["launch_overhead_s"] == 0.0 and model.decode_fixed_s < default


# -- the config ---------------------------------------------------------------------------------------

def default_config() -> dict:
    """config.yaml: it names two targets, a CPU and a GPU (the quick config keeps the GPU alone)."""
    return yaml.safe_load((ROOT / "config.yaml").read_text())


@pytest.mark.parametrize("change, message", [
    (lambda t: t[0].update(bandwidth_gbs=-5), "config error: hardware[0].bandwidth_gbs = -5: must be >= 0.1"),
    (lambda t: t[1].update(gflops=float("nan")), "config error: hardware[1].gflops = nan: must be a finite number"),
    (lambda t: t[1].update(gflops=1e12), "config error: hardware[1].gflops = 1000000000000.0: must be <= 10000000"),
    (lambda t: t[0].pop("gflops"), "config error: hardware[0].gflops is missing (required)"),
    (lambda t: t[0].update(name="../gpu"), "config error: hardware[0].name = '../gpu': must be 1 to 40 letters, "
                                           "digits, '.', '_' or '-', starting with a letter or digit"),
    (lambda t: t[1].update(name=t[0]["name"]), "config error: hardware[1].name = 'laptop-ryzen7-7840u': must differ "
                                               "from every other target's name"),
    (lambda t: t[1].update(name="here"), "config error: hardware[1].name = 'here': reserved for the machine the "
                                         "pipeline runs on; give the target another name"),
    (lambda t: t[0].update(description="a\nb"), "config error: hardware[0].description = 'a\\nb': must be one line "
                                                "without control characters (newline, tab, ...)"),
    (lambda t: t[0].update(price_per_hour="cheap"), "config error: hardware[0].price_per_hour = 'cheap': must be of "
                                                    "type number"),
    (lambda t: t[1].update(kind="tpu"), "config error: hardware[1].kind = 'tpu': allowed: cpu, gpu"),
    (lambda t: t[1].update(launch_overhead_ms=-1), "config error: hardware[1].launch_overhead_ms = -1: must be >= 0"),
    (lambda t: t[0].update(launch_overhead_ms=2.0), "config error: hardware[0].launch_overhead_ms = 2.0: applies to "
                                                    "kind gpu only (a CPU's host loop is in the terms measured here)"),
    (lambda t: t[1].update(core_speedup=2.0), "config error: hardware[1].core_speedup = 2.0: applies to kind cpu only "
                                              "(a GPU's host time per call is its launch_overhead_ms)"),
    (lambda t: t[0].update(core_speedup=0), "config error: hardware[0].core_speedup = 0: must be >= 0.01"),
    (lambda t: t[0].update(core_speedup=float("inf")), "config error: hardware[0].core_speedup = inf: must be a "
                                                       "finite number"),
    (lambda t: t[0].update(core_speedup="fast"), "config error: hardware[0].core_speedup = 'fast': must be of type "
                                                 "number"),
])
def test_a_bad_target_gets_one_clear_config_error(change, message):
    config = default_config()
    change(config["hardware"])
    with pytest.raises(ConfigError) as raised:
        check(config)
    assert str(raised.value) == message


def test_the_shipped_configs_name_their_targets():
    for path, targets in (("config.yaml", 2), ("config/quick.yaml", 1)):
        config = yaml.safe_load((ROOT / path).read_text())
        check(config)
        assert len(config["hardware"]) == targets


# -- the report ---------------------------------------------------------------------------------------

HOSTILE_DESCRIPTION = "<b>big</b> *GPU* | `x`"


@pytest.fixture(scope="module")
def hardware_report(tmp_path_factory):
    """A run rendered with two targets: one with this machine's own roofline (so its verdicts must be
    this machine's) and the config's GPU, with a hostile description and its own price. Two
    configurations instead of test_report's six keep it short."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(test_report, "POLICIES", ("static", "continuous_chunked"))
        patch.setattr(test_report, "CAPS", (8,))
        return render_with_targets(tmp_path_factory.mktemp("hardware"))


def plan_machine(cost: CostModel, machine: dict, config: dict, cells, seeds, label: dict, price=None,
                 target: dict | None = None) -> dict:
    """What the pipeline's per-machine rules compute for one machine, in process: its cells on `cost`
    (sweep_cell, capacity_cell, fleet_cell), collected, its memory table, and its recommendation; a
    `target`'s KV model is its entry's."""
    memory_cfg = ({**config["memory"], "kv_memory": target_kv_memory(target)["model"]} if target
                  else memory_for(config, label["machine"]))
    args = (config["workload"], config["slo"], config["sweep"], memory_cfg, seeds)
    latency = pd.concat([planner.sweep_cell(cost, machine, p, c, *args) for p, c in cells], ignore_index=True)
    capacity = pd.DataFrame([row for p, c in cells for row in
                             planner.capacity_rows(searches.capacity_cell(cost, machine, p, c, *args, config["capacity"]))])
    fleets = [searches.fleet_cell(cost, machine, p, c, *args, config["capacity"], config["cost"]) for p, c in cells]
    memory, _ = planner.memory_table(machine, latency, memory_cfg, config["workload"]["rate"])
    priced = {**config["cost"], **({"price_per_hour": price} if price is not None else {})}
    return planner.recommend(latency, capacity, memory, fleets, priced, config["slo"], config["workload"], seeds,
                             step_model=cost, machine=machine, label=label)


def plan_target(cost: CostModel, machine: dict, config: dict, target: dict, cells, seeds) -> tuple[dict, dict]:
    """A target as the pipeline plans it: the carried-over model (rule carry_over), then the same cells
    and recommendation as this machine's; (its recommendation, its carry_over.json)."""
    here = hardware.here_roofline(machine)
    roofline = {k: target[k] for k in ("name", "bandwidth_gbs", "gflops", "kind", "launch_overhead_ms", "core_speedup")
                if k in target}
    carried, terms = hardware.carry_over(cost, architecture.architecture(config["model"]), here, roofline)
    label = {"machine": target["name"], "display_name": target.get("description") or target["name"], "measured": False}
    return (plan_machine(carried, machine, config, cells, seeds, label, target.get("price_per_hour"), target),
            {"target": roofline, "here": here, "terms": terms})


GPU_LAUNCH_OVERHEAD_MS = 1.0


def render_with_targets(root: Path) -> dict:
    inputs, config = test_report.build_run(root / "inputs", "all_fail")
    machine, cost = read_json(inputs["machine"]), CostModel.from_dict(read_json(inputs["costmodel"]))
    here = hardware.here_roofline(machine)
    gpu = copy.deepcopy(config["hardware"][1])
    # four times this (synthetic) machine's peaks, and a launch overhead (GPU_LAUNCH_OVERHEAD_MS) above the
    # carried-over decode step's fixed cost but below a prefill call's: decode calls are raised to it, and
    # prefill is faster on every term
    assert gpu["kind"] == "gpu"
    gpu.update(description=HOSTILE_DESCRIPTION, price_per_hour=0.5, bandwidth_gbs=4 * here["bandwidth_gbs"],
               gflops=4 * here["gflops"], launch_overhead_ms=GPU_LAUNCH_OVERHEAD_MS)
    config["hardware"] = [{"name": "same-as-here", "bandwidth_gbs": here["bandwidth_gbs"], "gflops": here["gflops"]},
                          gpu]
    seeds = simulation_seeds(config)
    cells = [(p, c) for p in test_report.POLICIES for c in test_report.CAPS]
    planned = []
    for target in config["hardware"]:
        recommendation, carried = plan_target(cost, machine, config, target, cells, seeds)
        planned.append((target, carried, recommendation))
    verdicts = planner.hardware_verdicts(planned)["targets"]
    inputs["hardware"] = str(root / "inputs" / "hardware_verdicts.json")
    write_json(inputs["hardware"], {"targets": verdicts})
    out = root / "report"
    logs = root / "logs"
    logs.mkdir()
    write_report(inputs, config, "abc123def456", "0123456789", out / "report.html", out / "report.md",
                 out / "provenance.json", logs)
    return {"html": (out / "report.html").read_text(), "md": (out / "report.md").read_text(), "config": config,
            "verdicts": verdicts, "recommendation": read_json(inputs["recommendation"])}


def without_measured_memory(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in row.items() if k not in ("measured_bytes", "measured_cap", "measured_basis",
                                                              "memory_measured_bytes", "memory_measured_basis")}
            for row in rows]


def test_a_target_with_this_machines_roofline_gets_this_machines_verdicts(hardware_report):
    same = hardware_report["verdicts"][0]["recommendation"]
    here = hardware_report["recommendation"]
    # here the serving memory measured at the chosen policy and cap decides memory; a target, with no
    # measurement, is judged on the reservation, and both fit this budget
    chosen = here["chosen"]
    assert chosen["memory_measured_bytes"] is not None
    assert (chosen["memory_measured_bytes"] <= chosen["budget_bytes"]) == chosen["memory_met"]
    assert without_measured_memory(same["verdict"]) == without_measured_memory(here["verdict"])
    assert without_measured_memory([same["chosen"]]) == without_measured_memory([here["chosen"]])


def test_a_target_is_not_judged_on_the_memory_measured_here(hardware_report):
    here = hardware_report["recommendation"]
    assert here["chosen"]["memory_measured_bytes"] is not None
    for target in hardware_report["verdicts"]:
        rec = target["recommendation"]
        memory = next(row for row in rec["verdict"] if row["target"] == "memory")
        assert rec["serving_memory"] is None and memory["measured_bytes"] is None
        assert memory["passed"] == (memory["achieved"] <= memory["goal_bytes"])


def test_the_faster_target_serves_faster(hardware_report):
    here, target = hardware_report["recommendation"], hardware_report["verdicts"][1]
    gpu = target["recommendation"]
    # every term gains at least the smaller of the two resources' ratios
    least = min(target["bandwidth_gbs"] / target["here"]["bandwidth_gbs"], target["gflops"] / target["here"]["gflops"])
    assert least > 1
    assert gpu["prefill_floor"]["floor_ms"] <= here["prefill_floor"]["floor_ms"] / least * (1 + 1e-9)
    assert gpu["price_per_hour"] == 0.5


def md_section(md: str) -> str:
    return md.split("## Other machines: an estimate from the roofline\n", 1)[1].split("\n## ", 1)[0]


def test_html_and_markdown_give_each_targets_verdicts_as_a_roofline_estimate(hardware_report):
    html, md = hardware_report["html"], hardware_report["md"]
    assert re.findall(r"<h2>(.*?)</h2>", html).count("Other machines: an estimate from the roofline") == 1
    section = md_section(md)
    html_section = html.split('<section id="hardware">', 1)[1].split("</section>", 1)[0]
    for target in hardware_report["verdicts"]:
        expected = ["pass" if row["passed"] else "fail" for row in target["recommendation"]["verdict"]]
        name = target["name"]
        # the heading names the machine by its display name, never its config name
        shown = names.display(name, hardware_report["config"]["hardware"])
        heading = f"{escape(shown)}: an estimate from the roofline, not a measurement"
        assert f"### {blocks.md(shown)}: an estimate from the roofline, not a measurement" in section
        assert f'<h3 id="hardware-{name}">{heading}</h3>' in html_section
        md_part = section.split(f"### {blocks.md(shown)}: an estimate", 1)[1].split("### ", 1)[0]
        rows = [line for line in md_part.splitlines() if re.match(r"\| (Latency|Capacity|Memory|Cost) \|", line)]
        assert [row.rstrip(" |").rsplit("| ", 1)[1] for row in rows] == expected
        html_part = html_section.split(heading, 1)[1].split("<h3", 1)[0]
        assert re.findall(r'<td class="verdict (?:pass|fail)">(pass|fail)</td>', html_part) == expected
        # every term with its bound and scale factor
        assert md_part.count("× |") == len(target["terms"])
    assert "an estimate from the roofline, not a measurement" in section.split("###", 1)[0]


def test_free_text_of_a_target_is_escaped(hardware_report):
    html, md = hardware_report["html"], hardware_report["md"]
    assert "<b>big</b>" not in html and "&lt;b&gt;big&lt;/b&gt; *GPU* | `x`" in html
    assert r"&lt;b&gt;big&lt;/b&gt; \*GPU\* \| \`x\`" in md_section(md)


def test_the_section_leaks_no_undefined_value_or_code_name(hardware_report):
    section = md_section(hardware_report["md"])
    assert test_report.LEAKS.findall(test_report.visible_md_text(section)) == []
    for line in test_report.prose_lines(section):
        assert test_report.SNAKE_CASE.findall(line) == [], line[:200]
        assert re.findall(r"[A-Za-z0-9)%]\.[A-Z]|[a-z]{2}\(", line) == [], line[:200]


def test_a_target_too_slow_to_keep_up_is_planned_and_judged_through_its_json_file(tmp_path):
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    config["workload"]["num_requests"] = 20
    config["sweep"].update(seeds=1, rates=[6.0])
    config["cost"]["max_replicas"] = 2
    machine = test_report.machine_meta(COST)
    slow = {"name": "slow", "bandwidth_gbs": 0.1, "gflops": 0.1}
    recommendation, _ = plan_target(COST, machine, config, slow, [("continuous", 8)], [0])
    write_json(tmp_path / "slow.json", recommendation)
    rec = read_json(tmp_path / "slow.json")
    assert not rec["chosen"]["stable_today"] and rec["chosen"]["latency_ms"] is None
    assert rec["missed"] == ["latency", "capacity", "cost"] and rec["price_per_hour"] == config["cost"]["price_per_hour"]
    assert "NaN" not in (tmp_path / "slow.json").read_text()
    [option] = rec["options"]
    assert option["verdicts"]["latency"]["value"] is None and option["misses"] == ["latency", "capacity", "cost"]


def test_hardware_verdicts_state_each_targets_launch_overhead_clamps_and_omissions():
    """From the rows carry_over.json holds: the kind, the launch overhead with its basis, the terms raised
    to the target's floor (the decode table's batches together) and what the estimate leaves out."""
    t4 = {"name": "nvidia-t4", "bandwidth_gbs": 320.0, "gflops": 8100.0, "kind": "gpu"}
    laptop = {"name": "laptop", "bandwidth_gbs": 120.0, "gflops": 845.0}
    planned = []
    for target in (t4, laptop):
        _, rows = hardware.carry_over(COST, GPT2, HERE, target)
        planned.append((target, {"target": target, "here": HERE, "terms": rows}, {"price_per_hour": 1.0}))
    gpu, cpu = (entry["carry_over"] for entry in planner.hardware_verdicts(planned)["targets"])
    default = hardware.DEFAULT_GPU_LAUNCH_OVERHEAD_MS / 1000
    assert gpu["target_kind"] == "gpu" and gpu["launch_overhead_s"] == default
    assert gpu["launch_overhead_basis"] == hardware.LAUNCH_OVERHEAD_BASIS and not gpu["launch_overhead_configured"]
    assert gpu["leaves_out"] == list(hardware.CARRY_OVER_LEAVES_OUT["gpu"])
    assert gpu["rule"] == "efficiency" and gpu["core_speedup"] is None
    clamped = {entry["term"]: entry for entry in gpu["clamped"]}
    assert clamped["decode_fixed_s"] == {"term": "decode_fixed_s", "clamped_to": "launch overhead", "batches": [],
                                         "floor_s": [default, default]}
    assert clamped["decode_batch_fixed_s"]["batches"] == [b for b, _ in COST.decode_batch_fixed_s
                                                          if b in clamped["decode_batch_fixed_s"]["batches"]]
    assert clamped["decode_batch_fixed_s"]["batches"]
    assert cpu["target_kind"] == "cpu" and cpu["launch_overhead_s"] == 0.0 and cpu["launch_overhead_basis"] is None
    assert cpu["rule"] == "roofline share" and cpu["core_speedup"] == 1.0 and not cpu["core_speedup_configured"]
    assert cpu["leaves_out"] == list(hardware.CARRY_OVER_LEAVES_OUT["cpu"])


def test_a_gpu_targets_launch_overhead_clamps_and_omissions_appear_in_its_section(hardware_report):
    section = " ".join(md_section(hardware_report["md"]).split())
    gpu, cpu = hardware_report["verdicts"][1], hardware_report["verdicts"][0]
    gpu_name = blocks.md(names.display(gpu["name"], hardware_report["config"]["hardware"]))
    gpu_part = section.split(f"### {gpu_name}: an estimate", 1)[1]
    cpu_part = section.split("### ", 2)[1]
    assert (f"Assumed: as a GPU, every model call (a decode step or a prefill call) takes at least "
            f"{GPU_LAUNCH_OVERHEAD_MS:g} ms of host time launching its kernels, which no roofline sees; that value is as "
            f"configured for this target.") in gpu_part
    assert "Assumed: as a CPU, it pays no launch overhead of its own" in cpu_part
    clamped = gpu["carry_over"]["clamped"]
    assert any(entry["clamped_to"] == "launch overhead" for entry in clamped)
    assert all(entry["term"] != "prefill_fixed_s" for entry in clamped)
    assert f"Carried over, {len(clamped)} term" in gpu_part
    assert ", to the launch overhead of 1 ms" in gpu_part
    assert "yes, to the launch overhead |" in hardware_report["md"]
    assert "No carried-over term falls below the target's own floor" in cpu_part
    for part, kind in ((gpu_part, "gpu"), (cpu_part, "cpu")):
        assert "The estimate leaves out:" in part
        for omitted in hardware.CARRY_OVER_LEAVES_OUT[kind]:
            assert f"- {omitted}" in part
