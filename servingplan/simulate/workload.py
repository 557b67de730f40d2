"""Request traces: Poisson arrivals and prompt/reply length distributions.

A trace is three aligned arrays: arrival time (s), prompt tokens, output tokens. Traces are drawn
from a seeded numpy Generator, so the same spec and seed give the same trace on any machine.
"""
from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from servingplan.io import parse_json, read_text_input

if TYPE_CHECKING:
    import pandas as pd

# Arrivals closer together than this are one instant: no log resolves finer, and a gap below it
# (1e-320 s) rescaled to a rate overflows. A trace spanning more than MAX_TRACE_SPAN_S (three years) is
# no serving log; past it float times lose the resolution of a step and the simulation cannot advance.
MIN_TRACE_SPAN_S = 1e-6
MAX_TRACE_SPAN_S = 1e8
# A timestamp is read as float64 seconds, which resolve MIN_TRACE_SPAN_S only below 2**33 s (the spacing
# there is 2**-20 s, 0.95 us; as Unix time, the year 2242): past it, arrivals a log tells apart merge
# once the first timestamp is subtracted (at 1e20 s the spacing is 16,384 s).
MAX_TIMESTAMP_S = 2.0 ** 33

DISTRIBUTIONS = ("uniform", "loguniform", "lognormal", "constant")


@dataclass(frozen=True)
class Trace:
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray

    def __post_init__(self):
        n = len(self.arrival_s)
        if len(self.prompt_tokens) != n or len(self.output_tokens) != n:
            raise ValueError("trace arrays differ in length")

    def __len__(self) -> int:
        return len(self.arrival_s)

    @property
    def duration_s(self) -> float:
        return float(self.arrival_s[-1]) if len(self) else 0.0

    def to_frame(self) -> pd.DataFrame:
        # imported here: the simulations read traces as arrays, and their processes then never import pandas
        import pandas as pd

        return pd.DataFrame({"arrival_s": self.arrival_s, "prompt_tokens": self.prompt_tokens,
                             "output_tokens": self.output_tokens})

    @property
    def mean_rate_rps(self) -> float | None:
        """Requests per second over the span of the arrivals (None when they all arrive at once, within
        MIN_TRACE_SPAN_S): mean_rate."""
        return mean_rate(self.arrival_s)

    def with_rate(self, rate: float) -> "Trace":
        """The same requests with arrival gaps rescaled to another mean rate. A burst (every arrival
        within MIN_TRACE_SPAN_S) has no gaps to rescale, and a rescaled span past MAX_TRACE_SPAN_S
        could not be simulated (check_replay_rate): both raise ValueError."""
        current = self.mean_rate_rps
        if current is None:
            raise ValueError(f"all {len(self)} requests arrive within {MIN_TRACE_SPAN_S:g} s of each other, so "
                             f"there are no gaps to rescale to rate {rate:g}")
        check_replay_rate(len(self), rate)
        return Trace(self.arrival_s * (current / rate), self.prompt_tokens, self.output_tokens)


def check_replay_rate(requests: int, rate: float) -> None:
    """ValueError unless `requests` arrivals at `rate` per second (on average, as drawn or rescaled)
    span at most MAX_TRACE_SPAN_S, the longest a simulation replays; at rate inf they span none. (A rate
    <= 0 is no rate at all: the draws refuse it themselves.)"""
    span = requests / rate if rate > 0 else 0.0
    if not span <= MAX_TRACE_SPAN_S:
        # repr, not :g, names a subnormal rate as written (1e-320, not 9.99989e-321)
        spans = f"{span:.3g} s" if math.isfinite(span) else "more seconds than a float holds"
        raise ValueError(f"{requests} requests at rate {rate!r} span {spans}: at most {MAX_TRACE_SPAN_S:g} s allowed "
                         f"(a rate >= {requests / MAX_TRACE_SPAN_S:.3g} req/s)")


def mean_rate(arrival_s: np.ndarray) -> float | None:
    """Requests per second of sorted arrivals, counted from time 0 to the last one; None when they all
    arrive at once, within MIN_TRACE_SPAN_S. The one definition of a trace's rate: the trace's own, the
    rescaling's and a run's summary all read it, so a burst has no rate anywhere, and no rate exceeds
    the requests over MIN_TRACE_SPAN_S (dividing by a finer span, 1e-320 s, gave infinity)."""
    if not len(arrival_s):
        return None
    # the span between first and last arrival decides: a burst logged at t = 3.5 s is still a burst
    span, duration = float(arrival_s[-1] - arrival_s[0]), float(arrival_s[-1])
    return len(arrival_s) / duration if min(span, duration) >= MIN_TRACE_SPAN_S else None


