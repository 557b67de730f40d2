"""Step-time cost model: how long one engine step takes for a given batch.

A step runs one batched decode call for the sequences that are decoding, plus one prefill call
per sequence that is processing prompt tokens (a whole prompt or one chunk of it):

    t_step = [B > 0] * (f(B) + c*ctx_read)
             + sum_i (p0 + p1*L_i + p2*L_i**2 + p3*L_i*P_i)

B is the number of decoding sequences, ctx_read the KV tokens the decode call reads (the sum of
their context lengths, or B times the longest when the engine pads, `ctx_mode`), L_i the prompt
tokens of prefill call i and P_i the tokens of that prompt already in the cache (earlier chunks).

f(B), the batch-dependent part of a decode step, is the line a + b*B unless the model carries a
per-batch table (batch, seconds): then f is the table, linearly interpolated between its batches,
held at its first value below the smallest batch, and continued with slope b beyond the largest
(table[-1] + b*(B - B_last)). CPU kernels change with the batch size, so the measured f(B) is not a
line at small batches. The context term stays linear in either case, so a run of decode steps at a
fixed batch still grows by c*B per step (the simulator's fast-forward relies on it).

The JSON contract (written by the fit stage, read by the simulator), published as
schemas/costmodel.schema.json; every key is listed there, so a misspelled one is refused:

    {"schema_version": 1, "name": str, "source": str,
     "decode":  {"fixed_s": a, "per_seq_s": b, "per_ctx_token_s": c, "ctx_mode": "sum"|"padded_max",
                 "batch_fixed_s": {"batches": [B, ...], "fixed_s": [f(B), ...]}},   # optional
     "prefill": {"fixed_s": p0, "per_token_s": p1, "per_token_sq_s": p2, "per_token_ctx_s": p3},
     "meta": {...}}
"""
from __future__ import annotations

import difflib
import json
import math
from bisect import bisect_left
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path

from servingplan.io import parse_json, read_text_input

SCHEMA_VERSION = 1
CTX_MODES = ("sum", "padded_max")
# An hour per token, per sequence or per call is no machine's cost; past it products overflow.
MAX_COEFFICIENT_S = 3600.0
DECODE_KEYS = ("fixed_s", "per_seq_s", "per_ctx_token_s")
PREFILL_KEYS = ("fixed_s", "per_token_s", "per_token_sq_s", "per_token_ctx_s")
OPTIONAL_PREFILL_KEYS = ("per_token_sq_s", "per_token_ctx_s")
MAX_TABLE_BATCH = 1 << 20
SCHEMA_PATH = Path(__file__).resolve().parent.parent / "schemas" / "costmodel.schema.json"
# a cost model is a few hundred bytes; a profile's meta with every fit detail stays far below this
MAX_FILE_BYTES = 1 << 20
# the meta keys the pipeline reads (the rest of meta is provenance it carries along), and how close
# another key's spelling must come to one of them to be taken for its misspelling (speed_bnad: 0.9,
# profile_range: 0.96; the fit's own keys, machine_fingerprint or heldout_mape, stay far below)
READ_META_KEYS = ("speed_band", "profiled_range")
META_TYPO_SIMILARITY = 0.8
BAND_KINDS = ("decode", "prefill")


