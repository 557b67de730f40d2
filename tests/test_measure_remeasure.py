"""Re-measurement on synthetic readings: a disturbed stretch of the speed trace costs the measurements
next to it, a quiet run re-measures nothing, points whose rounds disagree get extra rounds, and the
budget bounds the extra work whatever the readings say."""
import numpy as np
import pandas as pd
import pytest

from servingplan.fit.step_model import per_round_medians
from servingplan.profile.measure import (
    MAX_EXTRA_ROUNDS_PER_POINT, MIN_NOISE_FLOOR, NOISE_FLOOR_SIGMAS, mark_disturbed, measurement_brackets,
    noise_floors, normalise, plan_remeasure, remeasure_until_settled, speed_summary,
)

READING_EVERY_S = 10.0
CALL_S = {"decode": 0.1, "prefill": 0.3}


def slowdown_at(t_s: float, disturbed: tuple[float, float] | None, factor: float = 2.5) -> float:
    return factor if disturbed and disturbed[0] <= t_s < disturbed[1] else 1.0


def reading_rows(times, disturbed=None, seed=0, first_reading=0) -> list[dict]:
    """Both references at each time, with 3% quiet scatter, `factor` slower inside `disturbed`."""
    rng = np.random.default_rng(seed)
    return [{"t_s": t + offset, "kind": kind, "seconds": CALL_S[kind] * slowdown_at(t, disturbed)
             * float(np.exp(rng.normal(0, 0.03))), "reading": first_reading + i}
            for i, t in enumerate(times) for offset, kind in ((0.0, "decode"), (0.2, "prefill"))]


def sample_rows(n_points: int, n_rounds: int, disturbed=None, start_s=1.0, step_s=2.0, seed=1) -> list[dict]:
    """Each point measured in each round (three calls), one point every `step_s` seconds, round after
    round; calls inside `disturbed` take 2.5 times as long."""
    rng = np.random.default_rng(seed)
    rows, t = [], start_s
    for round_number in range(n_rounds):
        for point_id in rng.permutation(n_points):
            kind = "decode" if point_id % 2 else "prefill"
            base = 0.01 * (1 + point_id)
            rows += [{"point_id": int(point_id), "kind": kind, "round": round_number, "repeat": repeat,
                      "t_s": t + 0.1 * repeat, "seconds": base * slowdown_at(t, disturbed)
                      * float(np.exp(rng.normal(0, 0.01))), "superseded": False, "remeasure_pass": 0}
                     for repeat in range(3)]
            t += step_s
    return rows


def trace_over(rows: list[dict], disturbed=None) -> pd.DataFrame:
    end = max(r["t_s"] for r in rows) + 1.0
    return pd.DataFrame(reading_rows(np.arange(0.0, end + READING_EVERY_S, READING_EVERY_S), disturbed))


def test_a_quiet_run_remeasures_nothing():
    rows = sample_rows(20, 4)
    plan = plan_remeasure(pd.DataFrame(rows), trace_over(rows), 4, budget=40)
    assert plan.tasks == [] and plan.disturbed_left == [] and plan.unsettled_left == []
    assert not mark_disturbed(trace_over(rows))["disturbed"].any()


def test_the_noise_floor_is_the_references_own_quiet_spread_and_a_disturbance_does_not_move_it():
    quiet = trace_over(sample_rows(20, 4))
    floors = noise_floors(quiet)
    for kind, rows in quiet.groupby("kind"):
        logs = np.log(rows["seconds"])
        expected = NOISE_FLOOR_SIGMAS * 1.4826 * np.median(np.abs(logs - np.median(logs)))
        assert floors[kind] == pytest.approx(max(MIN_NOISE_FLOOR, expected))
    rows = sample_rows(20, 4, disturbed=(60.0, 100.0))
    assert noise_floors(trace_over(rows, (60.0, 100.0)))["decode"] < np.log(2.5) / 3
    # two readings that agree exactly still leave the minimum floor
    same = pd.DataFrame({"t_s": [0.0, 1.0], "kind": "decode", "seconds": 0.1, "reading": [0, 1]})
    assert noise_floors(same) == {"decode": MIN_NOISE_FLOOR}


