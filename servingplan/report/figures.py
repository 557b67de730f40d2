"""The report's figures: each function takes the run's tables and returns a matplotlib Figure.

Figures have fixed sizes and are saved without a timestamp or software tag, so the same inputs give
the same PNG bytes. A queue that does not keep up has no latency percentile (metrics reports None):
such points are drawn in an "unstable" band above the values, never as a large number nor on the axis
floor, where they would read as passing. A figure with no stable point to draw is not drawn: its
function returns None, and `omission(...)` of the same data names why (NO_STABLE_POINT, ALL_ZERO) for the
report's one sentence in its place. Every term, policy, machine and axis is named by names.display.
"""
from __future__ import annotations

import io

import matplotlib

matplotlib.use("Agg")

import matplotlib.ticker  # noqa: E402

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from servingplan.plan import money  # noqa: E402
from servingplan.plan.exercise2 import POLICY as EX2_POLICY  # noqa: E402
from servingplan.plan.names import display  # noqa: E402
from servingplan.plan.planner import _capacity_row  # noqa: E402
from servingplan.seeds import over_seeds  # noqa: E402
from servingplan.simulate import policies  # noqa: E402

POLICY_COLORS = {p.name: p.color for p in policies.REGISTRY}
POLICY_MARKERS = {p.name: p.marker for p in policies.REGISTRY}
TARGET_COLOR = "#c0392b"
TODAY_COLOR = "#2c3e50"
UNSTABLE_COLOR = "#999999"
WIDTH_IN = 9.0
# twice the on-screen density, so the figures stay sharp on high-DPI screens and in print
DPI = 220
# Share of the log-scale axis height above the highest stable value that holds the unstable band.
UNSTABLE_BAND_DECADES = 0.45

plt.rcParams.update({
    "font.size": 9, "axes.titlesize": 10, "axes.labelsize": 9, "legend.fontsize": 8,
    "axes.grid": True, "grid.alpha": 0.3, "axes.spines.top": False, "axes.spines.right": False,
})


policy_label = display
CAP_AXIS = display("max_num_seqs")

# Why a figure is not drawn (the report puts one sentence in its place):
NO_STABLE_POINT = "no_stable_point"   # every configuration it covers lets its queue grow: nothing to draw
ALL_ZERO = "all_zero"                 # every value it would draw is zero


def png_bytes(fig: Figure) -> bytes:
    """Deterministic PNG: no Software tag, fixed DPI; the figure is closed afterwards."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, metadata={"Software": None})
    plt.close(fig)
    return buffer.getvalue()


def _figure(rows: int = 1, cols: int = 1, height: float = 3.6, **kwargs):
    fig, axes = plt.subplots(rows, cols, figsize=(WIDTH_IN, height), squeeze=False, layout="constrained",
                             **kwargs)
    return fig, axes


def _defined(values) -> np.ndarray:
    return np.asarray(pd.to_numeric(pd.Series(values), errors="coerce"), dtype=float)


def sweep_omission(means: pd.DataFrame, columns) -> str | None:
    """NO_STABLE_POINT when no row of a sweep's means is stable with a value in any of `columns`; None
    when there is something to draw."""
    stable = means["stable"].astype(bool).to_numpy()
    drawable = any(np.isfinite(_defined(means[c]))[stable].any() for c in columns)
    return None if drawable else NO_STABLE_POINT


def _unstable_band(ax, top: float, unstable) -> bool:
    """Unstable points (no value), `unstable` = [(xs, colour), ...], as crosses in a shaded band above
    `top` (the highest value or line drawn), so no cross sits on a value or reads as meeting a budget
    line; the axis starts at zero. Returns whether any cross was drawn (for the legend)."""
    unstable = [(list(xs), color) for xs, color in unstable if len(xs)]
    top = top if top > 0 else 1.0
    if not unstable:
        ax.set_ylim(0, top * 1.08)
        return False
    low, high = top * 1.08, top * 1.42
    ax.axhspan(low, high, color=UNSTABLE_COLOR, alpha=0.18, lw=0)
    ax.text(0.5, low + 0.75 * (high - low), "unstable: the queue grows (no value)", transform=ax.get_yaxis_transform(),
            ha="center", va="center", fontsize=7, color="#555555")
    for xs, color in unstable:
        ax.plot(xs, [low + 0.3 * (high - low)] * len(xs), "x", color=color, ms=6, mew=1.5, ls="")
    ax.set_ylim(0, high)
    ticks = [t for t in matplotlib.ticker.MaxNLocator(5).tick_values(0, top) if t <= top * 1.04]
    ax.set_yticks(ticks)
    return True


def _unstable_handle():
    return plt.Line2D([], [], marker="x", color="black", ls="", mew=1.5)


# -- profiling -----------------------------------------------------------------------------------------

def prefill_profile(profile: pd.DataFrame, cost, heldout_ids: set) -> Figure:
    """Prefill latency vs prompt length: medians with p10-p90 bars and the fitted curve."""
    fig, axes = _figure()
    ax = axes[0, 0]
    points = profile[(profile["kind"] == "prefill") & (profile["batch"] == 1)].sort_values("prompt_len")
    _profile_points(ax, points, points["prompt_len"], heldout_ids, "#1f77b4")
    lengths = np.linspace(1, points["prompt_len"].max(), 200)
    ax.plot(lengths, [cost.prefill_time(int(n)) * 1e3 for n in lengths], color="#1f77b4", lw=1.2,
            label="fitted cost model")
    cached = profile[profile["kind"] == "prefill_cached"]
    if len(cached):
        ax.errorbar(cached["prompt_len"], cached["median_s"] * 1e3,
                    yerr=_error_bars(cached), fmt="D", color="#ff7f0e", ms=4, capsize=2,
                    label="chunk after cached tokens (measured)")
        ax.scatter(cached["prompt_len"], [cost.prefill_time(int(n), int(c)) * 1e3
                                          for n, c in zip(cached["prompt_len"], cached["cached"])],
                   marker="_", s=120, color="#ff7f0e", label="chunk after cached tokens (fitted)")
    ax.set_xlabel("prompt tokens in the call")
    ax.set_ylabel("prefill latency (ms)")
    ax.set_title("Prefill: one prompt (batch 1)")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def _decode_by_context(profile: pd.DataFrame):
    """The decode points of each cached-context length, in batch order, with that line's colour."""
    decode = profile[profile["kind"] == "decode"]
    contexts = sorted(decode["cached"].unique())
    colors = plt.cm.viridis(np.linspace(0.05, 0.85, max(len(contexts), 1)))
    for context, color in zip(contexts, colors):
        yield context, color, decode[decode["cached"] == context].sort_values("batch")


