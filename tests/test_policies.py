"""The one registry of scheduling policies: the config schema, the rules' wildcard, the scheduler and
the report all follow it."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from servingplan.config import ConfigError, check
from servingplan.report import figures
from servingplan.sim import policies, scheduler

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
