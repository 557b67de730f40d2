"""The GPU check (issue 36): the GPU targets' estimates held against what a real GPU measures.

The report's GPU targets are this machine's CPU fit carried over by the roofline (servingplan.plan.hardware)
plus a host time per model call that is reasoned, not measured (DEFAULT_GPU_LAUNCH_OVERHEAD_MS). On a
machine with a GPU, `python -m servingplan.gpu_check --out DIR` (servingplan/gpu_check/run.py; `make
gpu-check`) profiles the engine there with the project's profiler, fits the cost model to it, times the
host's share of one forward pass, serves a short replay, and compares the CPU model carried over to the
GPU's `hardware:` entry with the model measured, term by term and capacity by capacity
(servingplan/gpu_check/compare.py). It writes DIR/gpu_check.json and DIR/gpu_check.md.

This module is that JSON file's contract, as the pipeline reads it: config `gpu_check` names a check's
file (the config check reads it with `read_check`), the rule carry_over gives every GPU target that
states no launch_overhead_ms the host time the check measured (`with_measured_launch_overhead`), and
the report's section on other machines quotes the check's errors beside the 1-thread check's. What the
pipeline reads is the document's `summary`; the rest is the check's detail for the reader.

    {"schema_version": 1, "summary": {
        "device": {"kind": "cuda" | "cpu", "name": str, "tiny": bool}, "date": "YYYY-MM-DD",
        "entry": {"name", "description", "bandwidth_gbs", "gflops", "kind", "matched_by"} | null,
        "roofline": {"bandwidth_gbs", "gflops", "seen_bandwidth_gbs", "seen_gflops"},   measured on the device
        "host_time_s": s, "default_launch_overhead_s": s,
        "carried_from": {"name", "machine_fingerprint"} | null,
        "goal": fraction,
        "terms", "decode_batches", "calls": error summaries | null,
        "capstone": {"capacity", "ttft": error summaries | null} | null,
        "replay": {"ttft_p90_diff_pct", "tpot_mean_diff_pct"} | null}, ...detail}

An error summary is servingplan.check.carry_check.summarize's: cells, within_goal, median_abs_error,
largest_error, direction, uncompared; every error is carried / measured - 1.

Imports nothing heavy (no torch, numpy or pandas): the Snakefile reads it while parsing.
"""
from __future__ import annotations

import math
import re

from servingplan.io import parse_json, read_text_input
from servingplan.plan import hardware

SCHEMA_VERSION = 1
# a check with every table is some tens of kilobytes
MAX_FILE_BYTES = 1 << 22
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
DEVICE_KINDS = ("cuda", "cpu")
ERROR_SUMMARY_COUNTS = ("cells", "within_goal", "uncompared")
ERROR_SUMMARY_FIGURES = ("median_abs_error", "largest_error")
DIRECTIONS = ("pessimistic", "optimistic", "mixed")


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _field(document: dict, path: str):
    value = document
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            raise ValueError(f"{path} is missing")
        value = value[part]
    return value


def _number(document: dict, path: str, optional: bool = False, signed: bool = False):
    value = _field(document, path)
    if value is None and optional:
        return None
    if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and (signed or value >= 0)):
        raise ValueError(f"{path} = {_short(value)}: must be a finite number{'' if signed else ' >= 0'}")
    return value


def _text(document: dict, path: str, pattern: re.Pattern | None = None) -> str:
    value = _field(document, path)
    if not isinstance(value, str) or not value or pattern is not None and not pattern.match(value):
        wanted = "a date YYYY-MM-DD" if pattern else "a non-empty string"
        raise ValueError(f"{path} = {_short(value)}: must be {wanted}")
    return value


def _object(document: dict, path: str, optional: bool = False) -> dict | None:
    value = _field(document, path)
    if value is None and optional:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"{path} = {_short(value)}: must be an object{' or null' if optional else ''}")
    return value


def _error_summary(document: dict, path: str) -> None:
    if _object(document, path, optional=True) is None:
        return
    for key in ERROR_SUMMARY_COUNTS:
        value = _field(document, f"{path}.{key}")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{path}.{key} = {_short(value)}: must be a count >= 0")
    for key in ERROR_SUMMARY_FIGURES:
        _number(document, f"{path}.{key}", signed=True)
    if _field(document, f"{path}.direction") not in DIRECTIONS:
        raise ValueError(f"{path}.direction = {_short(_field(document, f'{path}.direction'))}: allowed "
                         f"{', '.join(DIRECTIONS)}")