def decode_profile(profile: pd.DataFrame, cost, heldout_ids: set) -> Figure:
    """Decode step latency vs batch size, one line per cached context length."""
    fig, axes = _figure(height=3.8)
    ax = axes[0, 0]
    for context, color, points in _decode_by_context(profile):
        _profile_points(ax, points, points["batch"], heldout_ids, color, label=f"{context} cached tokens")
        batches = np.arange(1, points["batch"].max() + 1)
        ax.plot(batches, [cost.decode_time(int(b), int(b) * context, context) * 1e3 for b in batches],
                color=color, lw=1.0)
    ax.set_xlabel(display("batch"))
    ax.set_ylabel("decode step latency (ms)")
    ax.set_title("Decode: one token for each of B sequences (markers measured, lines fitted)")
    ax.legend(loc="upper left", ncol=2)
    return fig


def _error_bars(points: pd.DataFrame) -> np.ndarray:
    median = points["median_s"].to_numpy(float)
    return np.vstack([median - points["p10_s"].to_numpy(float), points["p90_s"].to_numpy(float) - median]) * 1e3


def _profile_points(ax, points, x, heldout_ids, color, label="measured (median, p10-p90)") -> None:
    heldout = points["point_id"].isin(heldout_ids).to_numpy()
    y = points["median_s"].to_numpy(float) * 1e3
    bars = _error_bars(points)
    x = np.asarray(x, dtype=float)
    ax.errorbar(x[~heldout], y[~heldout], yerr=bars[:, ~heldout], fmt="o", color=color, ms=4, capsize=2,
                label=label)
    if heldout.any():
        ax.errorbar(x[heldout], y[heldout], yerr=bars[:, heldout], fmt="o", mfc="white", color=color, ms=5,
                    capsize=2)


def residuals(predicted: pd.DataFrame) -> Figure:
    """Relative error of the shipped fit per point, and of the training-split fit on held-out points."""
    fig, axes = _figure(1, 2)
    panels = [("prefill", ("prefill", "prefill_cached"), "prompt_len", "prompt tokens in the call"),
              ("decode", ("decode",), "batch", display("batch"))]
    for ax, (title, kinds, axis, xlabel) in zip(axes[0], panels):
        rows = predicted[predicted["kind"].isin(kinds)]
        held = rows["in_holdout"].astype(bool)
        ax.axhline(0, color="black", lw=0.8)
        ax.scatter(rows.loc[~held, axis], rows.loc[~held, "error_pct"], s=14, color="#1f77b4",
                   label="fit on all points")
        ax.scatter(rows.loc[held, axis], rows.loc[held, "validation_error_pct"], s=22, marker="D",
                   facecolors="none", edgecolors="#d62728", label="held out (fit without them)")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("(predicted - measured) / measured (%)")
        ax.set_title(f"Residuals: {title}")
        ax.legend(loc="best")
    return fig


def roofline_efficiency(profile: pd.DataFrame) -> Figure:
    """Roofline floor / measured time: how close each call gets to the probed machine limits."""
    fig, axes = _figure(1, 2)
    prefill = profile[(profile["kind"] == "prefill") & (profile["batch"] == 1)].sort_values("prompt_len")
    ax = axes[0, 0]
    for bound, marker in (("compute", "o"), ("memory", "s")):
        rows = prefill[prefill["bound"] == bound]
        if len(rows):
            ax.plot(rows["prompt_len"], rows["efficiency"] * 100, marker, color="#1f77b4", label=f"{bound}-bound")
    ax.set_xlabel("prompt tokens in the call")
    ax.set_ylabel("roofline efficiency (%)")
    ax.set_title("Prefill")
    ax.legend(loc="best")
    ax = axes[0, 1]
    for context, color, rows in _decode_by_context(profile):
        ax.plot(rows["batch"], rows["efficiency"] * 100, "o-", color=color, ms=3, label=f"{context} cached")
    ax.set_xlabel(display("batch"))
    ax.set_ylabel("roofline efficiency (%)")
    ax.set_title("Decode")
    ax.legend(loc="best", ncol=2)
    for ax in axes[0]:
        ax.set_ylim(bottom=0)
    return fig


