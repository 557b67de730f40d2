"""GPT-2 shapes known before any model is built: weight and KV-cache sizes from the architecture alone.

Imports nothing heavy (no torch, no transformers), so the config check can size the model before the
pipeline starts any work. tests/test_architecture.py holds these figures against the model that
servingplan.profile.model really builds.
"""
from __future__ import annotations

import json
from pathlib import Path

from servingplan import memory

FLOAT32_BYTES = 4

# transformers' GPT2Config() defaults: GPT-2 small
GPT2_SMALL = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
              "n_inner": None}

# A GPT-2 shaped model small enough that a whole profile takes seconds: tests and CI use it.
QUICK_CONFIG_OVERRIDES = {"n_layer": 2, "n_embd": 64, "n_head": 2}


def architecture(model_cfg: dict) -> dict:
    """The shape of the model a config's `model` section loads: GPT-2 small, its tiny variant, or the
    config.json of a local checkpoint (keys it omits take GPT2Config's defaults, as transformers does)."""
    if model_cfg.get("tiny", False) or model_cfg["source"] == "random":
        overrides = QUICK_CONFIG_OVERRIDES if model_cfg.get("tiny", False) else {}
        return {**GPT2_SMALL, **overrides}
    stored = json.loads((Path(model_cfg["source"]) / "config.json").read_text())
    if not isinstance(stored, dict):
        raise ValueError("config.json is not a JSON object")
    arch = {key: stored.get(key, default) for key, default in GPT2_SMALL.items()}
    for key, value in arch.items():
        if not (isinstance(value, int) and value >= 1 or key == "n_inner" and value is None):
            raise ValueError(f"{key} = {value!r}: must be a positive integer")
    return arch


def weight_count(arch: dict) -> int:
    """Parameters of GPT2LMHeadModel, the LM head counted once (it is tied to the token embedding)."""
    e = arch["n_embd"]
    inner = arch["n_inner"] or 4 * e
    # ln_1, attention (qkv + projection), ln_2, MLP (up + down), each with its bias
    per_layer = 2 * e + (3 * e * e + 3 * e) + (e * e + e) + 2 * e + (e * inner + inner) + (inner * e + e)
    return arch["vocab_size"] * e + arch["n_positions"] * e + arch["n_layer"] * per_layer + 2 * e


def weight_bytes(arch: dict) -> int:
    return FLOAT32_BYTES * weight_count(arch)


def kv_bytes_per_token(arch: dict) -> int:
    return memory.kv_bytes_per_token(arch["n_layer"], arch["n_embd"], FLOAT32_BYTES)


def unmeasured_sizes(model_cfg: dict) -> dict:
    """For a run whose cost model was imported instead of profiled here: the `model` and `memory`
    entries the planner reads from a profile's machine.json, derived from the architecture alone, and
    `measured: false`, since no machine was measured (no process memory, no speed, no roofline)."""
    arch = architecture(model_cfg)
    tiny = model_cfg.get("tiny", False)
    source = "random" if tiny else model_cfg["source"]
    kv_per_token = kv_bytes_per_token(arch)
    return {
        "measured": False,
        "model": {"source": source, "random_weights": source == "random",
                  "config_overrides": dict(QUICK_CONFIG_OVERRIDES) if tiny else {}, "dtype": "float32",
                  "param_count": weight_count(arch), "param_bytes": weight_bytes(arch),
                  **{key: arch[key] for key in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size")}},
        "memory": {"param_bytes": weight_bytes(arch), "kv_bytes_per_token": kv_per_token,
                   "kv_bytes_per_token_expected": kv_per_token, "rss_after_load_bytes": None, "peak_rss_bytes": None},
    }
