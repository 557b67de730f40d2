"""gpu_check.md: a GPU check's document (servingplan.gpu_check.run) for a reader, drawn with the report's
Markdown blocks (servingplan.report.blocks: every text escaped, tables as the report's)."""
from __future__ import annotations

from servingplan.report.blocks import MarkdownBlocks, md

B = MarkdownBlocks({}, {})
MISSING = "n/a"


def seconds(value) -> str:
    """A duration in the unit that keeps it readable."""
    if value is None:
        return MISSING
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if abs(value) >= scale:
            return f"{value / scale:.3g} {unit}"
    return f"{value / 1e-9:.3g} ns"


def percent(fraction) -> str:
    return MISSING if fraction is None else f"{fraction * 100:+.1f}%"


def number(value, unit: str = "") -> str:
    """Four significant digits, never in exponent notation: 67,000 GFLOP/s, 12.34 ms."""
    if value is None:
        return MISSING
    return f"{value:,.0f}{unit}" if abs(value) >= 1000 else f"{value:.4g}{unit}"


def summary_text(summary: dict | None, what: str) -> str:
    if summary is None:
        return f"{what}: nothing compared."
    return (f"{what}: {summary['within_goal']} of {summary['cells']} within the goal, median |error| "
            f"{summary['median_abs_error'] * 100:.1f}%, largest {percent(summary['largest_error'])}, "
            f"{summary['direction']}.")


def section_rates(doc: dict) -> list[str]:
    measured, entry = doc["summary"]["roofline"], doc["summary"]["entry"]
    rows = []
    for label, key, seen, unit in (("Memory bandwidth", "bandwidth_gbs", "seen_bandwidth_gbs", " GB/s"),
                                   ("float32 rate", "gflops", "seen_gflops", " GFLOP/s")):
        published = entry[key] if entry else None
        rows.append([label, number(measured[key], unit), number(measured[seen], unit), number(published, unit),
                     MISSING if published is None else f"{measured[key] / published:.2f}"])
    where = (f"Entry {entry['name']} ({entry.get('description') or 'no description'}), chosen by {entry['matched_by']}."
             if entry else "No hardware entry: nothing is carried over.")
    return [B.heading("Measured rates"),
            B.para(f"The project's probes, read {doc['roofline']['readings']} times through the profile (the GEMM on "
                   f"the model's own products; the fastest was {doc['roofline']['gemm_shape']}). {where}"),
            B.table(["Rate", "Measured peak", "Median reading", "Published (entry)", "Peak / published"], rows)]


def section_host(doc: dict) -> list[str]:
    host = doc["host_time"]
    return [B.heading("Host time per model call"),
            B.para(f"A decode step of {host['batch']} sequence at {host['context']} cached tokens, timed "
                   f"{host['calls']} times: what its roofline floor does not explain is the host's time per call "
                   "(Python, the dispatcher, the kernel launches), which the carry-over assumes to be "
                   f"{seconds(host['default_s'])} on a GPU."),
            B.table(["Median call", "p10 to p90", "Roofline floor", "Host time", "Assumed", "Host time / assumed"],
                    [[seconds(host["median_s"]), f"{seconds(host['p10_s'])} to {seconds(host['p90_s'])}",
                      f"{seconds(host['floor_s'])} ({host['bound']}-bound)", seconds(host["host_time_s"]),
                      seconds(host["default_s"]), f"{host['host_over_default']:.2f}"]])]


def section_fit(doc: dict) -> list[str]:
    fit = doc["fit"]
    return [B.heading("The fit on the device"),
            B.para(f"The project's fit of the cost model to this profile ({doc['settings']['grid']} grid) predicts "
                   f"its held-out points within {fit['heldout_mape'] * 100:.1f}% (goal "
                   f"{fit['mape_goal'] * 100:.0f}%, {'met' if fit['goal_met'] else 'missed'}); prefill terms "
                   f"{', '.join(fit['form']['prefill_terms'])}; decode batches with a table value of their own: "
                   f"{', '.join(map(str, fit['form']['table_batches'])) or 'none'}.")]