@dataclass(frozen=True)
class CostModel:
    decode_fixed_s: float
    decode_per_seq_s: float
    decode_per_ctx_token_s: float
    prefill_fixed_s: float
    prefill_per_token_s: float
    prefill_per_token_sq_s: float = 0.0
    prefill_per_token_ctx_s: float = 0.0
    ctx_mode: str = "sum"
    name: str = "custom"
    source: str = ""
    meta: dict = field(default_factory=dict, compare=False)
    decode_batch_fixed_s: tuple = ()  # ((batch, seconds), ...): f(B) measured per batch; empty = the line

    def __post_init__(self):
        if self.ctx_mode not in CTX_MODES:
            raise ValueError(f"cost model ctx_mode={self.ctx_mode!r}: allowed {CTX_MODES}")
        table = tuple(sorted((int(b), float(s)) for b, s in self.decode_batch_fixed_s))
        batches = tuple(b for b, _ in table)
        if any(b < 1 for b in batches) or len(set(batches)) < len(batches):
            raise ValueError(f"cost model decode_batch_fixed_s batches {list(batches)}: need distinct batches >= 1")
        # Normalised so equality and JSON do not depend on the input's order or container types; the
        # split columns are what decode_time bisects on every simulated step.
        object.__setattr__(self, "decode_batch_fixed_s", table)
        object.__setattr__(self, "_table_batches", batches)
        object.__setattr__(self, "_table_seconds", tuple(s for _, s in table))

    def decode_batch_time(self, batch: int) -> float:
        """f(B): the part of a decode step that depends on the batch size alone."""
        batches = self._table_batches
        if not batches:
            return self.decode_fixed_s + self.decode_per_seq_s * batch
        seconds = self._table_seconds
        i = bisect_left(batches, batch)
        if i == len(batches):
            return seconds[-1] + self.decode_per_seq_s * (batch - batches[-1])
        if batches[i] == batch or i == 0:
            return seconds[i]
        share = (batch - batches[i - 1]) / (batches[i] - batches[i - 1])
        return seconds[i - 1] + share * (seconds[i] - seconds[i - 1])

    def decode_time(self, batch: int, ctx_sum: float, ctx_max: float = 0.0) -> float:
        if batch <= 0:
            return 0.0
        ctx = batch * ctx_max if self.ctx_mode == "padded_max" else ctx_sum
        return self.decode_batch_time(batch) + self.decode_per_ctx_token_s * ctx

    def prefill_time(self, tokens: int, cached: int = 0) -> float:
        if tokens <= 0:
            return 0.0
        return (self.prefill_fixed_s + self.prefill_per_token_s * tokens
                + self.prefill_per_token_sq_s * tokens * tokens
                + self.prefill_per_token_ctx_s * tokens * cached)

    def step_time(self, batch: int, ctx_sum: float, prefills=(), ctx_max: float = 0.0) -> float:
        """`prefills` is an iterable of (tokens, cached) pairs, one per prefill call."""
        return self.decode_time(batch, ctx_sum, ctx_max) + sum(self.prefill_time(l, p) for l, p in prefills)

    def scaled(self, speedup: float) -> "CostModel":
        """The same machine made `speedup` times faster on every term."""
        return self.slowed(1.0 / speedup, 1.0 / speedup, f"{self.name} x{speedup:g}")

    def slowed(self, decode: float, prefill: float, name: str | None = None) -> "CostModel":
        """Every decode term multiplied by `decode` and every prefill term by `prefill`: the machine
        running that much slower (a factor above one) on each kind of call."""
        return CostModel(self.decode_fixed_s * decode, self.decode_per_seq_s * decode,
                         self.decode_per_ctx_token_s * decode, self.prefill_fixed_s * prefill,
                         self.prefill_per_token_s * prefill, self.prefill_per_token_sq_s * prefill,
                         self.prefill_per_token_ctx_s * prefill, self.ctx_mode,
                         name or f"{self.name} decode x{decode:g} prefill x{prefill:g}", self.source,
                         dict(self.meta), tuple((b, s * decode) for b, s in self.decode_batch_fixed_s))

    def to_dict(self) -> dict:
        decode = {"fixed_s": self.decode_fixed_s, "per_seq_s": self.decode_per_seq_s,
                  "per_ctx_token_s": self.decode_per_ctx_token_s, "ctx_mode": self.ctx_mode}
        if self.decode_batch_fixed_s:
            decode["batch_fixed_s"] = {"batches": list(self._table_batches), "fixed_s": list(self._table_seconds)}
        return {
            "schema_version": SCHEMA_VERSION, "name": self.name, "source": self.source,
            "decode": decode,
            "prefill": {"fixed_s": self.prefill_fixed_s, "per_token_s": self.prefill_per_token_s,
                        "per_token_sq_s": self.prefill_per_token_sq_s,
                        "per_token_ctx_s": self.prefill_per_token_ctx_s},
            "meta": self.meta,
        }

    @classmethod
    def from_dict(cls, d: dict, schema: bool = True) -> "CostModel":
        """The model a JSON document describes, after `validate` found nothing wrong with it."""
        validate(d, schema)
        dec, pre = d["decode"], d["prefill"]
        table = dec.get("batch_fixed_s", {"batches": [], "fixed_s": []})
        return cls(float(dec["fixed_s"]), float(dec["per_seq_s"]), float(dec["per_ctx_token_s"]),
                   float(pre["fixed_s"]), float(pre["per_token_s"]), float(pre.get("per_token_sq_s", 0.0)),
                   float(pre.get("per_token_ctx_s", 0.0)), dec.get("ctx_mode", "sum"),
                   d.get("name", "custom"), d.get("source", ""), d.get("meta", {}),
                   tuple(zip(table["batches"], table["fixed_s"])))

    def save(self, path) -> None:
        from servingplan.io import write_json
        write_json(path, self.to_dict())