# -- workload ------------------------------------------------------------------------------------------

def workload_histograms(traces, rate: float, label: str = "drawn") -> Figure:
    """Inter-arrival gaps (with the exponential density of a Poisson process) and token lengths."""
    fig, axes = _figure(1, 3, height=3.0)
    gaps = np.concatenate([np.diff(np.concatenate([[0.0], t.arrival_s])) for t in traces])
    prompts = np.concatenate([t.prompt_tokens for t in traces])
    outputs = np.concatenate([t.output_tokens for t in traces])
    ax = axes[0, 0]
    ax.hist(gaps, bins=40, density=True, color="#1f77b4", alpha=0.7, label=label)
    grid = np.linspace(0, gaps.max(), 200)
    ax.plot(grid, rate * np.exp(-rate * grid), color=TARGET_COLOR, lw=1.2, label=f"Poisson, {rate:g} req/s")
    ax.set_xlabel("gap between arrivals (s)")
    ax.set_ylabel("density (1/s)")
    ax.set_title("Arrivals")
    ax.legend()
    for ax, values, title in ((axes[0, 1], prompts, "Prompt lengths"), (axes[0, 2], outputs, "Reply lengths")):
        ax.hist(values, bins=40, color="#2ca02c" if title.startswith("Prompt") else "#9467bd", alpha=0.8)
        ax.axvline(values.mean(), color="black", ls="--", lw=1, label=f"mean {values.mean():.1f}")
        ax.set_xlabel("tokens")
        ax.set_ylabel("requests")
        ax.set_title(title)
        ax.legend()
    return fig


# -- simulation ----------------------------------------------------------------------------------------

def cell_means(latency: pd.DataFrame, column: str) -> pd.DataFrame:
    """`column` over seeds per (policy, cap, rate) as mean, min and max, and whether every seed kept up,
    from the pipeline's one aggregation (an unstable cell's percentiles and goodput are undefined)."""
    cells = over_seeds(latency, ["policy", "max_num_seqs", "rate"], spread=True)
    return pd.DataFrame({"policy": cells["policy"], "max_num_seqs": cells["max_num_seqs"].astype(int),
                         "rate": cells["rate"].astype(float), "stable": cells["stable"].astype(bool),
                         "mean": cells[column], "min": cells[f"{column}_min"], "max": cells[f"{column}_max"]})


def _policies(frame: pd.DataFrame) -> list[str]:
    return sorted(frame["policy"].unique(), key=policies.order)


def _cap_colors(caps) -> dict:
    caps = sorted(caps)
    return dict(zip(caps, plt.cm.viridis(np.linspace(0.0, 0.9, max(len(caps), 1)))))


def ttft_vs_rate(latency: pd.DataFrame, percentile: float, slo_ms: float, today_rate: float,
                 target_rate: float) -> Figure | None:
    """p-th percentile TTFT (mean over seeds) vs arrival rate, a panel per policy, a line per cap; None
    when no cell keeps up (NO_STABLE_POINT)."""
    means = cell_means(latency, f"ttft_ms_p{percentile:g}")
    if sweep_omission(means, ["mean"]):
        return None
    policies = _policies(means)
    fig, axes = _figure(1, len(policies), height=3.9, sharey=True)
    stable_values = means["mean"].dropna()
    top_stable = max(float(stable_values.max()) if len(stable_values) else slo_ms, slo_ms)
    bottom = min(float(stable_values.min()) if len(stable_values) else slo_ms, slo_ms) / 2
    band_low = top_stable * 10 ** 0.15
    band_high = band_low * 10 ** UNSTABLE_BAND_DECADES
    # markers in the band's lower part, its label above them
    unstable_y = band_low * 10 ** (UNSTABLE_BAND_DECADES * 0.3)
    label_y = band_low * 10 ** (UNSTABLE_BAND_DECADES * 0.78)
    colors = _cap_colors(means["max_num_seqs"].unique())
    rates = sorted(means["rate"].unique())
    drawn_caps, crosses = set(), False
    for ax, policy in zip(axes[0], policies):
        ax.axhspan(band_low, band_high, color=UNSTABLE_COLOR, alpha=0.18, lw=0)
        ax.text(0.5, label_y, "unstable: the queue grows", transform=ax.get_yaxis_transform(), ha="center",
                va="center", fontsize=7, color="#555555")
        for cap, rows in means[means["policy"] == policy].groupby("max_num_seqs"):
            rows = rows.sort_values("rate")
            ok = rows["mean"].notna()
            if ok.any():
                ax.plot(rows.loc[ok, "rate"], rows.loc[ok, "mean"], "o-", ms=3.5, color=colors[cap])
                drawn_caps.add(cap)
            if (~ok).any():
                ax.plot(rows.loc[~ok, "rate"], [unstable_y] * int((~ok).sum()), "x", ms=6, mew=1.5, color=colors[cap])
                crosses = True
        ax.axhline(slo_ms, color=TARGET_COLOR, ls="--", lw=1.2)
        ax.text(0.98, slo_ms, f"SLO {slo_ms:g} ms", transform=ax.get_yaxis_transform(), ha="right", va="bottom",
                color=TARGET_COLOR, fontsize=7)
        for rate, style in ((today_rate, ":"), (target_rate, "-.")):
            ax.axvline(rate, color=TODAY_COLOR, ls=style, lw=0.9)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(rates, [f"{r:g}" for r in rates], fontsize=7)
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 1 else f"{v:g}"))
        ax.set_ylim(bottom, band_high)
        ax.set_title(policy_label(policy))
        ax.set_xlabel("arrival rate (req/s, log)")
    axes[0, 0].set_ylabel(f"p{percentile:g} TTFT (ms, log)")
    handles = [plt.Line2D([], [], marker="o", ms=3.5, color=colors[cap]) for cap in sorted(drawn_caps)]
    labels = [f"cap {cap}" for cap in sorted(drawn_caps)]
    if crosses:
        handles.append(_unstable_handle())
        labels.append("unstable (no percentile)")
    handles += [plt.Line2D([], [], color=TODAY_COLOR, ls=":"), plt.Line2D([], [], color=TODAY_COLOR, ls="-.")]
    labels += [f"today {today_rate:g} req/s", f"target {target_rate:g} req/s"]
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 6))
    return fig


