import pandas as pd

from servingplan.io import read_json, write_csv
from servingplan.pipeline import run_stage


def capacity_rows(path):
    cell = read_json(path)
    for name, result in cell.items():
        # the interval over seeds and the measured speed band, when the capacity stage wrote one, as two
        # columns; the band's own capacities stay in the cell files
        interval = result.get("interval_rps") or [None, None]
        yield {"criterion_name": name,
               **{k: v for k, v in result.items() if k not in ("per_seed", "interval_rps", "speed_band")},
               "interval_lo_rps": interval[0], "interval_hi_rps": interval[1],
               "per_seed_lower": ";".join(f"{s['lower']:.6g}" for s in result["per_seed"]),
               "per_seed_upper": ";".join(f"{s['upper']:.6g}" for s in result["per_seed"])}


def main(sm):
    write_csv(sm.output.latency, pd.concat([pd.read_csv(p) for p in sm.input.sweep], ignore_index=True))
    write_csv(sm.output.chunks, pd.concat([pd.read_csv(p) for p in sm.input.chunks], ignore_index=True))
    write_csv(sm.output.capacity, pd.DataFrame([row for p in sm.input.capacity for row in capacity_rows(p)]))


run_stage(snakemake, main)