# The analytic curve of Exercise 2: a 5 ms weight-streaming floor per step, 43 ns per KV token read
# (0.086 ms per sequence at a 2,000-token context), and 47 us of compute per prefill token. Prefill
# chunks ride along with the decode step, so a prefill call adds no fixed cost of its own.
EXERCISE2 = CostModel(
    decode_fixed_s=5.0e-3, decode_per_seq_s=0.0, decode_per_ctx_token_s=0.086e-3 / 2000,
    prefill_fixed_s=0.0, prefill_per_token_s=47e-6, name="exercise2",
    source="analytic curve of Exercise 2 (not a measurement)",
)

PRESETS = {"exercise2": EXERCISE2}


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _coefficient(where: str, value) -> float:
    if not _is_number(value):
        raise ValueError(f"cost model {where} = {value!r}: must be a number (seconds)")
    if not math.isfinite(value) or not 0.0 <= value <= MAX_COEFFICIENT_S:
        raise ValueError(f"cost model {where} = {value!r}: must be a finite number of seconds in "
                         f"[0, {MAX_COEFFICIENT_S:g}]")
    return float(value)


def _section(d: dict, name: str) -> dict:
    section = d.get(name)
    if not isinstance(section, dict):
        raise ValueError(f"cost model {name} = {section!r}: must be an object with keys "
                         f"{', '.join(DECODE_KEYS if name == 'decode' else PREFILL_KEYS)}")
    return section


def _check_speed_band(band) -> None:
    """meta.speed_band, which the capacity stage reads when present: per kind of call, the factors by
    which the machine ran faster and slower than typical (servingplan.simulate.capacity.speed_band_models),
    for both kinds or neither (the capacity stage uses a band only with both)."""
    if band is None:
        return
    if isinstance(band, dict):
        _check_meta_keys(band, "meta.speed_band", BAND_KINDS)
    if isinstance(band, dict) and band and set(band) & set(BAND_KINDS) != set(BAND_KINDS):
        missing = [kind for kind in BAND_KINDS if kind not in band]
        raise ValueError(f"cost model meta.speed_band = {_short(band)}: has no {missing[0]}; give a band for both "
                         f"{' and '.join(BAND_KINDS)} (the capacity stage uses one only with both) or neither")
    ok = isinstance(band, dict) and all(
        isinstance(band[kind], list) and len(band[kind]) == 2 and all(
            _is_number(v) and math.isfinite(v) and 0 < v <= MAX_COEFFICIENT_S for v in band[kind])
        for kind in ("decode", "prefill") if kind in band)
    if not ok:
        raise ValueError(f"cost model meta.speed_band = {band!r}: must be an object whose decode and prefill "
                         "are each [fastest, slowest], time factors > 0")
    for kind in ("decode", "prefill"):
        if kind in band and band[kind][0] > band[kind][1]:
            raise ValueError(f"cost model meta.speed_band.{kind} = {band[kind]!r}: must be [fastest, slowest], the "
                             "smaller time factor first")


def _check_profiled_range(ranges) -> None:
    """meta.profiled_range, which serving_sim reads to warn of extrapolated step times: each range
    [low, high] of token counts with low <= high (the schema checks the types and bounds)."""
    for key, pair in (ranges or {}).items() if isinstance(ranges, dict) else ():
        if isinstance(pair, list) and len(pair) == 2 and all(_is_number(v) for v in pair) and pair[0] > pair[1]:
            raise ValueError(f"cost model meta.profiled_range.{key} = {pair!r}: must be [low, high], the smaller "
                             "count first")