def capacity_per_cap(capacity: pd.DataFrame, today_rate: float, target_rate: float) -> Figure:
    """Highest rate meeting the TTFT SLO per cap (median over seeds, bars min-max), beside the
    highest rate the queue keeps up with at all."""
    fig, axes = _figure(height=3.8)
    ax = axes[0, 0]
    policies = _policies(capacity)
    caps = sorted(capacity["max_num_seqs"].unique())
    positions = {cap: i for i, cap in enumerate(caps)}
    width = 0.8 / max(len(policies), 1)
    positive = capacity["capacity_rps"][capacity["capacity_rps"] > 0]
    # a log axis: capacities span decades; a capacity of 0 (never met) sits on a marked floor row
    floor = min(float(positive.min()) if len(positive) else today_rate, today_rate) / 3
    never_met = False
    for k, policy in enumerate(policies):
        offset = (k - (len(policies) - 1) / 2) * width
        for criterion, filled in (("ttft_slo", True), ("stable", False)):
            rows = capacity[(capacity["policy"] == policy) & (capacity["criterion_name"] == criterion)]
            rows = rows.sort_values("max_num_seqs")
            if not len(rows):
                continue
            x = np.array([positions[c] for c in rows["max_num_seqs"]]) + offset
            y = rows["capacity_rps"].to_numpy(float)
            met = y > 0
            # the planner's interval of each capacity (the one the verdicts use)
            interval = np.array([_capacity_row(capacity, criterion, policy, cap)["interval"] or [np.nan, np.nan]
                                 for cap in rows["max_num_seqs"]], dtype=float).reshape(-1, 2)
            low = np.maximum(interval[:, 0], floor)
            yerr = np.vstack([y - low, interval[:, 1] - y])[:, met]
            label = f"{policy_label(policy)}: {'TTFT SLO met' if filled else 'keeps up at all'}"
            if met.any():
                ax.errorbar(x[met], y[met], yerr=yerr, fmt=POLICY_MARKERS.get(policy, "o"), color=POLICY_COLORS.get(policy),
                            mfc=POLICY_COLORS.get(policy) if filled else "white", ms=6, capsize=3, label=label)
            if (~met).any():
                never_met = True
                ax.plot(x[~met], [floor] * int((~met).sum()), "x", color=POLICY_COLORS.get(policy), ms=6, mew=1.5)
    ax.axhline(target_rate, color=TARGET_COLOR, ls="--", lw=1.2, label=f"target {target_rate:g} req/s")
    ax.axhline(today_rate, color=TODAY_COLOR, ls=":", lw=1.0, label=f"today {today_rate:g} req/s")
    ax.set_xticks(range(len(caps)), [str(c) for c in caps])
    ax.set_xlabel(CAP_AXIS)
    if never_met:
        ax.plot([], [], "x", color="black", mew=1.5, label="never met (capacity 0)")
    ax.axhspan(floor / 1.4, floor * 1.4, color=UNSTABLE_COLOR, alpha=0.18, lw=0)
    ax.text(0.01, floor, "never met", transform=ax.get_yaxis_transform(), va="center", fontsize=7, color="#555555")
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_ylim(bottom=floor / 1.4)
    ax.set_ylabel("capacity (req/s, log)")
    ax.set_title("Capacity per cap (median over seeds, bars: interval); crosses: never met")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig


