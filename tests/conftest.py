"""Shared helpers: hand-made traces and cost models whose step times are exact in binary floating point."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from servingplan.costmodel import CostModel
from servingplan.simulate.workload import Trace

# The machine is shared and noisy: no per-example deadline, few examples.
settings.register_profile("servingplan", max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("servingplan")


def make_trace(arrivals, prompts, outputs) -> Trace:
    return Trace(np.asarray(arrivals, dtype=float), np.asarray(prompts, dtype=np.int64),
                 np.asarray(outputs, dtype=np.int64))


def fixed_cost(decode_s: float = 1.0, prefill_s: float = 2.0, prefill_per_token_s: float = 0.0) -> CostModel:
    """Every decode step takes `decode_s`, every prefill call `prefill_s` (+ per token): with
    integer values every simulated time is an exact integer."""
    return CostModel(decode_fixed_s=decode_s, decode_per_seq_s=0.0, decode_per_ctx_token_s=0.0,
                     prefill_fixed_s=prefill_s, prefill_per_token_s=prefill_per_token_s, name="fixed")


# Times grow with batch, context and prompt length, as on a real machine; the constants are powers of
# two over 1024 so sums stay exact for the small cases the tests build.
GROWING = CostModel(decode_fixed_s=8 / 1024, decode_per_seq_s=1 / 1024, decode_per_ctx_token_s=1 / 1024 ** 2,
                    prefill_fixed_s=4 / 1024, prefill_per_token_s=1 / 1024 / 8, name="growing")


# The test files whose tests take the session's quick pipeline run (the fixture below)
QUICK_PIPELINE_FILES = ("test_pipeline.py", "test_validation_pipeline.py", "test_slurm.py")


def pytest_collection_modifyitems(items):
    """The tests on the shared quick pipeline first: the longest chain of the suite (the run, the trace
    runs, the SLURM run), which a pytest-xdist worker should start at once. A stable sort: each file
    keeps its order."""
    elsewhere = sorted({item.path.name for item in items if "quick_pipeline" in item.fixturenames}
                       - set(QUICK_PIPELINE_FILES))
    if elsewhere:
        raise pytest.UsageError(f"{', '.join(elsewhere)}: tests on the quick pipeline; add the file to "
                                "QUICK_PIPELINE_FILES in tests/conftest.py, or its xdist worker runs it again")
    items.sort(key=lambda item: "quick_pipeline" not in item.fixturenames)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist (`-n auto --dist loadfile`, pyproject.toml) gives each worker whole test files, so that
    a file's module-scoped fixtures (a set of rendered reports) are built once; the files of
    QUICK_PIPELINE_FILES go to one worker together, in their order, since they share one run of the
    pipeline and some of their tests edit its tree and restore it before the next test reads it (in a
    second worker the pipeline would run a second time). With --no-loadscope-reorder the files are
    handed out in collection order, the quick pipeline's first. (pytest-xdist's loadgroup would do this
    with marks, but it does not group under pytest 9.2: pytest-dev/pytest-xdist#1386.)"""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class QuickPipelineTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            file = super()._split_scope(nodeid)
            return "the quick pipeline" if Path(file).name in QUICK_PIPELINE_FILES else file

    return QuickPipelineTogether(config, log)


@pytest.fixture
def growing_cost() -> CostModel:
    return GROWING


@pytest.fixture(scope="session")
def quick_pipeline(tmp_path_factory):
    """The quick pipeline run once per session in a scratch copy of the repository: (its directory, the
    finished snakemake process). The pipeline tests and the SLURM test's local run share it; a test that
    edits the tree restores it, and reruns there write the same bytes."""
    from test_pipeline import copy_repository, snakemake

    workdir = copy_repository(tmp_path_factory.mktemp("pipeline"))
    return workdir, snakemake(workdir)


@pytest.fixture(scope="session")
def quick_profile_files(tmp_path_factory):
    """The quick profile (quick=True: the tiny model and grid over test_profiling's full-size profile
    section) measured once per session, as the files the profile stage writes (points, samples, machine
    description): test_profiling checks the measurement and test_fit fits it."""
    from servingplan.profile.measure import run_profile
    from test_profiling import PROFILE_CFG

    out = tmp_path_factory.mktemp("profile")
    paths = out / "points.csv", out / "samples.csv", out / "meta.json"
    run_profile(PROFILE_CFG, {"source": "random", "dtype": "float32"}, seed=0, quick=True,
                progress=False).write(*paths)
    return paths