def check_document(document, for_gpu_targets: bool = True) -> None:
    """Raise ValueError, one line naming the field, unless `document` is a GPU check's result (see the
    module docstring) whose summary holds every figure the pipeline reads. With `for_gpu_targets` (the
    pipeline's use) it must also have been made on a GPU with the full model, and have carried a CPU model
    over: a check of the tiny model, or on a CPU, says nothing of the GPU targets' estimates."""
    if not isinstance(document, dict):
        raise ValueError("the document must be a JSON object with schema_version and summary")
    if document.get("schema_version") != SCHEMA_VERSION or isinstance(document.get("schema_version"), bool):
        raise ValueError(f"schema_version = {_short(document.get('schema_version'))}: expected {SCHEMA_VERSION} "
                         "(a file python -m servingplan.gpu_check writes)")
    kind = _field(document, "summary.device.kind")
    if kind not in DEVICE_KINDS:
        raise ValueError(f"summary.device.kind = {_short(kind)}: allowed {', '.join(DEVICE_KINDS)}")
    _text(document, "summary.device.name")
    tiny = _field(document, "summary.device.tiny")
    if not isinstance(tiny, bool):
        raise ValueError(f"summary.device.tiny = {_short(tiny)}: must be true or false")
    _text(document, "summary.date", DATE)
    for key in ("bandwidth_gbs", "gflops", "seen_bandwidth_gbs", "seen_gflops"):
        _number(document, f"summary.roofline.{key}")
    _number(document, "summary.host_time_s")
    _number(document, "summary.default_launch_overhead_s")
    _number(document, "summary.goal")
    entry = _object(document, "summary.entry", optional=True)
    if entry is not None:
        _text(document, "summary.entry.name")
        for key in ("bandwidth_gbs", "gflops"):
            _number(document, f"summary.entry.{key}")
    carried = _object(document, "summary.carried_from", optional=True)
    if carried is not None:
        _text(document, "summary.carried_from.name")
        _text(document, "summary.carried_from.machine_fingerprint")
    for part in ("terms", "decode_batches", "calls"):
        _error_summary(document, f"summary.{part}")
    if _object(document, "summary.capstone", optional=True) is not None:
        for part in ("capacity", "ttft"):
            _error_summary(document, f"summary.capstone.{part}")
    if _object(document, "summary.replay", optional=True) is not None:
        for key in ("ttft_p90_diff_pct", "tpot_mean_diff_pct"):
            _number(document, f"summary.replay.{key}", optional=True, signed=True)
    if for_gpu_targets:
        if kind != "cuda" or tiny:
            raise ValueError(f"made {'with the tiny model' if tiny else 'on the CPU'} (summary.device): only a check "
                             "of the full model on a GPU (--device cuda, no --tiny) speaks for the GPU targets")
        if carried is None or entry is None or _field(document, "summary.terms") is None:
            raise ValueError("carried no CPU cost model over (summary.carried_from is null): rerun the check with "
                             "--carry-from and --machine-json, so it has estimates to compare")


def read_check(path, for_gpu_targets: bool = True) -> dict:
    """The GPU check a JSON file holds (config gpu_check), after check_document found nothing wrong;
    ValueError with one line naming the file and the problem otherwise (missing, not a regular file, not
    JSON, or not of the contract's shape)."""
    what = f"GPU check {str(path)!r}"
    document = parse_json(read_text_input(path, "GPU check", MAX_FILE_BYTES), what)
    try:
        check_document(document, for_gpu_targets)
    except ValueError as exc:
        raise ValueError(f"{what}: {exc}") from None
    return document


def measured_basis(summary: dict) -> str:
    """How the report and the carried model's meta state where a measured launch overhead comes from."""
    return f"measured on {summary['device']['name']} by gpu_check on {summary['date']}"


def with_measured_launch_overhead(target: dict, check_path) -> dict:
    """`target` (a config `hardware:` entry) as the rule carry_over carries to it: a GPU target that
    states no launch_overhead_ms of its own pays the host time per model call the GPU check of
    `check_path` (config gpu_check) measured, with that basis (hardware.launch_overhead_origin); any other
    target, or no check, is left as configured. The host time is the host's (Python, the dispatcher, the
    kernel launches), much the same whichever GPU it drives, so one check serves every GPU target."""
    if not check_path or hardware.machine_kind(target) != "gpu" or target.get("launch_overhead_ms") is not None:
        return target
    summary = read_check(check_path)["summary"]
    return {**target, "launch_overhead_ms": summary["host_time_s"] * 1000.0,
            "launch_overhead_basis": measured_basis(summary)}