def _lognormal_mu(mean: float, sigma: float, lo: int, hi: int) -> float:
    """The mu whose lognormal, rounded and clipped to [lo, hi], has the given mean (bisection)."""
    if not lo < mean < hi:
        raise ValueError(f"lognormal mean {mean} must lie strictly inside [{lo}, {hi}]")
    grid = np.linspace(-8.0, 8.0, 4001)
    z = 0.5 * (grid[1:] + grid[:-1])
    weights = np.diff(0.5 * (1.0 + np.vectorize(math.erf)(grid / math.sqrt(2.0))))

    def clipped_mean(mu):
        return float(np.sum(weights * np.clip(np.rint(np.exp(mu + sigma * z)), lo, hi)) / weights.sum())

    a, b = math.log(lo) - 3 * sigma, math.log(hi) + 3 * sigma
    for _ in range(100):
        mid = 0.5 * (a + b)
        if clipped_mean(mid) < mean:
            a = mid
        else:
            b = mid
    return 0.5 * (a + b)


def draw_lengths(spec: dict, n: int, rng: np.random.Generator) -> np.ndarray:
    """Integer token counts from a length spec: {dist, min, max, [mean, sigma | value]}."""
    dist = spec["dist"]
    if dist == "constant":
        return np.full(n, int(spec["value"]), dtype=np.int64)
    lo, hi = int(spec["min"]), int(spec["max"])
    if dist == "uniform":
        return rng.integers(lo, hi + 1, size=n, dtype=np.int64)
    if dist == "loguniform":
        return np.clip(np.rint(np.exp(rng.uniform(math.log(lo), math.log(hi + 1), size=n)) - 0.5),
                       lo, hi).astype(np.int64)
    if dist == "lognormal":
        sigma = float(spec["sigma"])
        mu = _lognormal_mu(float(spec["mean"]), sigma, lo, hi)
        return np.clip(np.rint(rng.lognormal(mu, sigma, size=n)), lo, hi).astype(np.int64)
    raise ValueError(f"length dist {dist!r}: allowed {DISTRIBUTIONS}")


def expected_length(spec: dict, samples: int = 200_000, seed: int = 12345) -> float:
    """Monte-Carlo mean of a length spec (used to show calibration against the source totals)."""
    return float(draw_lengths(spec, samples, np.random.default_rng(seed)).mean())


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    if rate <= 0:
        raise ValueError(f"arrival rate {rate}: must be > 0")
    return np.cumsum(rng.exponential(1.0 / rate, size=n))


