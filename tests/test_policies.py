"""The one registry of scheduling policies: the config schema, the rules' wildcard, the scheduler and
the report all follow it."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from servingplan.config import ConfigError, check
from servingplan.report import figures
from servingplan.simulate import policies, scheduler

ROOT = Path(__file__).resolve().parent.parent


def test_every_registered_policy_has_a_planning_method_and_nothing_else():
    assert set(scheduler.PLANNERS) == set(policies.POLICIES)
    assert scheduler.POLICIES is policies.POLICIES


def test_config_accepts_exactly_the_registered_policies():
    config = yaml.safe_load((ROOT / "config.yaml").read_text())
    config["sweep"]["policies"] = list(policies.POLICIES)
    check(config)
    config["sweep"]["policies"] = ["continuous", "fifo_static"]
    with pytest.raises(ConfigError, match=r"sweep\.policies\[1\] = 'fifo_static': allowed: static, continuous"):
        check(config)


def test_rule_wildcard_matches_exactly_the_registered_policies():
    pattern = re.compile(policies.wildcard())
    for name in policies.POLICIES:
        assert pattern.fullmatch(name)
    assert not pattern.fullmatch("continuous_chunked_v2") and not pattern.fullmatch("fifo")
    assert "policy_wildcard()" in (ROOT / "rules" / "common.smk").read_text()


def test_report_labels_colours_and_markers_come_from_the_registry():
    assert set(figures.POLICY_COLORS) == set(figures.POLICY_MARKERS) == set(policies.POLICIES)
    assert [policies.label(p) for p in policies.POLICIES] == [p.label for p in policies.REGISTRY]
    # a chunking policy names the policy it refines, which is registered too
    assert all(p.unchunked in policies.BY_NAME for p in policies.REGISTRY if p.unchunked)


NEW_POLICY = '''    Policy("chunked_small", "chunked prefill, small chunks", "#CC79A7", "D", unchunked="continuous"),
'''


def test_adding_a_policy_touches_the_scheduler_and_the_registry_only(tmp_path):
    """In a scratch copy, a new policy is added by editing scheduler.py and policies.py alone; the config
    check, the rules' wildcard and the report's styles take it up with no other change."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tmp_path / name)
    registry = tmp_path / "servingplan" / "simulate" / "policies.py"
    text = registry.read_text()
    registry.write_text(text.replace("\n)\nBY_NAME", "\n" + NEW_POLICY + ")\nBY_NAME"))
    sched = tmp_path / "servingplan" / "simulate" / "scheduler.py"
    text = sched.read_text()
    sched.write_text(text.replace('"continuous_chunked": "_schedule_chunked"}',
                                  '"continuous_chunked": "_schedule_chunked", "chunked_small": "_schedule_chunked"}'))
    changed = subprocess.run(["git", "diff", "--no-index", "--name-only", str(ROOT / "servingplan"),
                              str(tmp_path / "servingplan")], capture_output=True, text=True).stdout.split()
    assert sorted(Path(p).name for p in changed) == ["policies.py", "scheduler.py"]

    config = yaml.safe_load((ROOT / "config" / "quick.yaml").read_text())
    config["sweep"]["policies"] = ["continuous", "chunked_small"]
    (tmp_path / "config" / "new_policy.yaml").write_text(yaml.safe_dump(config))
    probe = subprocess.run(
        [sys.executable, "-c", "from servingplan.config import load; from servingplan.report import figures;"
         "load('config/new_policy.yaml'); print(figures.POLICY_COLORS['chunked_small'])"],
        cwd=tmp_path, capture_output=True, text=True)
    assert probe.returncode == 0, probe.stderr
    # the target before --configfile, which takes every argument after it
    dry = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1",
                          "results/machines/here/sweep/cells/chunked_small_cap4.csv", "--configfile", "config/new_policy.yaml"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert dry.returncode == 0, dry.stdout[-2000:] + dry.stderr[-2000:]
    assert "chunked_small_cap4.csv" in dry.stdout + dry.stderr
