"""The quick pipeline gives the same results run locally and run through SLURM.

Needs a SLURM cluster that answers (`sudo bash .ci/slurm-up.sh` starts a one-node one on
this machine) and snakemake-executor-plugin-slurm (requirements-cluster.txt); skipped
otherwise. The quick pipeline the session already ran locally (conftest.py `quick_pipeline`,
shared with the pipeline tests) is the local run; the repository's working tree is copied
into a temp dir and the quick pipeline runs there through profiles/slurm, after the local
run's measurements were copied in: the hardware profile, the cost model fitted to it, the
real-time validation replay and the serving-memory probes. Those measure this machine (local
rules whose timings and memory differ run to run, and which would take the submit host's
cores from the SLURM jobs for minutes), so only the simulation, planning and reporting jobs
run, as SLURM jobs. Of the simulation cells, one (policy, cap) per machine is made through
SLURM and the others are copied from the local run too (CELL_OUTPUTS). Then every
deterministic CSV/JSON file under results/ must be byte-identical.

Run it alone with:  .venv/bin/python -m pytest -n 0 -m slurm tests/test_slurm.py -v -s
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from yaml import safe_load as load_yaml

from test_pipeline import copy_repository

pytestmark = pytest.mark.slurm

# --- what is run -------------------------------------------------------------------------
SOURCE_DIR = Path(__file__).resolve().parents[1]  # the repository whose working tree is copied
QUICK_CONFIG = "config/quick.yaml"  # the quick config, relative to the repository root
TARGETS: list[str] = []  # empty: the Snakefile's default rule (`all`)
SLURM_PROFILE = "profiles/slurm"  # workflow profile of the SLURM run, relative to the root
SLURM_TIMEOUT_S = 2400

# Outputs of the measuring rules, relative to the run directory (glob patterns): copied from
# the local run into the SLURM run before it starts (with their times, newer than the code),
# so both runs plan from the same measurements and SLURM runs only what comes after. The fit
# comes along because the replay reads its cost model: a cost model remade in the SLURM run
# would be newer than the copied replay and re-serve it.
MEASURED_OUTPUTS = ("results/profile/**/*", "results/fit/*", "results/validation/replay.json",
                    "results/validation/serving_memory.json",
                    "results/check/one_thread/*")

# The simulation cells, copied as well but for one (policy, cap) per machine, the config's last policy at
# its last cap (_made_on_slurm): the SLURM run makes that cell of every cell rule and everything that
# gathers cells (collect, memory, recommend, decide, findings), so every simulation and planning rule
# but carry_over runs as a SLURM job, about 20 jobs instead of 52. A SLURM job starts snakemake twice
# (the plugin's job step, then srun), about 6 s on the test cluster's two cores for a cell of about
# 1 s: the comparison of every cell took minutes. A target's carried-over cost model comes along with
# its cells: made again, it would be newer than they are and re-make them all.
CELL_OUTPUTS = ("results/machines/*/*/cells/*", "results/machines/*/sweep/chunks/*",
                "results/machines/*/costmodel.json", "results/machines/*/carry_over.json")
# One job per (machine, policy, cap), chunk_cell one per cap on this machine alone (its chunk comparison)
CELL_RULES = ("sweep_cell", "capacity_cell", "fleet_cell", "chunk_cell")
# Local rules (`localrules:`): they measure or render on the submit host, never SLURM jobs (the
# comparison of validation with the simulator, `validate`, is a simulation and may go to a node).
LOCAL_RULES = ("profile", "profile_one_thread", "validate_replay", "serving_memory", "report")

# Compared byte for byte: these suffixes under results/ ...
COMPARED_SUFFIXES = (".csv", ".json")
# ... except paths with a component or name part naming run-dependent content, which
# differs from run to run: measured timings (profiles, benchmarks, the real-engine
# validation replay), logs, provenance (when and where a report was made), and the
# recommendation, the decision and its options table, which judge the memory target on the memory the validation replay measured.
NONDETERMINISTIC_WORDS = (
    "timing", "timings", "profile", "profiles", "profiling",
    "benchmark", "benchmarks", "validation", "log", "logs", "provenance", "recommendation", "decision", "options",
)
_NONDETERMINISTIC = re.compile(
    r"(?:^|[/_.-])(?:" + "|".join(NONDETERMINISTIC_WORDS) + r")(?:[/_.-]|$)", re.IGNORECASE
)

# Line the plugin logs for each submitted job, e.g.
# "Job 2 has been submitted with SLURM jobid 3 (log: /x/.snakemake/slurm_logs/rule_sweep/1/3.log)."
_SUBMITTED = re.compile(
    r"has been submitted with SLURM jobid (\d+) \(log: (.*?/slurm_logs/(?:rule|group)_([^/]+)/.*?)\)"
)


# --- skips ---------------------------------------------------------------------------------
def _cluster_skip_reason() -> str | None:
    if shutil.which("sinfo") is None:
        return "sinfo not found: no SLURM client here (sudo bash .ci/slurm-up.sh starts one)"
    try:
        out = subprocess.run(
            ["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10
        )
    except subprocess.TimeoutExpired:
        return "SLURM cluster does not answer: `sinfo` timed out"
    if out.returncode != 0:
        return f"SLURM cluster does not answer: {(out.stderr or out.stdout).strip()[:200]}"
    states = out.stdout.split()
    if not any(s.rstrip("*~#") in ("idle", "mixed", "allocated", "completing") for s in states):
        return f"SLURM cluster has no usable node (sinfo states: {states or 'none'})"
    if importlib.util.find_spec("snakemake_executor_plugin_slurm") is None:
        return "snakemake-executor-plugin-slurm is not installed (pip install -r requirements-cluster.txt)"
    return None


@pytest.fixture(scope="module")
def cluster() -> None:
    reason = _cluster_skip_reason()
    if reason:
        pytest.skip(reason)


# --- helpers -------------------------------------------------------------------------------
def _env(run_dir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
    # jobs started by SLURM inherit this environment (sbatch --export=ALL): they find the
    # same venv, and import the package from the copy they run in
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(run_dir), env.get("PYTHONPATH")]))
    return env


_PROGRESS = re.compile(r"\d+%\|")  # progress-bar lines, left out of failure messages
_FAILED_JOB_LOG = re.compile(r"log: (\S+) \(check log file")


def _tail(text: str, chars: int) -> str:
    return "\n".join(line for line in text.splitlines() if not _PROGRESS.search(line))[-chars:]


def _snakemake(run_dir: Path, args: list[str], timeout: int) -> tuple[str, float]:
    """(stdout, wall seconds) of a snakemake run in `run_dir`; a failed run fails the test with its logs."""
    # targets before --configfile, which takes several values
    cmd = [sys.executable, "-m", "snakemake", *args, *TARGETS, "--configfile", QUICK_CONFIG]
    start = time.monotonic()
    proc = subprocess.run(
        cmd, cwd=run_dir, env=_env(run_dir), capture_output=True, text=True, timeout=timeout
    )
    wall = time.monotonic() - start
    if proc.returncode != 0:
        # the failed jobs' own logs, and SLURM's logs of the last jobs
        logs = [run_dir / m for m in dict.fromkeys(_FAILED_JOB_LOG.findall(proc.stderr))]
        logs += sorted((run_dir / ".snakemake" / "slurm_logs").rglob("*.log"))[-3:]
        tails = "".join(
            f"\n--- {p.relative_to(run_dir)}\n" + _tail(p.read_text(errors="replace"), 2000)
            for p in logs if p.is_file()
        )
        pytest.fail(
            f"{' '.join(cmd)} (in {run_dir}) exited {proc.returncode} after {wall:.0f}s\n"
            f"--- stderr (tail)\n{_tail(proc.stderr, 5000)}{tails}"
        )
    return proc.stdout, wall


def _planned_jobs(run_dir: Path, args: list[str]) -> dict[str, int]:
    """Jobs per rule a dry run of `args` in `run_dir` would execute."""
    out, _ = _snakemake(run_dir, [*args, "-n", "--quiet", "rules"], timeout=300)
    return {parts[0]: int(parts[1]) for parts in map(str.split, out.splitlines())
            if len(parts) == 2 and parts[1].isdigit() and parts[0] not in ("total", "job")}


def _files(run_dir: Path, patterns: tuple[str, ...]) -> list[Path]:
    found: set[Path] = set()
    for pattern in patterns:
        found.update(p for p in run_dir.glob(pattern) if p.is_file())
    return sorted(p.relative_to(run_dir) for p in found)


def _made_on_slurm(cell_output: Path, policy: str, cap: int) -> bool:
    """Whether a file of CELL_OUTPUTS is one the SLURM run makes itself: the (policy, cap) cell of a
    cell rule, or the chunk cell at `cap`."""
    return cell_output.stem in (f"{policy}_cap{cap}", f"cap{cap}")


def _compared_files(run_dir: Path) -> set[str]:
    results = run_dir / "results"
    return {
        rel
        for p in results.rglob("*")
        if p.is_file()
        and p.suffix.lower() in COMPARED_SUFFIXES
        and not _NONDETERMINISTIC.search(rel := p.relative_to(run_dir).as_posix())
    }


def _submitted_jobs(run_dir: Path) -> dict[str, tuple[str, Path]]:
    """SLURM job id -> (rule, slurm log path), from the main snakemake logs of the run."""
    jobs: dict[str, tuple[str, Path]] = {}
    for log in sorted((run_dir / ".snakemake" / "log").glob("*.snakemake.log")):
        for m in _SUBMITTED.finditer(log.read_text(errors="replace")):
            jobs[m.group(1)] = (m.group(3), Path(m.group(2)))
    return jobs


def _slurm_state(jobid: str) -> str:
    out = subprocess.run(
        ["scontrol", "-o", "show", "job", jobid], capture_output=True, text=True, timeout=10
    )
    m = re.search(r"\bJobState=(\S+)", out.stdout)
    return m.group(1) if m else f"unknown ({(out.stderr or out.stdout).strip()[:100]})"


# --- the test ------------------------------------------------------------------------------
def test_quick_pipeline_same_results_locally_and_on_slurm(cluster, quick_pipeline, tmp_path: Path) -> None:
    if not (SOURCE_DIR / "Snakefile").is_file() and not (SOURCE_DIR / "workflow" / "Snakefile").is_file():
        pytest.skip(f"no Snakefile in {SOURCE_DIR} yet: nothing to run")
    assert (SOURCE_DIR / QUICK_CONFIG).is_file(), (
        f"{QUICK_CONFIG} not found in {SOURCE_DIR}: QUICK_CONFIG in {Path(__file__).name} "
        "must name the quick pipeline's config"
    )

    # 1. locally: the session's quick pipeline run (conftest.py), shared with the pipeline tests
    local_dir, slurm_dir = quick_pipeline[0], tmp_path / "slurm"
    slurm_dir.mkdir()
    copy_repository(slurm_dir)  # the pipeline tests' copy of the working tree, as for the local run

    # 2. through SLURM, reusing the local run's measurements and all but one cell per machine
    quick = load_yaml((SOURCE_DIR / QUICK_CONFIG).read_text())
    policy, cap = quick["sweep"]["policies"][-1], quick["sweep"]["caps"][-1]
    for pattern in MEASURED_OUTPUTS + CELL_OUTPUTS:
        assert any(p.is_file() for p in local_dir.glob(pattern)), f"the local run wrote nothing matching {pattern}"
    copied_files = _files(local_dir, MEASURED_OUTPUTS) + [
        rel for rel in _files(local_dir, CELL_OUTPUTS) if not _made_on_slurm(rel, policy, cap)]
    for rel in copied_files:
        (slurm_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(local_dir / rel, slurm_dir / rel)  # keeps the mtimes: newer than the sources
    profile = ["--workflow-profile", str(slurm_dir / SLURM_PROFILE)]
    planned = _planned_jobs(slurm_dir, profile)
    _, slurm_wall = _snakemake(slurm_dir, profile, SLURM_TIMEOUT_S)

    # 3. every job the run planned went to SLURM, but the local rules' (and `all`, which has no action)
    jobs = _submitted_jobs(slurm_dir)
    by_rule: dict[str, int] = {}
    for rule, _ in jobs.values():
        by_rule[rule] = by_rule.get(rule, 0) + 1
    print(
        f"\nSLURM run {slurm_wall:.1f}s with {len(jobs)} SLURM jobs "
        f"{dict(sorted(by_rule.items()))}"
    )
    machines = 1 + len(quick.get("hardware", []))  # this machine and each target
    made_cells = {rule: by_rule.get(rule, 0) for rule in CELL_RULES}
    assert made_cells == {**dict.fromkeys(CELL_RULES, machines), "chunk_cell": 1}, (
        f"expected the {policy} cap {cap} cell of every cell rule on each of the {machines} machines (the "
        f"chunk cell on this machine alone) as SLURM jobs, got jobs per rule {by_rule}"
    )
    remote = {rule: count for rule, count in planned.items() if rule not in (*LOCAL_RULES, "all")}
    assert by_rule == remote, f"SLURM jobs per rule {by_rule}, planned for SLURM {remote}"
    local_submitted = sorted(set(by_rule) & set(LOCAL_RULES))
    assert not local_submitted, f"local rules submitted to SLURM: {local_submitted}"
    not_completed = {j: s for j in jobs if (s := _slurm_state(j)) != "COMPLETED"}
    assert not not_completed, f"SLURM jobs not COMPLETED: {not_completed}"
    missing_logs = [str(p) for _, p in jobs.values() if not p.is_file()]
    assert not missing_logs, f"SLURM job logs missing (slurm-keep-successful-logs?): {missing_logs}"

    # 4. the measurements and cells were reused, not made again
    changed = [
        str(rel) for rel in copied_files
        if (slurm_dir / rel).read_bytes() != (local_dir / rel).read_bytes()
    ]
    assert not changed, f"the SLURM run re-made the copied measurements or cells: {changed}"

    # 5. same deterministic results
    local_files, slurm_files = _compared_files(local_dir), _compared_files(slurm_dir)
    assert local_files, f"no {COMPARED_SUFFIXES} files compared under {local_dir / 'results'}"
    assert local_files == slurm_files, (
        f"only in the local run: {sorted(local_files - slurm_files)}; "
        f"only in the SLURM run: {sorted(slurm_files - local_files)}"
    )
    differ = sorted(
        rel for rel in local_files
        if (local_dir / rel).read_bytes() != (slurm_dir / rel).read_bytes()
    )
    assert not differ, f"differ between the local and the SLURM run: {differ}"
