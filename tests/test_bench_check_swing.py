"""benchmarks/bench_check_swing.py: bad input is one line and status 2 before anything is measured, and a
run over 1-thread profiles measured before reports each and the calls' ranges (the quick config's tiny
model: seconds, not a measurement)."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_check_swing.py"
QUICK = ROOT / "config" / "quick.yaml"


def run(*flags, timeout=120):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, flags)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@pytest.fixture(scope="module")
def profiles(tmp_path_factory):
    """A 2-thread quick profile and two 1-thread check profiles of the tiny model."""
    import yaml

    from servingplan.profile.grid import check_profile
    from servingplan.profile.measure import run_profile
    config = yaml.safe_load(QUICK.read_text())
    made = {}
    for name, settings in (("two", config["profile"]), ("one.1", check_profile(config["profile"])),
                           ("one.2", check_profile(config["profile"]))):
        out = tmp_path_factory.mktemp(name)
        profile = run_profile(settings, config["model"], config["seed"], threads=2 if name == "two" else None,
                              progress=False)
        profile.write(out / "profile.csv", out / "samples.csv", out / "machine.json")
        made[name] = out
    return made


@pytest.mark.parametrize("flags, named", [
    ([], "--runs"), (["--runs", "0"], "--runs"), (["--runs", "21"], "--runs"),
    (["--runs", "1", "--one-thread", "."], "--runs"),
    (["--one-thread", "/nonexistent"], "--one-thread"),
    (["--runs", "1", "--config", "/nonexistent"], "--config"),
    (["--runs", "1", "--out", "/dev/null"], "--out"),
])
def test_bad_input_is_one_line_and_status_2(tmp_path, flags, named):
    profile = tmp_path / "two"
    profile.mkdir()
    for name in ("profile.csv", "samples.csv", "machine.json"):
        (profile / name).write_text("")
    done = run("--profile", profile, *flags)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[-1] and "Traceback" not in done.stderr


def test_a_profile_missing_its_files_is_refused(tmp_path):
    done = run("--profile", tmp_path, "--runs", "1")
    assert done.returncode == 2 and "--profile" in done.stderr and "samples.csv" in done.stderr


def test_a_profile_the_fit_cannot_read_is_one_line(tmp_path):
    for name in ("profile.csv", "samples.csv", "machine.json"):
        (tmp_path / name).write_text("")
    done = run("--profile", tmp_path, "--one-thread", tmp_path, "--config", QUICK)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and str(tmp_path) in lines[0] and "not a profile the fit reads" in lines[0]


def test_reports_each_run_and_each_call_range(profiles):
    done = run("--profile", profiles["two"], "--one-thread", profiles["one.1"], profiles["one.2"],
               "--config", QUICK, timeout=300)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.count("held-out fit") == 3 and out.count("rounds' spread") == 2
    assert "cells within the goal over 2 runs" in out
    for call in ("decode      1", "prefill    64"):
        assert call in out
