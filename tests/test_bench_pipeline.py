"""benchmarks/bench_pipeline.py groups a run's benchmark files into stages and sums them."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import bench_pipeline  # noqa: E402

HEADER = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"


def write(path: Path, wall: float, cpu: float, rss: float = 100.0) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(HEADER + f"{wall}\t0:00:01\t{rss}\t1\t1\t1\t0\t0\t50\t{cpu}\n")


def test_stages_sum_their_jobs_and_the_measuring_stages_stand_apart(tmp_path, capsys):
    bench = tmp_path / "benchmarks"
    write(bench / "profile_abc123.tsv", 300.0, 550.0, rss=4000.0)
    write(bench / "validate_replay.tsv", 200.0, 390.0)
    write(bench / "profile_one_thread.tsv", 150.0, 149.0)  # the carry-over check's profile: its own stage
    write(bench / "carry_over_check.tsv", 30.0, 29.0)
    write(bench / "llamacpp_profile.tsv", 600.0, 50.0)          # engine: llamacpp measures too
    write(bench / "llamacpp_server_terms.tsv", 40.0, 75.0)
    write(bench / "llamacpp_validate_replay.tsv", 300.0, 390.0)
    write(bench / "llamacpp_validate.tsv", 5.0, 4.0)            # its comparison is simulation
    write(bench / "serving_memory" / "static_cap1.tsv", 30.0, 33.0)
    write(bench / "sweep" / "static_cap1.tsv", 10.0, 9.5)
    write(bench / "sweep" / "static_cap2.tsv", 12.0, 11.5, rss=300.0)
    write(bench / "machines" / "t4" / "capacity" / "static_cap1.tsv", 4.0, 3.0)
    table = {row["stage"]: row for row in bench_pipeline.stage_table(tmp_path)}
    assert set(table) == {"profile", "validate_replay", "serving_memory", "sweep", "machines/t4/capacity",
                          "profile_one_thread", "carry_over_check", "llamacpp_profile", "llamacpp_server_terms",
                          "llamacpp_validate_replay", "llamacpp_validate"}
    assert table["profile"]["jobs"] == 1 and table["profile_one_thread"]["measuring"]
    assert not table["carry_over_check"]["measuring"]
    assert table["sweep"]["jobs"] == 2 and table["sweep"]["wall_s"] == 22.0 and table["sweep"]["cpu_s"] == 21.0
    assert table["sweep"]["max_rss_mb"] == 300.0
    assert table["profile"]["measuring"] and table["validate_replay"]["measuring"] and not table["sweep"]["measuring"]
    assert table["serving_memory"]["measuring"]
    assert table["llamacpp_profile"]["measuring"] and table["llamacpp_validate_replay"]["measuring"]
    assert table["llamacpp_server_terms"]["measuring"]
    assert not table["llamacpp_validate"]["measuring"]
    assert bench_pipeline.main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "simulation and rendering, all" in out and "57.0" in out  # 9.5 + 11.5 + 3.0 + 29.0 + 4.0 CPU s


def test_a_run_without_benchmarks_is_one_line_and_exit_2(tmp_path, capsys):
    assert bench_pipeline.main([str(tmp_path)]) == 2
    assert "run the pipeline first" in capsys.readouterr().err


def test_the_critical_path_orders_the_alone_measurements_and_counts_what_ran_beside(tmp_path, capsys):
    import os
    import json
    bench = tmp_path / "benchmarks"
    # (file, start, wall, cpu): the profile then the replay in series, a sweep cell beside the replay,
    # the serving memory (not alone) beside the replay too, the report after the last measurement
    jobs = [("profile_abc123.tsv", 0.0, 100.0, 180.0), ("validate_replay.tsv", 110.0, 50.0, 90.0),
            ("sweep/static_cap1.tsv", 120.0, 20.0, 20.0), ("serving_memory.tsv", 130.0, 40.0, 30.0),
            ("report.tsv", 170.0, 10.0, 10.0)]
    for name, start, wall, cpu in jobs:
        write(bench / name, wall, cpu)
        os.utime(bench / name, (1000.0 + start + wall, 1000.0 + start + wall))
    path = bench_pipeline.critical_path(bench_pipeline.job_intervals(tmp_path))
    assert path["span_s"] == 180.0 and path["alone_wall_s"] == 150.0 and path["alone_overlapping_pairs"] == 0
    assert [job["stage"] for job in path["alone"]] == ["profile", "validate_replay"]
    replay = path["alone"][1]["beside"]
    assert replay["jobs"] == 2 and replay["stages"] == ["serving_memory", "sweep"]
    assert replay["cpu_s"] == 20.0 + 30.0 * 30.0 / 40.0   # the sweep cell whole, 30 of the probe's 40 s
    assert path["after_last"]["wall_s"] == 20.0 and path["after_last"]["beside"]["stages"] == ["report", "serving_memory"]
    assert bench_pipeline.main([str(tmp_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["critical_path"]["alone_wall_s"] == 150.0
