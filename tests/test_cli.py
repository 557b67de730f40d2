"""The Exercise-2 command line, run as a user runs it: a subprocess on scripts/serving_sim.py."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from servingplan.cli.main import main

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "serving_sim.py"
SOURCE_COMMAND = ["--policies", "continuous_chunked", "--rate", "20", "--slo-ttft-ms", "2000",
                  "--slo-tpot-ms", "12", "--sweep-batch", "4,8,16,24,32,48,64,128"]


def run(*args, cwd=None):
    # from another directory, to show the script needs no installed package
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          cwd=cwd or REPO.parent, timeout=300)


def test_the_source_command_prints_a_table_row_per_cap():
    proc = run(*SOURCE_COMMAND)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split()[:5] == ["policy", "cap", "rate", "seeds", "stable"]
    rows = [line.split() for line in lines[2:] if line.startswith("continuous_chunked")]
    assert [int(r[1]) for r in rows] == [4, 8, 16, 24, 32, 48, 64, 128]
    assert "TTFT p95 <= 2000 ms, TPOT p95 <= 12 ms" in proc.stdout
    assert proc.stderr == ""


def test_json_rows_parse_and_carry_the_promised_keys(capsys):
    assert main(["--policies", "static,continuous", "--policies", "continuous_chunked", "--sweep-batch", "8,64",
                 "--num-requests", "150", "--seeds", "2", "--slo-ttft-ms", "2000", "--slo-tpot-ms", "20",
                 "--slo-itl-ms", "60", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["policy"], r["max_num_seqs"]) for r in rows] == [
        (p, c) for p in ("static", "continuous", "continuous_chunked") for c in (8, 64)]
    for row in rows:
        assert row["rate"] == 20.0 and row["seeds"] == 2
        for key in ("stable", "goodput_rps", "attainment", "throughput_tok_s", "preemptions",
                    *(f"{m}_p{q}" for m in ("ttft_ms", "tpot_ms", "itl_ms") for q in (50, 90, 95, 99))):
            assert key in row
        if row["stable"]:
            assert 0.0 <= row["attainment"] <= 1.0
        else:   # a queue that grows has no steady state: no percentile, goodput or attainment
            assert row["attainment"] is None and row["goodput_rps"] is None and row["ttft_ms_p99"] is None
    assert {row["stable"] for row in rows} == {True, False}


def test_rates_sweep_and_explicit_seeds(capsys):
    assert main(["--sweep-rate", "5,10", "--seeds", "3,11", "--num-requests", "100", "--max-num-seqs", "32",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["rate"], r["seeds"], r["max_num_seqs"]) for r in rows] == [(5.0, 2, 32), (10.0, 2, 32)]
    # with no SLO every finished request is good
    assert all(r["attainment"] == 1.0 for r in rows)


def test_a_trace_csv_and_a_cost_model_json_are_accepted(tmp_path, capsys):
    from servingplan.costmodel import EXERCISE2
    from servingplan.simulate import workload
    trace_csv, cost_json = tmp_path / "trace.csv", tmp_path / "cost.json"
    workload.generate({**workload.EXERCISE2, "num_requests": 80}, 0).to_frame().to_csv(trace_csv, index=False)
    EXERCISE2.scaled(2.0).save(cost_json)
    assert main(["--workload", str(trace_csv), "--cost-model", str(cost_json), "--rate", "10", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 1 and rows[0]["seeds"] == 1 and rows[0]["rate"] == 10.0


def test_print_curve_shows_the_decode_table():
    proc = run("--print-curve")
    assert proc.returncode == 0, proc.stderr
    rows = {int(line.split()[0]): line.split()[1:] for line in proc.stdout.splitlines()[2:]}
    assert list(rows) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]
    assert rows[1] == ["5.09", "197"] and rows[128] == ["16.01", "7996"]


@pytest.mark.parametrize("args, names", [
    (["--policies", "fifo"], ["--policies", "fifo", "continuous_chunked"]),
    (["--policies", "static,fifo"], ["--policies", "fifo"]),
    (["--rate", "-3"], ["--rate", "-3", "> 0"]),
    (["--rate", "0"], ["--rate", "'0'", "> 0"]),
    (["--sweep-rate", "1,,2"], ["--sweep-rate", "1,,2"]),
    (["--sweep-batch", "4,eight"], ["--sweep-batch", "eight", "integer"]),
    (["--sweep-batch", "0,4"], ["--sweep-batch", "'0'", ">= 1"]),
    (["--max-num-seqs", "0"], ["--max-num-seqs", "'0'", ">= 1"]),
    (["--workload", "no_such_trace.csv"], ["--workload", "no_such_trace.csv", "preset"]),
    (["--cost-model", "no_such_model.json"], ["--cost-model", "no_such_model.json", "preset"]),
    (["--slo-tpot-pct", "101"], ["--slo-tpot-pct", "101", "[0, 100]"]),
])
def test_bad_input_gives_one_line_and_exit_code_2(args, names):
    proc = run(*args)
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1, proc.stderr
    assert "Traceback" not in proc.stderr
    for name in names:
        assert name in proc.stderr


@pytest.mark.parametrize("content, option", [
    ("time,prompt\n1,2\n", "--workload"),
    ('{"schema_version": 1, "decode": {}}', "--cost-model"),
    ("not json at all", "--cost-model"),
])
def test_unreadable_files_give_one_line_and_exit_code_2(tmp_path, capsys, content, option):
    path = tmp_path / ("bad.csv" if option == "--workload" else "bad.json")
    path.write_text(content)
    assert main([option, str(path), "--num-requests", "10"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and option in err and str(path) in err
