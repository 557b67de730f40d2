"""What the report says about measurement: how far the machine's speed moved, what the rounds and
the speed trace bought, which parts of the fit earned their place, whether the profile times the
engine's code, and how the engine's steps compare with the model per batch size.

    measurement_summary(machine, fit_report, validation_meta) -> dict   numbers for the text
    speed_trace_figure(machine, validation_meta) -> Figure
    steps_by_batch_figure(validation_meta) -> Figure

Every value comes from the profile's machine.json, the fit report and validation.json of the run.
"""
from __future__ import annotations

import pandas as pd
from matplotlib.figure import Figure

from servingplan.report import figures

KIND_COLORS = {"decode": "#0072B2", "prefill": "#E69F00"}


def measurement_summary(machine: dict, fit_report: dict, validation_meta: dict | None) -> dict:
    speed = machine["speed"]
    references = machine["settings"]["references"]
    selection = fit_report["selection"]
    summary = {
        "moved_pct": speed["moved_pct"],
        "moved_more_than_10pct": speed["moved_more_than_10pct"],
        "warning_threshold_pct": speed["warning_threshold_pct"],
        "span_s": speed["span_s"],
        "by_kind": speed["by_kind"],
        "references": references,
        "reference_interval_s": machine["settings"]["reference_interval_s"],
        "rounds": machine["rounds"],
        "round_mape": fit_report["round_mape"],
        "table_batches": fit_report["form"]["table_batches"],
        "line_batches": [int(b) for b, s in selection["decode_table"].items() if not s["kept"]],
        "decode_selection": [{"batch": int(b), **s} for b, s in selection["decode_table"].items()],
        "prefill_terms_dropped": [t for t, s in selection["prefill_terms"].items() if not s["kept"]],
    }
    if validation_meta:
        summary["validation"] = {
            "drift_by_kind": validation_meta["machine_drift"]["by_kind"],
            "path_check": validation_meta["path_check"],
            "steps_by_batch": validation_meta["steps_by_batch"],
            "steps": validation_meta["headline"].get("steps"),
            "traces": [t for t in validation_meta["traces"] if not t.get("skipped")],
        }
    return summary


def speed_trace_figure(machine: dict, validation_meta: dict | None) -> Figure:
    """Left: each reference's time over the profile, relative to its median. Right: the same
    references re-timed around the validation traces, relative to the profile's median."""
    fig, axes = figures._figure(1, 2, height=3.2, width_ratios=[3, 2])
    left, right = axes[0]
    trace = pd.DataFrame(machine["speed"]["trace"])
    for kind, rows in trace.groupby("kind"):
        median = rows["seconds"].median()
        left.plot(rows["t_s"] / 60, rows["seconds"] / median, marker="o", ms=3, color=KIND_COLORS.get(kind),
                  label=f"{kind} reference")
    left.axhline(1.0, color="#555555", lw=0.8)
    left.set_xlabel("minutes into the profile")
    left.set_ylabel("time / median time")
    left.set_title("speed trace while profiling (above 1 = slower)")
    left.legend(loc="best")
    if validation_meta:
        probe = pd.DataFrame(validation_meta["machine_drift"]["trace"])
        labels = list(dict.fromkeys(probe["label"]))
        for kind, rows in probe.groupby("kind"):
            right.plot([labels.index(label) for label in rows["label"]], rows["ratio"], marker="o", ms=4,
                       color=KIND_COLORS.get(kind), label=f"{kind} reference")
        right.set_xticks(range(len(labels)), labels, rotation=20, ha="right")
        right.axhline(1.0, color="#555555", lw=0.8)
        right.set_ylabel("time / profile's median")
        right.set_title("re-timed around the validation traces")
    else:
        right.set_axis_off()
    return fig


def steps_by_batch_figure(validation_meta: dict) -> Figure:
    """Median engine step time per batch size against the cost model, as fitted and corrected for the
    speed measured around each trace; batches with too few steps to judge are drawn hollow."""
    fig, axes = figures._figure(height=3.2)
    ax = axes[0][0]
    table = pd.DataFrame(validation_meta["steps_by_batch"])
    table = table[table["batch"] > 0]
    judged = table["judged"].to_numpy(bool)
    x = table["batch"].to_numpy()
    ax.plot(x[judged], table["measured_ms"][judged], "o", color="#000000", label="engine (median step)")
    ax.plot(x[~judged], table["measured_ms"][~judged], "o", mfc="white", color="#000000",
            label="engine, too few steps to judge")
    ax.plot(x, table["predicted_ms"], "-", color="#0072B2", label="cost model as fitted")
    ax.plot(x, table["corrected_ms"], "--", color="#D55E00", label="cost model, speed-corrected")
    ax.set_xlabel("decoding sequences in the step")
    ax.set_ylabel("step time (ms)")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left")
    return fig
