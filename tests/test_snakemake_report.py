"""`snakemake --report` refuses a config other than the run's (issue 21): one line, a non-zero exit,
never "Report created." for outputs filed under the wrong settings."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from servingplan.run_record import creates_report_only, report_refusal

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("argv, only", [
    (["snakemake", "--report", "r.html"], True), (["snakemake", "--report=r.html"], True),
    (["snakemake", "--report", "r.html", "--report-after-run"], False), (["snakemake", "--cores", "2"], False),
    (["snakemake", "--report-stylesheet", "s.css"], False),
])
def test_only_a_report_of_an_earlier_run_is_checked(argv, only):
    assert creates_report_only(argv) is only


def test_the_refusal_names_the_file_and_both_hashes(tmp_path):
    record = tmp_path / "provenance.json"
    assert "not found" in report_refusal("abc", record)
    record.write_text("{")
    assert "unreadable" in report_refusal("abc", record)
    record.write_text(json.dumps({"config_hash": "def"}))
    refusal = report_refusal("abc", record)
    assert "hash abc" in refusal and "hash def" in refusal and str(record) in refusal and "--configfile" in refusal
    record.write_text(json.dumps({"config_hash": "abc"}))
    assert report_refusal("abc", record) is None


def report(workdir: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--report", "r.html"],
                          cwd=workdir, capture_output=True, text=True, timeout=300)


def test_snakemake_report_refuses_another_config_than_the_runs_in_one_line(tmp_path):
    (tmp_path / "results/report").mkdir(parents=True)
    record = tmp_path / "results/report/provenance.json"
    record.write_text(json.dumps({"config_hash": "000000000000"}))
    refused = report(tmp_path)
    assert refused.returncode == 2 and "Report created" not in refused.stdout + refused.stderr
    # snakemake's own notice of the workflow profile it read, then the refusal
    [line] = [text for text in refused.stderr.splitlines() if not text.startswith("Using workflow specific profile")]
    assert "hash 000000000000" in line and "give the run's --configfile" in line
    # the run's own config passes the check (snakemake then looks for the run's files, which are not here)
    record.write_text(json.dumps({"config_hash": re.search(r"config given \(hash (\w+)\)", line)[1]}))
    matching = report(tmp_path)
    assert "snakemake --report:" not in matching.stderr