def _check_meta_keys(meta: dict, where: str = "meta", read=READ_META_KEYS) -> None:
    """meta is free-form provenance (and a speed band may carry kinds of call beside the two read), but
    a key one or two letters from one the pipeline reads is that key misspelled: ignored, it would
    silently drop the speed band, the profiled range or a band's decode or prefill."""
    for key in meta:
        nearest = difflib.get_close_matches(str(key), read, n=1, cutoff=META_TYPO_SIMILARITY)
        if nearest and key != nearest[0]:
            raise ValueError(f"cost model {where}.{key} is not a key the pipeline reads; did you mean "
                             f"{where}.{nearest[0]}? (read: {', '.join(read)}; see schemas/costmodel.schema.json)")


@lru_cache(maxsize=1)
def _schema_validator():
    import jsonschema   # here, not at the top: read_written's callers never need it
    # JSON Schema counts true as no integer but 1.0 as one; a schema_version or batch must be written as one
    strict = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda checker, instance: isinstance(instance, int) and not isinstance(instance, bool))
    validator = jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=strict)
    return validator(json.loads(SCHEMA_PATH.read_text()))


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _unknown_key(error) -> str:
    """A key the schema does not list, named with the nearest key it does (a misspelling, usually)."""
    allowed = sorted(error.schema.get("properties", {}))
    extra = sorted(set(error.instance) - set(allowed))[0]
    where = "".join(f"{part}." for part in error.absolute_path)
    # a key cut short (ctx_mod, per_token_sq) means the key it begins; otherwise the most similar one
    nearest = [key for key in allowed if key.startswith(str(extra))][:1] or difflib.get_close_matches(
        str(extra), allowed, n=1, cutoff=0.6)
    hint = f"did you mean {where}{nearest[0]}? " if nearest else ""
    return (f"cost model {where}{extra} is not a known key; {hint}allowed here: {', '.join(allowed)} "
            "(see schemas/costmodel.schema.json)")


def _schema_errors(d) -> list:
    return sorted(_schema_validator().iter_errors(d), key=lambda e: list(map(str, e.absolute_path)))