def section_carried(doc: dict) -> list[str]:
    carried, summary = doc["carried"], doc["summary"]
    if carried is None:
        return [B.heading("Carried over against measured"),
                B.para("No CPU cost model was given (--carry-from and --machine-json), so nothing was carried over "
                       "and compared.")]
    origin = carried["from"]
    terms = [[row["term"], seconds(row["measured_s"]), seconds(row["carried_s"]), percent(row["error"]),
              seconds(row["probed_s"]), percent(row["probed_error"]), "yes" if row["measured_at_floor"] else "no"]
             for row in carried["terms"]]
    batches = [[str(row["batch"]), seconds(row["measured_s"]), seconds(row["carried_s"]), percent(row["error"]),
                seconds(row["probed_s"]), percent(row["probed_error"])] for row in carried["decode_batches"]]
    calls = [[f"decode, {row['size']} x {row['context']} tokens" if row["kind"] == "decode"
              else f"prefill of {row['size']} tokens", seconds(row["seconds_here"]), seconds(row["seconds_estimated"]),
              seconds(row["seconds_measured"]), f"{row['ratio_assumed']:.3g}", f"{row['ratio_measured']:.3g}",
              percent(row["error"])] for row in carried["calls"]]
    return [B.heading("Carried over against measured"),
            B.para(f"The CPU model {origin['name']} ({origin['source']}; machine {origin['machine_fingerprint']}) "
                   f"carried over by the roofline to {carried['target']['name']} as the pipeline carries it (its "
                   f"published rates, a launch overhead of {seconds(carried['launch_overhead_s'])}), and to the "
                   "rates this device's probes read with the host time measured here (\"as probed\"). Errors are "
                   "carried / measured - 1: negative, the estimate expects the time shorter than measured."),
            B.para(" ".join(summary_text(summary[part], label) for part, label in
                            (("terms", "Terms"), ("decode_batches", "Decode batches"), ("calls", "Calls")))),
            B.table(["Term", "Measured", "Carried", "Error", "As probed", "Error as probed",
                     "Measured held at its floor"], terms),
            B.table(["Decode batch", "f(B) measured", "Carried", "Error", "As probed", "Error as probed"], batches),
            B.table(["Call", "CPU", "Carried", "Measured", "Ratio assumed", "Ratio measured", "Error"], calls)]


def section_capstone(doc: dict) -> list[str]:
    settings, carried = doc["settings"], doc["carried"]
    rows = []
    by_cell = {(row["policy"], row["cap"]): row for row in (carried or {}).get("capstone", [])}
    for cell in doc["capstone"]["measured"]:
        pair = by_cell.get((cell["policy"], cell["cap"]))
        theirs = pair["carried"] if pair else None
        rows.append([f"{cell['policy']} cap {cell['cap']}", number(cell["ttft_ms"], " ms"),
                     number(theirs["ttft_ms"], " ms") if theirs else MISSING,
                     percent(pair["ttft_error"]) if pair else MISSING, number(cell["capacity_rps"], " req/s"),
                     number(theirs["capacity_rps"], " req/s") if theirs else MISSING,
                     percent(pair["capacity_error"]) if pair else MISSING])
    rate = doc["capstone"]["measured"][0]["rate"] if doc["capstone"]["measured"] else None
    seeds = len(settings["capstone_seeds"])
    return [B.heading("The capstone on each model"),
            B.para(f"p90 TTFT at {number(rate, ' req/s')} (the mean over {seeds} seed{'' if seeds == 1 else 's'}; "
                   "n/a where a seed's queue does not keep up) and the capacity at the TTFT target, as the pipeline's "
                   f"cells compute them, KV held {settings['capstone_kv_memory']}."),
            B.table(["Configuration", "p90 TTFT measured", "Carried", "Error", "Capacity measured", "Carried",
                     "Error"], rows)]


def section_replay(doc: dict) -> list[str]:
    replayed = doc["replay"]
    rows = [[f"{row['metric']} {row['stat']}", number(row["measured_ms"], " ms"),
             f"{number(row['measured_lo_ms'])} to {number(row['measured_hi_ms'], ' ms')}",
             number(row["simulated_ms"], " ms"), MISSING if row["diff_pct"] is None else f"{row['diff_pct']:+.1f}%"]
            for row in replayed["comparison"]]
    return [B.heading("Replay on the device against the simulator"),
            B.para(f"{replayed['requests']} requests at {replayed['rate']:.3g} req/s ({replayed['load_fraction']:g} x "
                   f"the measured model's service rate), {replayed['policy']} cap {replayed['cap']}, served by the "
                   f"project's engine in {replayed['wall_s']:.1f} s ({replayed['finished']} finished"
                   f"{', truncated' if replayed['truncated'] else ''}) and simulated on the measured model; the "
                   f"median step's predicted time was off by {number(replayed['step_error_pct_median'], '%')}."),
            B.table(["Metric", "Measured", "Measured 90% interval", "Simulated", "Simulated - measured"], rows)]


def render_markdown(doc: dict) -> str:
    summary = doc["summary"]
    device = summary["device"]
    title = f"# GPU check: {md(device['name'])}\n\n"
    model = "the tiny 2-layer model: a test of the path, not a figure of any GPU" if device["tiny"] else "GPT-2 small"
    intro = B.para(f"Run on {summary['date']} on {device['kind']} ({device['name']}), torch {doc['machine']['torch']}, "
                   f"{model}; {doc['wall_time_s']:.0f} s in all.")
    parts = [intro, *section_rates(doc), *section_host(doc), *section_fit(doc), *section_carried(doc),
             *section_capstone(doc), *section_replay(doc)]
    return title + "".join(str(part) for part in parts)
