"""A stage dies with the snakemake that started it (issue 21): after kill -9 of snakemake, no stage
process runs on as an orphan, whether it is snakemake's own child or started through a shell."""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent
# a stage that would run for ten minutes
STAGE = ("import os, sys, time; from servingplan.pipeline import die_with_snakemake; die_with_snakemake(0.1); "
         "open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(600)")


def fake_snakemake(tmp_path: Path, through_shell: bool) -> Path:
    """A program named snakemake that starts the stage (directly, or through bash as snakemake's
    script jobs are) and waits."""
    stage = [sys.executable, "-c", STAGE, str(tmp_path / "stage.pid")]
    command = ["bash", "-c", shlex.join(stage) + "; true"] if through_shell else stage
    program = tmp_path / "snakemake"
    program.write_text(f"import subprocess\nsubprocess.run({command!r})\n")
    return program


def wait_for(predicate, limit_s: float = 60.0) -> bool:
    """Poll until `predicate` holds; the limit only stops a broken run (the test asserts no timing)."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("through_shell", [False, True], ids=["child", "through a shell"])
def test_a_stage_dies_when_snakemake_is_killed(tmp_path, through_shell):
    program = fake_snakemake(tmp_path, through_shell)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    snakemake = subprocess.Popen([sys.executable, str(program)], cwd=ROOT, env=env)
    pid_file = tmp_path / "stage.pid"
    try:
        assert wait_for(lambda: pid_file.exists() and pid_file.read_text().strip())
        stage = int(pid_file.read_text())
        assert not gone(stage)
        snakemake.send_signal(signal.SIGKILL)
        snakemake.wait()
        assert wait_for(lambda: gone(stage))
    finally:
        if snakemake.poll() is None:
            snakemake.kill()
        if pid_file.exists() and pid_file.read_text().strip() and not gone(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)


def test_outside_snakemake_there_is_no_ancestor_to_watch():
    from servingplan.pipeline import snakemake_ancestor
    assert snakemake_ancestor() is None  # pytest runs outside snakemake