def validate(d, schema: bool = True) -> None:
    """Raise ValueError, one line naming the field, its value and what is allowed, unless `d` is a
    cost-model document (the JSON contract above) whose every step takes a finite, positive time:
    coefficients finite and non-negative, a decode step and a prefill call never free. Without `schema`
    only the value checks run (read_written)."""
    if not isinstance(d, dict):
        kind = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(d), "a number")
        raise ValueError(f"cost model: the document is {kind}, must be a JSON object with schema_version, "
                         "decode and prefill")
    errors = _schema_errors(d) if schema else []
    unknown = [error for error in errors if error.validator == "additionalProperties"]
    if unknown:
        raise ValueError(_unknown_key(unknown[0]))
    if d.get("schema_version") != SCHEMA_VERSION or isinstance(d.get("schema_version"), bool):
        raise ValueError(f"cost model schema_version={d.get('schema_version')!r}: expected {SCHEMA_VERSION}")
    dec, pre = _section(d, "decode"), _section(d, "prefill")
    for name, section, keys in (("decode", dec, DECODE_KEYS), ("prefill", pre, PREFILL_KEYS)):
        for key in keys:
            if key not in section and key not in OPTIONAL_PREFILL_KEYS:
                raise ValueError(f"cost model {name}.{key} is missing (required: {', '.join(keys)})")
            if key in section:
                _coefficient(f"{name}.{key}", section[key])
    if dec.get("ctx_mode", "sum") not in CTX_MODES:
        raise ValueError(f"cost model decode.ctx_mode = {dec['ctx_mode']!r}: allowed {', '.join(CTX_MODES)}")
    for key in ("name", "source"):
        if not isinstance(d.get(key, ""), str):
            raise ValueError(f"cost model {key} = {d[key]!r}: must be a string")
    if not isinstance(d.get("meta", {}), dict):
        raise ValueError(f"cost model meta = {_short(d['meta'])}: must be an object")
    _check_meta_keys(d.get("meta", {}))
    _check_speed_band(d.get("meta", {}).get("speed_band"))
    _check_profiled_range(d.get("meta", {}).get("profiled_range"))
    table = dec.get("batch_fixed_s", {"batches": [], "fixed_s": []})
    if not isinstance(table, dict) or not all(isinstance(table.get(k), list) for k in ("batches", "fixed_s")):
        raise ValueError(f"cost model decode.batch_fixed_s = {table!r}: must be an object with lists "
                         "batches and fixed_s")
    batches, seconds = table["batches"], table["fixed_s"]
    if len(batches) != len(seconds):
        raise ValueError("cost model decode.batch_fixed_s: batches and fixed_s differ in length "
                         f"({len(batches)} and {len(seconds)})")
    for batch in batches:
        if not isinstance(batch, int) or isinstance(batch, bool) or not 1 <= batch <= MAX_TABLE_BATCH:
            raise ValueError(f"cost model decode.batch_fixed_s.batches item {batch!r}: must be an integer "
                             f"in [1, {MAX_TABLE_BATCH}]")
    if len(set(batches)) < len(batches):
        raise ValueError(f"cost model decode.batch_fixed_s.batches = {batches}: must be distinct")
    for i, value in enumerate(seconds):
        _coefficient(f"decode.batch_fixed_s.fixed_s[{i}]", value)
    # Every decode step reads at least one KV token per sequence; every prefill call has a token.
    per_ctx = dec["per_ctx_token_s"]
    smallest_batch_part = min(seconds) if seconds else dec["fixed_s"] + dec["per_seq_s"]
    if smallest_batch_part + per_ctx <= 0:
        raise ValueError("cost model decode: fixed_s + per_seq_s (or the smallest batch_fixed_s entry) + "
                         "per_ctx_token_s = 0: a decode step would take no time; one of them must be > 0")
    if sum(pre.get(key, 0.0) for key in ("fixed_s", "per_token_s", "per_token_sq_s")) <= 0:
        raise ValueError("cost model prefill: fixed_s + per_token_s + per_token_sq_s = 0: a prefill call "
                         "would take no time; one of them must be > 0")
    if errors:
        # what the checks above do not name (a name too long, a table too long) the schema does
        import jsonschema
        error = jsonschema.exceptions.best_match(errors)
        where = ".".join(map(str, error.absolute_path)) or "(document)"
        raise ValueError(f"cost model {where} = {_short(error.instance)}: {' '.join(error.message.split())[:200]} "
                         "(see schemas/costmodel.schema.json)")


def read_file(path: str | Path, schema: bool = True) -> CostModel:
    """The cost model a JSON file holds (config `costmodel.source`); ValueError, one line naming the
    file and what is wrong with it, for a file that is missing, not JSON or not the contract above
    (without `schema`, its value checks alone: read_written)."""
    document = parse_json(read_text_input(path, "cost model", MAX_FILE_BYTES), repr(str(path)))
    try:
        return CostModel.from_dict(document, schema)
    except ValueError as exc:
        raise ValueError(f"{str(path)!r}: {exc}") from None


def read_written(path: str | Path) -> CostModel:
    """A cost model this pipeline wrote under results/ (the fit, the carry-over or import_costmodel,
    which read the user's file with read_file): `save` writes the contract's form, so the schema pass is
    left out and only the value checks run. That pass would cost each of a run's simulation jobs (about
    170) a fifth of a CPU-second importing jsonschema."""
    return read_file(path, schema=False)


def load(spec: str | Path) -> CostModel:
    """A preset name or the path of a cost-model JSON file."""
    if str(spec) in PRESETS:
        return PRESETS[str(spec)]
    if not Path(spec).exists():
        raise ValueError(f"cost model {str(spec)!r}: not a preset ({', '.join(PRESETS)}) nor a JSON file")
    try:
        return read_file(spec)
    except ValueError as exc:
        # the caller names the file; say what is wrong with it once
        raise ValueError(str(exc).removeprefix(f"{str(spec)!r}: ")) from None


def decode_curve(model: CostModel, batches, context: int) -> list[dict]:
    """Decode step latency and throughput per batch size at a fixed per-sequence context."""
    rows = []
    for b in batches:
        t = model.decode_time(b, b * context, context)
        rows.append({"batch": b, "step_ms": t * 1e3, "tokens_per_s": b / t})
    return rows