def test_a_disturbed_stretch_is_detected_and_only_the_measurements_next_to_it_are_remeasured():
    disturbed = (61.0, 103.0)  # between readings at 60 and 110: readings 70 .. 100 are disturbed
    rows = sample_rows(20, 4, disturbed=disturbed)
    trace = mark_disturbed(trace_over(rows, disturbed))
    assert sorted(trace.loc[trace["disturbed"], "reading"].unique()) == [7, 8, 9, 10]
    plan = plan_remeasure(pd.DataFrame(rows), trace_over(rows, disturbed), 4, budget=80)
    spans = pd.DataFrame(rows).groupby(["point_id", "round"])["t_s"].agg(["min", "max"])
    # exactly the measurements after the last quiet reading (60 s) and before the next (110 s)
    expected = {key for key, span in spans.iterrows() if span["max"] > 60.2 and span["min"] < 110.0}
    assert set(plan.replace) == expected and len(expected) > 0
    assert all(spans.loc[key, "min"] > 60.0 for key in plan.replace)
    assert plan.extra == [] and plan.disturbed_left == []
    # in time order: the first re-measured is the first disturbed
    starts = [spans.loc[key, "min"] for key in plan.replace]
    assert starts == sorted(starts)


def test_a_remeasured_stretch_on_a_quiet_machine_settles_and_the_kept_values_are_quiet():
    disturbed = (61.0, 103.0)
    rows = sample_rows(20, 4, disturbed=disturbed)
    readings = reading_rows(np.arange(0.0, max(r["t_s"] for r in rows) + 11.0, READING_EVERY_S), disturbed)
    clock = [max(r["t_s"] for r in rows) + 12.0]

    def measure_pass(tasks, remeasure_pass):
        for point_id, round_number in tasks:  # the machine is quiet again
            kind = "decode" if point_id % 2 else "prefill"
            rows.extend({"point_id": point_id, "kind": kind, "round": round_number, "repeat": repeat,
                         "t_s": clock[0] + 0.1 * repeat, "seconds": 0.01 * (1 + point_id), "superseded": False,
                         "remeasure_pass": remeasure_pass} for repeat in range(3))
            clock[0] += 2.0

    def record():
        readings.extend(reading_rows([clock[0]], seed=len(readings), first_reading=readings[-1]["reading"] + 1))
        clock[0] += 1.0

    plan, passes = remeasure_until_settled(rows, lambda: pd.DataFrame(readings), record, 4, 40, measure_pass,
                                           list, lambda: clock[0])
    assert len(passes) == 1 and passes[0]["extra_rounds"] == []
    assert plan.tasks == [] and plan.disturbed_left == []
    samples = normalise(pd.DataFrame(rows), mark_disturbed(pd.DataFrame(readings)))
    kept = samples[~samples["superseded"]]
    assert len(kept) == 20 * 4 * 3  # every (point, round) once, three calls each
    superseded = {tuple(task) for task in passes[0]["remeasured"]}
    assert set(map(tuple, samples.loc[samples["superseded"], ["point_id", "round"]].drop_duplicates().to_numpy())) \
        == superseded
    # no kept value carries the 2.5x slowdown any more
    values = kept.groupby(["point_id", "round"])["normalized_s"].median()
    quiet = 0.01 * (1 + values.index.get_level_values("point_id").to_numpy())
    assert (values.to_numpy() / quiet).max() < 1.2


def test_the_budget_bounds_the_remeasuring_even_if_the_machine_never_settles():
    rows = sample_rows(10, 2)
    # one disturbed reading among twenty quiet ones, and every reading after it disturbed too: whatever
    # is re-measured is next to a disturbed reading again
    readings = [dict(r, seconds=r["seconds"] * (3.0 if r["reading"] == 2 else 1.0))
                for r in reading_rows(np.arange(0.0, 210.0, READING_EVERY_S))]
    clock = [210.0]
    measured = []

    def measure_pass(tasks, remeasure_pass):
        measured.extend(tasks)
        for point_id, round_number in tasks:
            rows.extend({"point_id": point_id, "kind": "decode", "round": round_number, "repeat": repeat,
                         "t_s": clock[0] + 0.1 * repeat, "seconds": 0.01 * (1 + point_id), "superseded": False,
                         "remeasure_pass": remeasure_pass} for repeat in range(3))
            clock[0] += 2.0

    def record():
        reading = readings[-1]["reading"] + 1
        readings.extend(dict(r, seconds=r["seconds"] * 3.0)
                        for r in reading_rows([clock[0]], seed=reading, first_reading=reading))
        clock[0] += 1.0

    budget = 15
    plan, passes = remeasure_until_settled(rows, lambda: pd.DataFrame(readings), record, 2, budget, measure_pass,
                                           list, lambda: clock[0])
    assert 0 < len(measured) <= budget
    assert sum(len(p["remeasured"]) + len(p["extra_rounds"]) for p in passes) == len(measured)
    assert plan.tasks == [] and (plan.disturbed_left or plan.unsettled_left)
    assert plan_remeasure(pd.DataFrame(rows), pd.DataFrame(readings), 2, budget=0).tasks == []