def attainment_heatmap(latency: pd.DataFrame, percent_good_label: str) -> Figure | None:
    """Share of requests meeting every bound, per cap and rate, a panel per policy; None when no cell
    keeps up (NO_STABLE_POINT)."""
    means = cell_means(latency, "attainment")
    if sweep_omission(means, ["mean"]):
        return None
    policies = _policies(means)
    rates = sorted(means["rate"].unique())
    caps = sorted(means["max_num_seqs"].unique())
    fig, axes = _figure(1, len(policies), height=max(2.6, 1.3 + 0.42 * len(caps)), sharey=True)
    image = None
    for ax, policy in zip(axes[0], policies):
        grid = np.full((len(caps), len(rates)), np.nan)
        unstable = np.zeros_like(grid, dtype=bool)
        for row in means[means["policy"] == policy].itertuples():
            i, j = caps.index(row.max_num_seqs), rates.index(row.rate)
            grid[i, j] = row.mean if row.mean is not None else np.nan
            unstable[i, j] = not row.stable
        # cividis: ordered in lightness and readable with any colour vision
        image = ax.imshow(np.where(unstable, np.nan, grid) * 100, cmap="cividis", vmin=0, vmax=100, aspect="auto",
                          origin="lower")
        for i in range(len(caps)):
            for j in range(len(rates)):
                text = "unst." if unstable[i, j] else (f"{grid[i, j] * 100:.0f}" if np.isfinite(grid[i, j]) else "n/a")
                # cividis is dark at its low end: white text there
                dark = not unstable[i, j] and (not np.isfinite(grid[i, j]) or grid[i, j] < 0.5)
                ax.text(j, i, text, ha="center", va="center", fontsize=7, color="white" if dark else "black",
                        fontstyle="italic" if unstable[i, j] else "normal")
        ax.set_xticks(range(len(rates)), [f"{r:g}" for r in rates], fontsize=7)
        ax.set_yticks(range(len(caps)), [str(c) for c in caps])
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_title(policy_label(policy))
        ax.grid(False)
    axes[0, 0].set_ylabel(CAP_AXIS)
    fig.colorbar(image, ax=axes[0].tolist(), label=percent_good_label, shrink=0.9)
    return fig


def _by_cap_panels(means: pd.DataFrame, rates: dict) -> dict:
    """The panels of `rates` ({label: rate}) with something to show: a stable cell whose value is not zero."""
    def shows(rate):
        at_rate = means[np.isclose(means["rate"], rate)]
        values = _defined(at_rate["mean"])[at_rate["stable"].to_numpy(bool)]
        return bool((np.isfinite(values) & (values != 0)).any())
    return {label: rate for label, rate in rates.items() if shows(rate)}


def by_cap_omission(latency: pd.DataFrame, column: str, rates: dict) -> str | None:
    """Why by_cap(latency, column, rates, ...) draws nothing: NO_STABLE_POINT when no cell at these rates
    keeps up, ALL_ZERO when every stable value is zero; None when it draws a figure."""
    means = cell_means(latency, column)
    if _by_cap_panels(means, rates):
        return None
    at_rates = means[np.isclose(means["rate"].to_numpy(float)[:, None], list(rates.values())).any(axis=1)]
    stable_values = np.isfinite(_defined(at_rates["mean"])[at_rates["stable"].to_numpy(bool)])
    return ALL_ZERO if stable_values.any() else NO_STABLE_POINT


def by_cap(latency: pd.DataFrame, column: str, rates: dict, ylabel: str, title: str,
           reference: dict | None = None) -> Figure | None:
    """`column` (mean over seeds, bars min-max) vs cap, a line per policy, a panel per rate in `rates`
    ({label: rate}); unstable cells, which have no percentile or goodput, are crosses in a band above the
    values. A panel with no stable non-zero value is left out; None when that leaves no panel (see
    by_cap_omission). `reference` maps a panel label to (y, text) of a horizontal line."""
    means = cell_means(latency, column)
    rates = _by_cap_panels(means, rates)
    if not rates:
        return None
    shown = means[np.isclose(means["rate"].to_numpy(float)[:, None], list(rates.values())).any(axis=1)]
    top = float(np.nanmax(_defined(shown["max"]).tolist() + _defined(shown["mean"]).tolist()))
    for label in rates:
        if reference and label in reference:
            top = max(top, float(reference[label][0]))
    fig, axes = _figure(1, len(rates), height=3.4, sharey=True)
    handles, labels, crosses = [], [], False
    for ax, (label, rate) in zip(axes[0], rates.items()):
        at_rate = means[np.isclose(means["rate"], rate)]
        unstable = []
        for policy in _policies(at_rate):
            rows = at_rate[at_rate["policy"] == policy].sort_values("max_num_seqs")
            y = _defined(rows["mean"])
            stable = rows["stable"].to_numpy(bool) & np.isfinite(y)
            caps = rows["max_num_seqs"].to_numpy()
            color = POLICY_COLORS.get(policy)
            unstable.append((caps[~rows["stable"].to_numpy(bool)], color))
            if not stable.any():
                continue
            yerr = np.vstack([y - _defined(rows["min"]), _defined(rows["max"]) - y])
            ax.errorbar(caps, y, yerr=yerr, fmt="-", color=color, capsize=2, lw=1)
            marker = POLICY_MARKERS.get(policy, "o")
            ax.plot(caps[stable], y[stable], marker, color=color, ms=5, ls="")
            if policy_label(policy) not in labels:
                handles.append(plt.Line2D([], [], color=color, marker=marker, ms=5, lw=1))
                labels.append(policy_label(policy))
        if reference and label in reference:
            value, text = reference[label]
            ax.axhline(value, color=TARGET_COLOR, ls="--", lw=1.1)
            ax.text(0.98, value, text, transform=ax.get_yaxis_transform(), ha="right", va="bottom",
                    color=TARGET_COLOR, fontsize=7)
        crosses |= _unstable_band(ax, top, unstable)
        ax.set_xscale("log", base=2)
        caps = sorted(at_rate["max_num_seqs"].unique())
        ax.set_xticks(caps, [str(c) for c in caps])
        ax.minorticks_off()
        ax.set_xlabel(f"{CAP_AXIS}, log")
        ax.set_title(f"{label}: {rate:g} req/s")
    axes[0, 0].set_ylabel(ylabel)
    if crosses:
        handles.append(_unstable_handle())
        labels.append("unstable: the queue grows (no value)")
    fig.legend(handles, labels, loc="outside lower center", ncol=len(labels))
    fig.suptitle(title)
    return fig


