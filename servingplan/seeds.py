"""The one aggregation over seeds that every table, figure and decision of the pipeline uses.

A configuration is stable only when every seed's queue kept up. An unstable run describes no steady
state, so its latency percentiles, goodput, attainment and throughput are undefined: here, where every
consumer gets its numbers, they become NaN, and no table, sentence or figure can show them. A figure
undefined in any seed (an infinite percentile) is undefined for the configuration too.
"""
from __future__ import annotations

import numpy as np

# Column prefixes that have no value when a configuration is unstable.
UNDEFINED_WHEN_UNSTABLE = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "goodput", "attainment", "slo_holds",
                           "throughput_tok_s")
SPREAD = ("min", "max", "std")


def undefined_when_unstable(column: str) -> bool:
    return column.startswith(UNDEFINED_WHEN_UNSTABLE)


def figures_over_seeds(values, defined: bool = True, spread: bool = False) -> dict | None:
    """One column's figures over seeds, as over_seeds gives each numeric column: None when the
    configuration's figure is undefined (`defined` False: an unstable configuration's latency, goodput
    and the like) or any seed's value is missing (None or NaN); else the mean (the sum over the count,
    as pandas' mean) and, with `spread`, the min, max and sample std (None for one seed). numpy only,
    so the capacity and fleet jobs, which read one column without a frame, import no pandas."""
    array = np.array([np.nan if value is None else value for value in values], dtype=float)
    if not defined or array.size == 0 or np.isnan(array).any():
        return None
    figures = {"mean": float(array.sum() / array.size)}
    if spread:
        figures.update(min=float(array.min()), max=float(array.max()),
                       std=float(array.std(ddof=1)) if array.size > 1 else None)
    return figures


def over_seeds(frame: pd.DataFrame, by: list[str], spread: bool = False) -> pd.DataFrame:
    """One row per group of `by`: `stable` (every seed), `seeds` (how many), and each numeric column's
    mean under its own name; with `spread`, also `{column}_min`, `_max` and `_std` (sample) over seeds.
    Columns that are neither numeric nor in `by` keep their value when every seed agrees on it."""
    import pandas as pd   # here: the capacity and fleet jobs import this module for figures_over_seeds alone
    rows = []
    for key, group in frame.groupby(by, sort=True, dropna=False):
        key = key if isinstance(key, tuple) else (key,)
        stable = bool(group["stable"].astype(bool).all()) if "stable" in group else True
        row = dict(zip(by, key))
        row.update(stable=stable, seeds=len(group))
        for column in group.columns:
            if column in by or column in ("stable", "seed", "seeds"):
                continue
            values = group[column]
            if values.dtype == bool or values.dtype == object and values.map(type).eq(bool).all():
                row[column] = (np.nan if not stable and undefined_when_unstable(column)
                               else bool(values.astype(bool).all()))
                continue
            numeric = pd.to_numeric(values, errors="coerce")
            if values.dtype == object and numeric.isna().any() and values.notna().any():
                if values.nunique(dropna=False) == 1:
                    row[column] = values.iloc[0]
                continue
            figures = figures_over_seeds(numeric.to_numpy(dtype=float), stable or not undefined_when_unstable(column),
                                         spread)
            row[column] = np.nan if figures is None else figures["mean"]
            if spread:
                for name in SPREAD:
                    row[f"{column}_{name}"] = np.nan if figures is None or figures[name] is None else figures[name]
        rows.append(row)
    return pd.DataFrame(rows)


def seed_spread(values) -> list[float] | None:
    """[min, max] of defined per-seed values, None when any is undefined."""
    import pandas as pd
    figures = figures_over_seeds(pd.to_numeric(pd.Series(values), errors="coerce").to_numpy(dtype=float), spread=True)
    return None if figures is None else [figures["min"], figures["max"]]


def derived_seeds(master_seed: int, count: int) -> list[int]:
    """The seeds of `count` workload draws, derived the same way in every stage so that the seeds of
    different stages never collide."""
    return [master_seed * 1000 + i for i in range(count)]


def simulation_seeds(config: dict) -> list[int]:
    """The workload draws the simulations, capacity searches and plans use: sweep.seeds of them, or one
    for a trace file, which is one fixed workload (every seed would replay the same requests)."""
    return derived_seeds(config["seed"], 1 if config["workload"].get("trace") else config["sweep"]["seeds"])
