"""Configuration validation: every value is checked before any work starts.

A bad value gives one line naming the key, the value and what is allowed, and exit code 2.
"""
from __future__ import annotations

import sys
from pathlib import Path

import jsonschema
import yaml

from servingplan.sim.policies import POLICIES

ROOT = Path(__file__).resolve().parent.parent
SCHEMA_PATH = ROOT / "schemas" / "config.schema.yaml"


class ConfigError(ValueError):
    pass


def _key(path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def _allowed(error: jsonschema.ValidationError) -> str:
    v, kind = error.validator_value, error.validator
    if kind == "minimum":
        return f"must be >= {v}"
    if kind == "exclusiveMinimum":
        return f"must be > {v}"
    if kind == "maximum":
        return f"must be <= {v}"
    if kind == "exclusiveMaximum":
        return f"must be < {v}"
    if kind == "enum":
        return "allowed: " + ", ".join(map(str, v))
    if kind == "type":
        return f"must be of type {v}"
    if kind in ("minItems", "maxItems"):
        return f"needs {'at least' if kind == 'minItems' else 'at most'} {v} items"
    if kind in ("minLength", "maxLength"):
        return f"length must be {'>=' if kind == 'minLength' else '<='} {v}"
    if kind == "uniqueItems":
        return "items must be unique"
    return error.message


def _schema_error(error: jsonschema.ValidationError, schema: dict) -> str:
    if error.validator == "required":
        missing = [k for k in error.validator_value if k not in error.instance]
        return f"config error: {_key(list(error.absolute_path) + [missing[0]])} is missing (required)"
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed))
        return (f"config error: {_key(list(error.absolute_path) + [extra[0]])} is not a known key "
                f"(allowed: {', '.join(allowed)})")
    return f"config error: {_key(error.absolute_path)} = {error.instance!r}: {_allowed(error)}"


def _check_length(key: str, spec: dict) -> None:
    dist = spec["dist"]
    needed = {"constant": ["value"], "uniform": ["min", "max"], "loguniform": ["min", "max"],
              "lognormal": ["min", "max", "mean", "sigma"]}[dist]
    for name in needed:
        if name not in spec:
            raise ConfigError(f"config error: {key}.{name} is missing (required for dist {dist})")
    if dist != "constant" and spec["min"] > spec["max"]:
        raise ConfigError(f"config error: {key}.min = {spec['min']}: must be <= {key}.max ({spec['max']})")
    if dist == "lognormal" and not spec["min"] < spec["mean"] < spec["max"]:
        raise ConfigError(f"config error: {key}.mean = {spec['mean']}: must lie strictly between "
                          f"min ({spec['min']}) and max ({spec['max']})")


def _longest(spec: dict) -> int:
    return spec["value"] if spec["dist"] == "constant" else spec["max"]


def check(config: dict) -> None:
    """Raise ConfigError with one line for the first bad value."""
    schema = yaml.safe_load(SCHEMA_PATH.read_text())
    schema["definitions"]["policy"]["enum"] = list(POLICIES)
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(config), key=lambda e: (list(map(str, e.absolute_path)), e.validator))
    if errors:
        raise ConfigError(_schema_error(jsonschema.exceptions.best_match(errors), schema))

    for part in ("prompt", "output"):
        _check_length(f"workload.{part}", config["workload"][part])
    p = config["profile"]
    if p["min_repeats"] > p["max_repeats"]:
        raise ConfigError(f"config error: profile.min_repeats = {p['min_repeats']}: must be <= "
                          f"profile.max_repeats ({p['max_repeats']})")
    c = config["capacity"]
    if c["rate_min"] >= c["rate_max"]:
        raise ConfigError(f"config error: capacity.rate_min = {c['rate_min']}: must be < capacity.rate_max "
                          f"({c['rate_max']})")
    longest = _longest(config["workload"]["prompt"]) + _longest(config["workload"]["output"])
    if config["memory"]["max_context"] < longest:
        raise ConfigError(f"config error: memory.max_context = {config['memory']['max_context']}: must cover "
                          f"the longest prompt + reply ({longest})")
    source = config["model"]["source"]
    if source != "random" and not (Path(source) / "config.json").is_file():
        raise ConfigError(f"config error: model.source = {source!r}: must be 'random' or a local directory "
                          "holding a transformers checkpoint (config.json + weights)")


def load(path) -> dict:
    path = Path(path)
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"config error: {path}: cannot be read as YAML ({str(exc).splitlines()[0]})")
    check(config)
    return config


def check_or_exit(config: dict) -> None:
    """For entry points: print the one-line reason and exit 2 instead of a traceback."""
    try:
        check(config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(2)


if __name__ == "__main__":
    try:
        load(sys.argv[1] if len(sys.argv) > 1 else ROOT / "config.yaml")
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        raise SystemExit(2)
    print("config ok")