# -- memory and cost -----------------------------------------------------------------------------------

def memory_bars(memory: pd.DataFrame, budget_bytes: float, serving_rss: list[dict] = (),
                serving_model: dict | None = None) -> Figure:
    """Per cap: weights + KV reserved for the maximum context, and weights + KV used at the
    simulation's peak per policy, against the budget; with the whole serving process's peak resident
    memory measured at a (policy, cap) (results/validation/serving_memory.json's rows) as a bar of its own
    kind on that policy's bar, and each policy's line fitted to its measurements (the file's model)
    through its bars at every cap."""
    fig, axes = _figure(height=3.8)
    ax = axes[0, 0]
    caps = sorted(memory["max_num_seqs"].unique())
    policies = _policies(memory)
    bars = ["reserved"] + policies
    width = 0.8 / len(bars)
    weights_gb = float(memory["weights_bytes"].iloc[0]) / 1e9
    labelled = set()

    def bar(x, kv_gb, color, hatch, label):
        ax.bar(x, weights_gb, width, color="#bbbbbb", edgecolor="white",
               label=None if "weights" in labelled else "weights")
        labelled.add("weights")
        ax.bar(x, kv_gb, width, bottom=weights_gb, color=color, hatch=hatch, edgecolor="white",
               label=None if label in labelled else label)
        labelled.add(label)

    for i, cap in enumerate(caps):
        rows = memory[memory["max_num_seqs"] == cap]
        for k, name in enumerate(bars):
            x = i + (k - (len(bars) - 1) / 2) * width
            if name == "reserved":
                bar(x, float(rows["kv_reserved_bytes"].iloc[0]) / 1e9, "#8c564b", "//", "KV reserved (max context)")
            else:
                used = rows[rows["policy"] == name]["kv_used_peak_bytes"]
                # no bar (and no legend entry) where the simulation recorded no peak
                if len(used) and pd.notna(used.iloc[0]):
                    bar(x, float(used.iloc[0]) / 1e9, POLICY_COLORS.get(name), None, f"KV used at peak: {policy_label(name)}")
                for measured in serving_rss:
                    if measured["policy"] == name and measured["cap"] == cap:
                        label = "measured peak RSS while serving (whole process)"
                        ax.plot([x], [measured["peak_rss_bytes"] / 1e9], "_", ms=16, mew=2.5, color="black",
                                label=None if label in labelled else label)
                        labelled.add(label)
    for k, name in enumerate(bars):
        line = ((serving_model or {}).get("policies") or {}).get(name)
        if line is not None:
            label = "serving memory: the line fitted to the caps measured"
            ax.plot([i + (k - (len(bars) - 1) / 2) * width for i in range(len(caps))],
                    [(line["intercept_bytes"] + line["slope_bytes_per_cap"] * cap) / 1e9 for cap in caps], "--",
                    lw=1.2, color=POLICY_COLORS.get(name), label=None if label in labelled else label)
            labelled.add(label)
    ax.axhline(budget_bytes / 1e9, color=TARGET_COLOR, ls="--", lw=1.2, label=f"budget {budget_bytes / 1e9:g} GB")
    ax.set_xticks(range(len(caps)), [str(c) for c in caps])
    ax.set_xlabel(CAP_AXIS)
    ax.set_ylabel("memory (GB, decimal)")
    ax.set_title("Weights + KV cache per cap")
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5))
    return fig