def vllm_arrivals(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Arrival times as vLLM's benchmark client draws them (vllm/benchmarks/serve.py get_request): at an
    infinite rate every request at t = 0; otherwise gaps drawn from a gamma distribution with shape
    `burstiness` and scale 1/(rate*burstiness) (mean 1/rate, coefficient of variation 1/sqrt(burstiness);
    burstiness 1 is Poisson, an infinite burstiness constant gaps), summed, then rescaled so the last
    request arrives at n/rate exactly, as vLLM does to steady the throughput across seeds."""
    if not rate > 0 or not burstiness > 0:
        raise ValueError(f"arrival rate {rate} and burstiness {burstiness}: both must be > 0")
    if math.isinf(rate):
        return np.zeros(n)
    if math.isinf(burstiness):
        gaps = np.full(n, 1.0 / rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n)
    arrivals = np.cumsum(gaps)
    if n and arrivals[-1] > 0:
        arrivals *= (n / rate) / arrivals[-1]
    return arrivals


def generate(spec: dict, seed: int) -> Trace:
    """A trace from a workload spec: {num_requests, rate, [burstiness], prompt: {...}, output: {...}}
    (without burstiness and at a finite rate, Poisson arrivals; with it or at rate inf, vLLM's draw,
    vllm_arrivals; a rate that spreads them past MAX_TRACE_SPAN_S raises ValueError), or a file:
    {trace: {path, layout, columns, timestamps, rate}} (see load_trace; the same trace for every seed)
    or {trace_csv}."""
    if spec.get("trace"):
        return load_trace(**spec["trace"]).trace
    if spec.get("trace_csv"):
        return load_trace_csv(spec["trace_csv"])
    rng = np.random.default_rng(seed)
    n = int(spec["num_requests"])
    check_replay_rate(n, float(spec["rate"]))
    if spec.get("burstiness") is not None or math.isinf(float(spec["rate"])):
        arrivals = vllm_arrivals(n, float(spec["rate"]), float(spec.get("burstiness") or 1.0), rng)
    else:
        arrivals = poisson_arrivals(n, float(spec["rate"]), rng)
    prompts = draw_lengths(spec["prompt"], n, rng)
    outputs = draw_lengths(spec["output"], n, rng)
    return Trace(arrivals, prompts, outputs)


TRACE_COLUMNS = ("arrival_s", "prompt_tokens", "output_tokens")
# a trace file's size (a million rows of a wide log), and one JSONL line's (a CSV field's bound is csv's)
MAX_TRACE_BYTES = 256 << 20
MAX_JSONL_LINE_CHARS = 1 << 17
# bounds that keep a simulation of the trace finite in time and memory (vLLM's longest contexts are ~1M)
MAX_TRACE_TOKENS = 1 << 20
MAX_TRACE_ROWS = 1_000_000


def _token_count(text: str):
    """The integer a cell holds ('12' or '12.0'), or None."""
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if math.isfinite(value) and value.is_integer() else None


def load_trace_csv(path) -> Trace:
    """A trace from a CSV with a header naming at least arrival_s, prompt_tokens and output_tokens,
    its arrivals kept as written. Every row is checked: a ragged row, a blank or non-numeric cell, a
    token count that is not an integer in [1, MAX_TRACE_TOKENS], or an arrival that is not a finite time
    in [0, MAX_TRACE_SPAN_S] raises ValueError naming the file, the line, the column and the value."""
    rows = _csv_rows(path)
    header = next(rows, None)
    if header is None:
        raise ValueError(f"trace {path}: empty file, needs a header with columns {', '.join(TRACE_COLUMNS)}")
    header = _header(header, path)
    missing = [c for c in TRACE_COLUMNS if c not in header]
    if missing:
        raise ValueError(f"trace {path}: missing columns {missing}")
    where = {column: header.index(column) for column in TRACE_COLUMNS}
    arrivals, prompts, outputs = [], [], []
    for line, row in rows:
        if len(row) != len(header):
            raise ValueError(f"trace {path} line {line}: {len(row)} fields, the header has {len(header)}")
        if len(arrivals) == MAX_TRACE_ROWS:
            raise ValueError(f"trace {path}: more than {MAX_TRACE_ROWS:,} requests")
        cell = row[where["arrival_s"]].strip()
        try:
            arrival = float(cell)
        except ValueError:
            arrival = math.nan
        # the arrivals are replayed as written, from time 0: the last one is the span the simulation runs
        # (two rows at 1e300 s are no burst to replay: a step's milliseconds vanish beside that clock)
        if not (math.isfinite(arrival) and 0 <= arrival <= MAX_TRACE_SPAN_S):
            raise ValueError(f"trace {path} line {line}: arrival_s = {cell or '(blank)'}: must be a finite "
                             f"time >= 0 and at most {MAX_TRACE_SPAN_S:g} s (about three years): the trace is "
                             "replayed at its own times, from time 0")
        arrivals.append(arrival)
        for column, out in (("prompt_tokens", prompts), ("output_tokens", outputs)):
            cell = row[where[column]].strip()
            tokens = _token_count(cell)
            if tokens is None or not 1 <= tokens <= MAX_TRACE_TOKENS:
                raise ValueError(f"trace {path} line {line}: {column} = {cell or '(blank)'}: must be an integer in "
                                 f"[1, {MAX_TRACE_TOKENS}]")
            out.append(tokens)
    order = np.argsort(np.asarray(arrivals, dtype=float), kind="stable")
    return Trace(np.asarray(arrivals, dtype=float)[order], np.asarray(prompts, dtype=np.int64)[order],
                 np.asarray(outputs, dtype=np.int64)[order])


# Where each layout keeps a request's arrival and token counts, and how its timestamps are written:
# seconds (a number) or datetime (ISO 8601 text, e.g. Azure's "2023-11-16 18:15:46.6805900").
TRACE_LAYOUTS = {
    "servingplan": {"arrival": "arrival_s", "prompt_tokens": "prompt_tokens", "output_tokens": "output_tokens",
                    "timestamps": "seconds"},
    # Azure LLM inference traces 2023/2024 (AzurePublicDataset)
    "azure": {"arrival": "TIMESTAMP", "prompt_tokens": "ContextTokens", "output_tokens": "GeneratedTokens",
              "timestamps": "datetime"},
    # BurstGPT (HPMLL/BurstGPT): seconds since the log began; failed requests log 0 response tokens
    "burstgpt": {"arrival": "Timestamp", "prompt_tokens": "Request tokens", "output_tokens": "Response tokens",
                 "timestamps": "seconds"},
}
TIMESTAMP_KINDS = ("seconds", "datetime")
# What happens to a request whose prompt + reply do not fit the model's context. vLLM rejects a prompt
# longer than max_model_len; public logs come from models with far longer contexts than GPT-2's 1,024
# tokens, so the user chooses and the report counts what was changed.
TOO_LONG_POLICIES = ("refuse", "skip", "clip")
JSONL_SUFFIXES = (".jsonl", ".ndjson")


@dataclass(frozen=True)
class LoadedTrace:
    """A trace read from a file, and what its policies changed: a row asking for 0 prompt or 0
    output tokens is no request a server could serve (logs record failures that way), so it is
    skipped and counted, never silently kept or fatal; a request longer than the context is refused,
    skipped or clipped as `too_long` says, and counted."""
    trace: Trace
    rows: int
    skipped_zero_tokens: int
    layout: str
    columns: dict  # the file's names for arrival, prompt_tokens and output_tokens, and its timestamp kind
    too_long: str = "refuse"
    too_long_requests: int = 0


def _fit_context(prompts: np.ndarray, outputs: np.ndarray, max_context: int | None, too_long: str,
                 requests: int | None, path):
    """Prompts and replies made to fit `max_context` tokens (prompt + reply) by the `too_long` policy,
    the mask of requests kept (the first `requests` of those the policy lets through) and how many of
    the rows considered were too long; a row after the last one kept is never replayed, so it is
    neither refused nor counted. `clip` keeps the reply (at most half the context) and drops the
    prompt's oldest tokens, as a chat front end drops old turns."""
    if too_long not in TOO_LONG_POLICIES:
        raise ValueError(f"trace too_long {too_long!r}: allowed {', '.join(TOO_LONG_POLICIES)}")
    over = (prompts + outputs > max_context) if max_context is not None else np.zeros(len(prompts), dtype=bool)
    keep = ~over if too_long == "skip" else np.ones(len(prompts), dtype=bool)
    if requests is not None:
        considered = np.cumsum(keep) - keep < requests
        keep, over = keep & considered, over & considered
    count = int(over.sum())
    if count and too_long == "refuse":
        longest = int((prompts + outputs)[over].max())
        raise ValueError(f"trace {path}: {count} of {int(keep.sum())} requests need more than {max_context} tokens "
                         f"(prompt + reply; the longest {longest}); set too_long to skip or clip them")
    if too_long == "clip":
        outputs = np.where(over, np.minimum(outputs, max_context // 2), outputs)
        prompts = np.where(over, np.minimum(prompts, max_context - outputs), prompts)
    return prompts, outputs, keep, count


def _records(path: Path):
    """(line number, {column: text}) of every row of a CSV (with header) or JSONL file."""
    if path.suffix.lower() in JSONL_SUFFIXES:
        text = read_text_input(path, "trace", MAX_TRACE_BYTES)
        for line_number, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            if len(line) > MAX_JSONL_LINE_CHARS:
                raise ValueError(f"trace {path} line {line_number}: {len(line):,} characters, at most "
                                 f"{MAX_JSONL_LINE_CHARS:,} allowed")
            record = parse_json(line, f"trace {path} line {line_number}")
            if not isinstance(record, dict):
                raise ValueError(f"trace {path} line {line_number}: not a JSON object")
            yield line_number, {key: "" if value is None else str(value) for key, value in record.items()}
        return
    rows = _csv_rows(path)
    first = next(rows, None)
    if first is None:
        raise ValueError(f"trace {path}: empty file, needs a header row")
    header = _header(first, path)
    for line_number, row in rows:
        if len(row) != len(header):
            raise ValueError(f"trace {path} line {line_number}: {len(row)} fields, the header has {len(header)}")
        yield line_number, dict(zip(header, row))


def _csv_rows(path):
    """The header (a list) and then (line number, row) of every non-blank row of a CSV trace, read
    as a regular UTF-8 file of at most MAX_TRACE_BYTES; a field past csv's size limit raises
    ValueError naming the line."""
    reader = csv.reader(io.StringIO(read_text_input(path, "trace", MAX_TRACE_BYTES), newline=""))
    first = True
    while True:
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise ValueError(f"trace {path} line {reader.line_num}: {exc} (at most {csv.field_size_limit():,} "
                             "characters per field)") from None
        if first:
            first = False
            yield row
        elif row:
            yield reader.line_num, row


def _header(row: list, path) -> list:
    """A CSV header's column names, stripped; a byte-order mark or a name given twice (which would
    silently read one of the two columns) raises ValueError."""
    if row and row[0].startswith("\ufeff"):
        raise ValueError(f"trace {path}: the file starts with a byte-order mark (BOM, U+FEFF) before the first "
                         f"column name {row[0][1:].strip()!r}; save it as UTF-8 without BOM")
    header = [name.strip() for name in row]
    twice = sorted({name for name in header if header.count(name) > 1})
    if twice:
        raise ValueError(f"trace {path}: the header names column {twice[0]!r} {header.count(twice[0])} times; "
                         "each column name must appear once")
    return header


def _check_timestamps(path, column: str, kind: str, earliest: tuple | None, latest: tuple | None) -> None:
    """The file's earliest and latest timestamps, (seconds, line, cell), must lie within
    MAX_TRACE_SPAN_S of each other and within MAX_TIMESTAMP_S of time 0, where float64 seconds still
    resolve MIN_TRACE_SPAN_S; otherwise ValueError naming the line, the column, the value and the range."""
    if earliest is None:
        return
    span = latest[0] - earliest[0]
    if not span <= MAX_TRACE_SPAN_S:
        raise ValueError(f"trace {path}: {column} spans {span:.3g} s, from {earliest[2]} (line {earliest[1]}) to "
                         f"{latest[2]} (line {latest[1]}); at most {MAX_TRACE_SPAN_S:g} s (about three years) allowed")
    seconds, line, cell = max(earliest, latest, key=lambda stamp: abs(stamp[0]))
    if not abs(seconds) < MAX_TIMESTAMP_S:
        zero, allowed = (("time 0", f"a time in [0, {MAX_TIMESTAMP_S:.4g}) s (2^33 s)") if kind == "seconds" else
                         ("1970", f"a date from {_EARLIEST_DATE} to {_LATEST_DATE} (within 2^33 s of 1970)"))
        raise ValueError(f"trace {path} line {line}: {column} = {cell}: {abs(seconds):.3g} s from {zero}, where "
                         f"float64 seconds resolve only {math.ulp(seconds):.2g} s and arrivals a microsecond apart "
                         f"would merge; must be {allowed}")


_EARLIEST_DATE, _LATEST_DATE = (datetime.fromtimestamp(sign * MAX_TIMESTAMP_S, timezone.utc).date() for sign in (-1, 1))


def _timestamp(text: str, kind: str) -> tuple[float, bool | None]:
    """(seconds, whether the date carries a UTC offset: None for seconds); NaN for a bad cell. A date
    without an offset is read as UTC, as the Azure 2023 trace writes its dates."""
    if kind == "datetime":
        try:
            moment = datetime.fromisoformat(text)
        except ValueError:
            return math.nan, None
        return (moment if moment.tzinfo else moment.replace(tzinfo=timezone.utc)).timestamp(), moment.tzinfo is not None
    try:
        return float(text), None
    except ValueError:
        return math.nan, None


def load_trace(path, layout: str = "servingplan", columns: dict | None = None, timestamps: str | None = None,
               rate: float | None = None, requests: int | None = None, max_context: int | None = None,
               too_long: str = "refuse") -> LoadedTrace:
    """A trace from a CSV or JSONL file (.jsonl/.ndjson) in one of TRACE_LAYOUTS, with `columns`
    ({arrival, prompt_tokens, output_tokens} -> the file's names) and `timestamps` overriding the
    layout's. Rows with 0 tokens are skipped and counted; with `max_context`, requests longer than it
    are handled by `too_long` (see _fit_context); then the first `requests` arrivals are kept.
    Arrivals start at 0 (the first request's timestamp) and, with `rate`, are rescaled to that mean
    rate. Any other bad cell, or timestamps too far apart or from time 0 (_check_timestamps), raises
    ValueError naming the file, the line, the column and the value."""
    path = Path(path)
    if layout not in TRACE_LAYOUTS:
        raise ValueError(f"trace layout {layout!r}: allowed {', '.join(TRACE_LAYOUTS)}")
    mapping = {**TRACE_LAYOUTS[layout], **(columns or {}), **({"timestamps": timestamps} if timestamps else {})}
    if mapping["timestamps"] not in TIMESTAMP_KINDS:
        raise ValueError(f"trace timestamps {mapping['timestamps']!r}: allowed {', '.join(TIMESTAMP_KINDS)}")
    fields = ("arrival", "prompt_tokens", "output_tokens")
    for i, field in enumerate(fields):
        for other in fields[i + 1:]:
            if mapping[field] == mapping[other]:
                raise ValueError(f"trace columns: {field} and {other} both name column {mapping[field]!r}; each "
                                 "field needs its own column")
    arrivals, prompts, outputs = [], [], []
    rows = skipped = 0
    first_offset = None  # (line, whether its date has a UTC offset) of the first dated row
    # (seconds, line, cell) of the earliest and latest timestamps of every row, a skipped row's too: it is
    # the same clock, and one 1e300 s from the others says the column holds no times of this log
    earliest = latest = None
    for line, record in _records(path):
        rows += 1
        if rows > MAX_TRACE_ROWS:
            raise ValueError(f"trace {path}: more than {MAX_TRACE_ROWS:,} requests")
        cells = {}
        for field in ("arrival", "prompt_tokens", "output_tokens"):
            if mapping[field] not in record:
                raise ValueError(f"trace {path} line {line}: no column {mapping[field]!r} (the {field} of layout "
                                 f"{layout!r}; columns: {', '.join(record)})")
            cells[field] = record[mapping[field]].strip()
        arrival, offset = _timestamp(cells["arrival"], mapping["timestamps"])
        if not math.isfinite(arrival) or (mapping["timestamps"] == "seconds" and arrival < 0):
            raise ValueError(f"trace {path} line {line}: {mapping['arrival']} = {cells['arrival'] or '(blank)'}: "
                             f"must be a finite {'time >= 0' if mapping['timestamps'] == 'seconds' else 'ISO 8601 date'}")
        stamp = (arrival, line, cells["arrival"])
        earliest = stamp if earliest is None or arrival < earliest[0] else earliest
        latest = stamp if latest is None or arrival > latest[0] else latest
        # dates with and without an offset in one file: the ones without have no defined instant
        first_offset = first_offset or (offset is not None and (line, offset))
        if offset is not None and offset != first_offset[1]:
            raise ValueError(f"trace {path} line {line}: {mapping['arrival']} = {cells['arrival']}: "
                             f"{'has' if offset else 'has no'} UTC offset, line {first_offset[0]}'s date "
                             f"{'has one' if first_offset[1] else 'has none'}; give every date an offset, or none")
        tokens = {}
        for field in ("prompt_tokens", "output_tokens"):
            count = _token_count(cells[field])
            if count is None or not 0 <= count <= MAX_TRACE_TOKENS:
                raise ValueError(f"trace {path} line {line}: {mapping[field]} = {cells[field] or '(blank)'}: must be "
                                 f"an integer in [0, {MAX_TRACE_TOKENS}] (0-token rows are skipped)")
            tokens[field] = count
        if tokens["prompt_tokens"] == 0 or tokens["output_tokens"] == 0:
            skipped += 1
            continue
        arrivals.append(arrival)
        prompts.append(tokens["prompt_tokens"])
        outputs.append(tokens["output_tokens"])
    _check_timestamps(path, mapping["arrival"], mapping["timestamps"], earliest, latest)
    arrival_s = np.asarray(arrivals, dtype=float)
    order = np.argsort(arrival_s, kind="stable")
    arrival_s = arrival_s[order]
    prompt_tokens = np.asarray(prompts, dtype=np.int64)[order]
    output_tokens = np.asarray(outputs, dtype=np.int64)[order]
    prompt_tokens, output_tokens, keep, too_long_requests = _fit_context(prompt_tokens, output_tokens, max_context,
                                                                         too_long, requests, path)
    arrival_s, prompt_tokens, output_tokens = arrival_s[keep], prompt_tokens[keep], output_tokens[keep]
    arrival_s = arrival_s - (arrival_s.min() if len(arrival_s) else 0.0)
    trace = Trace(arrival_s, prompt_tokens, output_tokens)
    if rate is not None:
        try:
            trace = trace.with_rate(rate)
        except ValueError as exc:
            raise ValueError(f"trace {path}: {exc}") from None
    return LoadedTrace(trace, rows, skipped, layout, mapping, too_long, too_long_requests)


def token_statistics(tokens: np.ndarray) -> dict:
    """Total, mean, the linear percentiles the report quotes, and the range of token counts."""
    return {"total": int(tokens.sum()), "mean": float(tokens.mean()), "p50": float(np.percentile(tokens, 50)),
            "p90": float(np.percentile(tokens, 90)), "p99": float(np.percentile(tokens, 99)),
            "min": int(tokens.min()), "max": int(tokens.max())}


def describe(spec: dict) -> dict:
    """What a workload spec with a trace file replays: the file as read (its layout and columns, rows
    read and rows skipped for 0 tokens, its own time span and mean rate) and how the pipeline replays it
    (at spec["rate"] as today's load: every arrival gap scaled by the file's rate over that rate).
    Requests longer than the context are counted by the trace's too_long policy, among the rows up to
    the last one replayed. A spec without a trace draws Poisson traffic, described by the spec itself."""
    if not spec.get("trace"):
        return {"kind": "poisson", "num_requests": int(spec["num_requests"]), "rate_rps": float(spec["rate"])}
    settings = spec["trace"]
    # the file's own arrivals, before any rescaling, are what its span and rate describe
    loaded = load_trace(**{key: value for key, value in settings.items() if key != "rate"})
    trace = loaded.trace
    file_rate = trace.mean_rate_rps
    replay_rate = float(spec["rate"])
    gap_scale = None if file_rate is None else file_rate / replay_rate
    return {
        "kind": "trace", "file": Path(settings["path"]).name, "layout": loaded.layout, "columns": loaded.columns,
        "rows": loaded.rows, "skipped_zero_tokens": loaded.skipped_zero_tokens,
        "too_long": loaded.too_long, "too_long_requests": loaded.too_long_requests,
        "max_context": settings.get("max_context"), "first_requests": settings.get("requests"),
        "requests": len(trace),
        "span_s": trace.duration_s, "file_rate_rps": file_rate, "replay_rate_rps": replay_rate,
        "gap_scale": gap_scale,
        # within 0.1% the gaps are the logged ones: the report says so instead of quoting a factor of 1
        "replayed_as_logged": gap_scale is not None and abs(gap_scale - 1) < 1e-3,
        "replayed_span_s": len(trace) / replay_rate,
        "prompt_tokens": token_statistics(trace.prompt_tokens), "output_tokens": token_statistics(trace.output_tokens),
    }


# The capstone: 600 requests at 6/s. The source gives prompt lengths only as a range, so they are
# uniform over it; replies are lognormal clipped to 8..256 with the mean the source's total implies
# (48,136 tokens / 600 = 80.2 per reply; a uniform 8..256 would give ~79,000 tokens).
CAPSTONE = {
    "num_requests": 600, "rate": 6.0,
    "prompt": {"dist": "uniform", "min": 16, "max": 512},
    "output": {"dist": "lognormal", "mean": 80.2, "sigma": 0.8, "min": 8, "max": 256},
}

# Exercise 2: 20/s, prompts averaging ~550 tokens, replies lognormal with mean ~165 and a tail past 1,000.
EXERCISE2 = {
    "num_requests": 2000, "rate": 20.0,
    "prompt": {"dist": "lognormal", "mean": 550, "sigma": 0.4, "min": 64, "max": 2048},
    "output": {"dist": "lognormal", "mean": 165, "sigma": 1.0, "min": 1, "max": 2048},
}

PRESETS = {"capstone": CAPSTONE, "exercise2": EXERCISE2}