def test_extra_rounds_go_only_to_points_whose_rounds_disagree_and_stop_once_they_agree():
    rows = sample_rows(6, 4)
    outlier = [r for r in rows if r["point_id"] == 3 and r["round"] == 2]
    for r in outlier:
        r["seconds"] *= 2.0  # between two quiet readings: only the point's own rounds can tell
    plan = plan_remeasure(pd.DataFrame(rows), trace_over(rows), 4, budget=50)
    assert plan.replace == [] and plan.extra == [(3, 4)]
    t = max(r["t_s"] for r in rows) + 1.0
    rows += [dict(outlier[0], round=4, repeat=repeat, t_s=t + 0.1 * repeat, seconds=outlier[0]["seconds"] / 2.0)
             for repeat in range(3)]
    assert plan_remeasure(pd.DataFrame(rows), trace_over(rows), 4, budget=50).tasks == []


def test_a_point_that_never_agrees_gets_at_most_its_extra_rounds():
    rows = sample_rows(4, 4)
    t = max(r["t_s"] for r in rows) + 1.0
    for extra in range(MAX_EXTRA_ROUNDS_PER_POINT + 1):
        scattered = [r for r in rows if r["point_id"] == 1]
        for r in scattered:
            r["seconds"] = 0.02 * (3.0 ** (r["round"] % 3))  # rounds at 1x, 3x and 9x: never four agree
        plan = plan_remeasure(pd.DataFrame(rows), trace_over(rows), 4, budget=50)
        if extra < MAX_EXTRA_ROUNDS_PER_POINT:
            assert plan.extra == [(1, 4 + extra)]
            rows += [dict(scattered[0], round=4 + extra, repeat=repeat, t_s=t + 0.1 * repeat) for repeat in range(3)]
            t += 1.0
        else:
            assert plan.extra == [] and plan.unsettled_left == []


def test_the_speed_band_leaves_out_readings_next_to_no_kept_measurement():
    trace = pd.DataFrame({"t_s": [0.0, 10.0, 20.0, 30.0], "kind": "decode", "seconds": [1.0, 1.1, 3.0, 1.0],
                          "reading": [0, 1, 2, 3]})
    marked = mark_disturbed(trace)
    assert marked["disturbed"].tolist() == [False, False, True, False]
    summary = speed_summary(marked.assign(in_band=~marked["disturbed"]))
    assert summary["by_kind"]["decode"]["relative_max"] == pytest.approx(1.1)
    assert summary["n_readings_out_of_band"] == 1
    assert summary["all_readings_moved_pct"] == pytest.approx(100 * 2.0 / 1.05)


def test_brackets_name_the_readings_around_each_measurement():
    trace = mark_disturbed(pd.DataFrame({"t_s": [0.0, 10.0, 20.0], "kind": "decode", "seconds": [1.0, 5.0, 1.0],
                                         "reading": [0, 1, 2]}))
    samples = pd.DataFrame({"point_id": [0, 0, 1, 2], "round": [0, 0, 0, 0], "kind": "decode",
                            "t_s": [2.0, 3.0, 12.0, 25.0]})
    brackets = measurement_brackets(samples, trace).set_index("point_id")
    assert brackets[["before", "after"]].to_numpy().tolist() == [[0, 1], [1, 2], [2, -1]]
    assert brackets["disturbed"].tolist() == [True, True, False]


def test_the_fit_reads_ragged_rounds_and_leaves_superseded_calls_out():
    points = pd.DataFrame({"point_id": [0, 1], "kind": "decode", "batch": [1, 2], "prompt_len": 1, "cached": 64})
    samples = pd.DataFrame({"point_id": [0, 0, 0, 1, 1, 0], "round": [0, 1, 2, 0, 1, 1],
                            "normalized_s": [1.0, 1.0, 1.0, 2.0, 2.0, 9.0],
                            "superseded": [False, False, False, False, False, True]})
    rounds = per_round_medians(points, samples)
    assert rounds.loc[0].tolist() == [1.0, 1.0, 1.0]
    assert rounds.loc[1, 0] == 2.0 and np.isnan(rounds.loc[1, 2])