def cost_vs_replicas(price_per_hour: float, tokens_per_s: float, target_per_1k: float, max_replicas: int,
                     marks: dict, chosen: dict | None = None) -> Figure:
    """Dollars per 1,000 output tokens at today's traffic for 1..max_replicas machines (money.py's one
    formula); `marks` maps a label to a replica count to highlight; `chosen` (render.chosen_mark: label,
    replicas, and another machine's price or None for this one's) marks the deployment the decision
    names first, drawn filled and named first in the legend."""
    fig, axes = _figure(height=3.3)
    ax = axes[0, 0]
    replicas = np.arange(1, max_replicas + 1)
    cost = [money.cost_per_1k_tokens(price_per_hour, int(r), tokens_per_s) for r in replicas]
    if chosen is not None:
        count = chosen["replicas"]
        price = price_per_hour if chosen["price_per_hour"] is None else chosen["price_per_hour"]
        ax.plot([count], [money.cost_per_1k_tokens(price, count, tokens_per_s)], "*", ms=15,
                color="#009E73", mec="black", mew=0.6, zorder=5, label=chosen["label"])
        ax.axvline(count, color="#009E73", ls="--", lw=1)
    ax.plot(replicas, cost, "o-", ms=3, color="#1f77b4", label=f"this machine at ${price_per_hour:g}/h each")
    ax.axhline(target_per_1k, color=TARGET_COLOR, ls="--", lw=1.2, label=f"target ${target_per_1k:g}")
    for k, (label, count) in enumerate(sorted(marks.items())):
        ax.plot([count], [money.cost_per_1k_tokens(price_per_hour, count, tokens_per_s)], "D", ms=8, mfc="none",
                mew=1.5, color=plt.cm.tab10(k + 2), label=label)
    ax.set_xlabel(display("replicas"))
    ax.set_ylabel("$ per 1,000 output tokens")
    ax.set_title(f"Cost at today's traffic ({tokens_per_s:.0f} output tokens/s)")
    ax.set_ylim(bottom=0)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


# -- validation ----------------------------------------------------------------------------------------

def ttft_scatter(requests: pd.DataFrame) -> Figure:
    """Per-request TTFT measured on the real engine vs simulated for the same trace."""
    fig, axes = _figure(height=4.2)
    ax = axes[0, 0]
    both = requests[requests["finished_both"].astype(bool)]
    groups = sorted(both["load_fraction"].unique())
    colors = plt.cm.plasma(np.linspace(0.0, 0.8, max(len(groups), 1)))
    for fraction, color in zip(groups, colors):
        rows = both[both["load_fraction"] == fraction]
        ax.scatter(rows["measured_ttft_ms"], rows["simulated_ttft_ms"], s=12, alpha=0.75, color=color,
                   label=f"{fraction:g} x capacity ({rows['rate'].iloc[0]:.2g} req/s)")
    values = np.concatenate([both["measured_ttft_ms"].to_numpy(float), both["simulated_ttft_ms"].to_numpy(float)])
    values = values[np.isfinite(values) & (values > 0)]
    if values.size:
        low, high = values.min() / 1.5, values.max() * 1.5
        ax.plot([low, high], [low, high], color="black", lw=0.8, label="simulated = measured")
        ax.set_xlim(low, high)
        ax.set_ylim(low, high)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_aspect("equal")
    ax.set_xlabel("measured TTFT on the real engine (ms, log)")
    ax.set_ylabel("simulated TTFT (ms, log)")
    ax.set_title("Per-request TTFT, requests finished in both runs")
    ax.legend(loc="center left", bbox_to_anchor=(1.02, 0.5))
    return fig


# -- exercise 2 ----------------------------------------------------------------------------------------

def exercise2_curve(curve: pd.DataFrame, a_ms: float, b_ms: float, budget_ms: float, naive_cap: int) -> Figure:
    """The decode curve, its affine fit and the TPOT budget; throughput on a second axis."""
    fig, axes = _figure(height=3.4)
    ax = axes[0, 0]
    ax.plot(curve["batch"], curve["step_ms"], "o", color="#1f77b4", label="step latency (curve)")
    batches = np.linspace(0, curve["batch"].max(), 100)
    ax.plot(batches, a_ms + b_ms * batches, color="#1f77b4", lw=1, label=f"a + b·B = {a_ms:.3g} + {b_ms:.3g}·B ms")
    ax.axhline(budget_ms, color=TARGET_COLOR, ls="--", lw=1.2, label=f"TPOT budget {budget_ms:g} ms")
    ax.axvline(naive_cap, color=TODAY_COLOR, ls=":", lw=1, label=f"largest B within budget: {naive_cap}")
    ax.set_xlabel(f"{display('batch')}, B")
    ax.set_ylabel("decode step latency (ms)")
    right = ax.twinx()
    right.plot(curve["batch"], curve["tokens_per_s"], "s--", ms=3, color="#2ca02c", label="throughput")
    right.set_ylabel("decode throughput (tokens/s)", color="#2ca02c")
    right.grid(False)
    right.spines["right"].set_visible(True)
    lines = ax.get_legend_handles_labels()
    extra = right.get_legend_handles_labels()
    ax.legend(lines[0] + extra[0], lines[1] + extra[1], loc="upper left")
    ax.set_title("Exercise 2 decode curve (analytic cost model)")
    return fig


