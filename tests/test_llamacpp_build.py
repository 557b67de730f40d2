"""The build script's contract that runs without building: a stamped cache folder is left alone."""
import os
import subprocess
from pathlib import Path

from servingplan.llamacpp import build

ROOT = Path(__file__).resolve().parents[1]


def test_a_second_call_does_nothing(tmp_path):
    dest = tmp_path / f"llamacpp-{build.VERSION}"
    dest.mkdir()
    (dest / ".built").write_text("version=x\n")
    env = {**os.environ, "SERVINGPLAN_CACHE": str(tmp_path)}
    run = subprocess.run(["bash", str(ROOT / "scripts" / "build_llamacpp.sh")], env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0 and "already built" in run.stdout
    assert sorted(p.name for p in dest.iterdir()) == [".built"]


def test_paths_follow_the_cache_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("SERVINGPLAN_CACHE", str(tmp_path))
    assert build.build_dir() == tmp_path / "llamacpp-0.3.36"
    assert build.binary("llama-server") == tmp_path / "llamacpp-0.3.36" / "bin" / "llama-server"
    assert not build.built()
    assert "LLAMACPP_VERSION:-0.3.36" in (ROOT / "scripts" / "build_llamacpp.sh").read_text()


def test_make_has_the_target():
    run = subprocess.run(["make", "-n", "llamacpp"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "build_llamacpp.sh" in run.stdout
