"""What every Snakemake script shares: its log, its timestamps, and failing with one line."""
from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import psutil


_terminal = None
# prctl(2)'s option: the signal this process gets when its parent dies
PR_SET_PDEATHSIG = 1
# how often a stage checks that the snakemake that started it is still alive
WATCH_SNAKEMAKE_S = 1.0


def canonical(value):
    """`value` with every mapping rebuilt in sorted key order, recursively (lists keep their order: it
    can mean something). Snakemake reruns a job when its params differ from the last run's as written,
    so a config restated with its keys in another order must give the same params."""
    if isinstance(value, dict):
        return {key: canonical(value[key]) for key in sorted(value)}
    if isinstance(value, (list, tuple)):
        return [canonical(item) for item in value]
    return value


def config_keys(section: dict, keep=None, drop=()) -> dict:
    """The keys of a config section one rule reads, in canonical form: those named in `keep` (all when
    None) except those in `drop`. A rule's params built this way change only when a key it reads does,
    so adding a cap or a target to the config adds jobs and reruns none of the others."""
    names = section if keep is None else [k for k in keep if k in section]
    return canonical({k: section[k] for k in names if k not in drop})


def terminal():
    """Where a long stage reports its progress: the terminal snakemake runs in, while everything else
    the stage prints goes to its log (outside a stage: stderr)."""
    return _terminal or sys.stderr


def snakemake_ancestor(process: psutil.Process | None = None) -> psutil.Process | None:
    """The nearest ancestor of this process that is a snakemake (None outside one)."""
    for parent in (process or psutil.Process()).parents():
        with contextlib.suppress(psutil.Error):
            if any("snakemake" in Path(part).name for part in parent.cmdline()[:2]):
                return parent
    return None


def die_with_snakemake(poll_s: float = WATCH_SNAKEMAKE_S) -> None:
    """End this stage when the snakemake that started it ends, even by kill -9, instead of running on as
    an orphan: the kernel signals it when its parent dies (PR_SET_PDEATHSIG), and since snakemake starts
    a script through a shell, a watcher thread also ends it once the snakemake ancestor is gone."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    ancestor = snakemake_ancestor()
    if ancestor is None:
        return

    def watch():
        with contextlib.suppress(psutil.Error):
            while ancestor.is_running() and ancestor.status() != psutil.STATUS_ZOMBIE:
                time.sleep(poll_s)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="die-with-snakemake", daemon=True).start()


def run_stage(snakemake, main) -> None:
    """Call main(snakemake) with stdout/stderr in the rule's log, bracketed by wall-clock stamps that
    the report adds up into the pipeline's wall time. Outputs are written atomically by the stage, so
    a failure leaves none behind; it exits 1 with one line naming the rule, the exception and its
    message (the traceback is in the log)."""
    global _terminal
    die_with_snakemake()
    log_path = Path(snakemake.log[0])
    log_path.parent.mkdir(parents=True, exist_ok=True)
    real_stderr = sys.stderr
    _terminal = real_stderr
    with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        print(f"started_unix {time.time():.3f}", flush=True)
        try:
            main(snakemake)
        # a bad input (servingplan.config.ConfigError is a ValueError too): its one line, no traceback
        except (ValueError, FileNotFoundError) as exc:
            traceback.print_exc()
            print(f"{snakemake.rule}: {exc}", file=real_stderr)
            raise SystemExit(1)
        except Exception as exc:
            traceback.print_exc()
            message = " ".join(str(exc).split()) or "no message"
            print(f"{snakemake.rule}: {type(exc).__name__}: {message} (traceback in {log_path})", file=real_stderr)
            raise SystemExit(1)
        print(f"finished_unix {time.time():.3f}", flush=True)


def stage_times(log_dir) -> list[tuple[float, float]]:
    """(started, finished) of every stage log under `log_dir` that ran to completion."""
    spans = []
    for path in Path(log_dir).rglob("*.log"):
        stamps = {}
        for line in path.read_text(errors="replace").splitlines():
            key, _, value = line.partition(" ")
            if key in ("started_unix", "finished_unix"):
                stamps[key] = float(value)
        if len(stamps) == 2:
            spans.append((stamps["started_unix"], stamps["finished_unix"]))
    return spans
