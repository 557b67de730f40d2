"""benchmarks/bench_thread_scaling.py refuses bad input with one line and status 2, before loading anything."""
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_thread_scaling.py"


@pytest.mark.parametrize("flags, named", [
    (["--seconds", "0"], "--seconds"), (["--seconds", "nan"], "--seconds"), (["--seconds", "1e9"], "--seconds"),
    (["--batches", "0"], "--batches"), (["--batches", "1", "65"], "--batches"),
    (["--context", "1"], "--context"), (["--context", "4096"], "--context"),
    (["--json", "/dev/null"], "--json"),
])
def test_bad_input_is_one_line_and_status_2(flags, named):
    done = subprocess.run([sys.executable, str(SCRIPT), *flags], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and named in lines[0] and "Traceback" not in done.stderr