EX2_READING_STYLES = {"per_kv_token": ("#0072B2", "o", "curve read per KV token"),
                      "per_sequence": ("#E69F00", "s", "curve read per sequence (literal)")}


def exercise2_caps(means: pd.DataFrame, naive_cap: int, picked_cap: int | None, tpot_budget_ms: float) -> Figure | None:
    """Share of requests meeting the SLO (attainment), and p95 TPOT, per cap of the exercise's sweep, one
    line per reading of the curve; unstable caps (no share, no percentile) are crosses in a band above the
    values. Marks the cap the answers pick (answers["pick"]["picked_cap"]) and the curve's cap. None when no
    cap keeps up under either reading (sweep_omission)."""
    if sweep_omission(means, ["attainment", "tpot_ms_p95"]):
        return None
    fig, axes = _figure(1, 2, height=3.4)
    panels = ((axes[0, 0], "attainment", 100.0, "requests meeting the SLO (%)"), (axes[0, 1], "tpot_ms_p95", 1.0, "p95 TPOT (ms)"))
    handles, labels, crosses = [], [], False
    all_caps = sorted(means["max_num_seqs"].astype(int).unique())
    for ax, column, scale, ylabel in panels:
        unstable = []
        top = 100.0 if column == "attainment" else tpot_budget_ms
        for reading, rows in means.groupby("reading", sort=True):
            color, marker, name = EX2_READING_STYLES[reading]
            rows = rows.sort_values("max_num_seqs")
            caps = rows["max_num_seqs"].to_numpy(int)
            y = _defined(rows[column]) * scale
            stable = rows["stable"].astype(bool).to_numpy() & np.isfinite(y)
            unstable.append((caps[~rows["stable"].astype(bool).to_numpy()], color))
            if stable.any():
                ax.plot(caps[stable], y[stable], marker + "-", color=color)
                top = max(top, float(y[stable].max()))
                if name not in labels:
                    handles.append(plt.Line2D([], [], color=color, marker=marker))
                    labels.append(name)
        if column == "tpot_ms_p95":
            ax.axhline(tpot_budget_ms, color=TARGET_COLOR, ls="--", lw=1.2)
        crosses |= _unstable_band(ax, top, unstable)
        if picked_cap is not None:
            ax.axvline(picked_cap, color="#009E73", ls="--", lw=1.2)
        ax.axvline(naive_cap, color=TODAY_COLOR, ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_xticks(all_caps, [str(c) for c in all_caps])
        ax.minorticks_off()
        ax.set_xlabel(f"{CAP_AXIS}, log")
        ax.set_ylabel(ylabel)
    handles.append(plt.Line2D([], [], color=TARGET_COLOR, ls="--", lw=1.2))
    labels.append(f"TPOT budget {tpot_budget_ms:g} ms")
    if picked_cap is not None:
        handles.append(plt.Line2D([], [], color="#009E73", ls="--", lw=1.2))
        labels.append(f"picked cap {picked_cap} (the answers use it)")
    handles.append(plt.Line2D([], [], color=TODAY_COLOR, ls=":", lw=1))
    labels.append(f"curve's cap {naive_cap}")
    if crosses:
        handles.append(_unstable_handle())
        labels.append("unstable: the queue grows (no value)")
    fig.legend(handles, labels, loc="outside lower center", ncol=3)
    return fig


def exercise2_chunks(means: pd.DataFrame, bound_ms: float) -> Figure | None:
    """Worst inter-token gaps vs prefill chunk size at the picked cap (the sweep's max_num_seqs), against
    the inter-token bound; chunks whose queue grows have no gap and are crosses in a band above the
    values. None when no chunk keeps up (sweep_omission)."""
    if sweep_omission(means, ["itl_ms_p99", "itl_ms_max"]):
        return None
    fig, axes = _figure(height=3.2)
    ax = axes[0, 0]
    chunks = means["chunk_size"].to_numpy(int)
    stable = means["stable"].astype(bool).to_numpy()
    top = bound_ms
    for column, style, color, label in (("itl_ms_p99", "o-", "#D55E00", "p99 inter-token gap"),
                                        ("itl_ms_max", "s--", "#E69F00", "largest inter-token gap")):
        y = np.where(stable, _defined(means[column]), np.nan)
        if np.isfinite(y).any():
            ax.plot(chunks, y, style, color=color, label=label)
            top = max(top, float(np.nanmax(y)))
    ax.axhline(bound_ms, color=TARGET_COLOR, ls=":", lw=1.2, label=f"bound {bound_ms:g} ms")
    if _unstable_band(ax, top, [(chunks[~stable], "black")]):
        ax.plot([], [], "x", color="black", mew=1.5, label="unstable: the queue grows (no value)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(chunks, [str(c) for c in chunks])
    ax.minorticks_off()
    ax.set_xlabel(f"{display('chunk_size')}, log")
    ax.set_ylabel("inter-token gap (ms)")
    caps = sorted(means["max_num_seqs"].dropna().astype(int).unique())
    at = f"picked cap {caps[0]}" if len(caps) == 1 else "picked cap"
    ax.set_title(f"Inter-token stalls vs chunk size ({policy_label(EX2_POLICY)}, {at})")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig
