"""The one aggregation over seeds that every table, figure and decision of the pipeline uses.

A configuration is stable only when every seed's queue kept up. An unstable run describes no steady
state, so its latency percentiles, goodput, attainment and throughput are undefined: here, where every
consumer gets its numbers, they become NaN, and no table, sentence or figure can show them. A figure
undefined in any seed (an infinite percentile) is undefined for the configuration too.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

# Column prefixes that have no value when a configuration is unstable.
UNDEFINED_WHEN_UNSTABLE = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "goodput", "attainment", "slo_holds",
                           "throughput_tok_s")
SPREAD = ("min", "max", "std")


def undefined_when_unstable(column: str) -> bool:
    return column.startswith(UNDEFINED_WHEN_UNSTABLE)


def over_seeds(frame: pd.DataFrame, by: list[str], spread: bool = False) -> pd.DataFrame:
    """One row per group of `by`: `stable` (every seed), `seeds` (how many), and each numeric column's
    mean under its own name; with `spread`, also `{column}_min`, `_max` and `_std` (sample) over seeds.
    Columns that are neither numeric nor in `by` keep their value when every seed agrees on it."""
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
            undefined = numeric.isna().any() or (not stable and undefined_when_unstable(column))
            row[column] = np.nan if undefined else float(numeric.mean())
            if spread:
                row[f"{column}_min"] = np.nan if undefined else float(numeric.min())
                row[f"{column}_max"] = np.nan if undefined else float(numeric.max())
                row[f"{column}_std"] = (float(numeric.std(ddof=1)) if not undefined and len(numeric) > 1
                                        else np.nan)
        rows.append(row)
    return pd.DataFrame(rows)


def seed_spread(values) -> list[float] | None:
    """[min, max] of defined per-seed values, None when any is undefined."""
    v = pd.to_numeric(pd.Series(values), errors="coerce")
    return None if v.isna().any() or v.empty else [float(v.min()), float(v.max())]
