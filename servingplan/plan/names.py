"""The one place a code name (a cost-model term, a profile kind, a policy, an axis, a machine) gets the
name a reader sees. Every label, heading and sentence of the report goes through `display`; a code name
with no entry raises, so a new term or kind cannot leak into the report unnoticed."""
from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from ..simulate.fleet import ROUTERS
from ..simulate.policies import REGISTRY

# the step-time model's coefficients (servingplan/costmodel.py), by what each one pays for
TERMS = {
    "decode_fixed_s": "decode step overhead (per step)",
    "decode_per_seq_s": "decode cost per sequence in the batch",
    "decode_per_ctx_token_s": "decode cost per cached context token (attention reads)",
    "decode_batch_fixed_s": "decode step overhead at each measured batch size",
    "prefill_fixed_s": "prefill overhead (per prompt)",
    "prefill_per_token_s": "prefill cost per prompt token",
    "prefill_per_token_sq_s": "prefill attention cost per prompt token squared",
    "prefill_per_token_ctx_s": "prefill cost per prompt token per cached context token",
}

# the kinds of point the profiler times (servingplan/profile/measure.py)
PROFILE_KINDS = {
    "prefill": "prefill (one prompt)",
    "prefill_cached": "prefill after a cached context (a later chunk)",
    "prefill_batch": "batched prefill (several prompts in one step)",
    "decode": "decode step",
}

# the fit's residual structure: one mean signed error per part and axis (servingplan/fit/step_model.py)
RESIDUAL_AXES = {
    "prefill_by_prompt_len": "prefill error by prompt length",
    "prefill_by_cached": "prefill error by cached context",
    "decode_by_batch": "decode error by batch size",
    "decode_by_cached": "decode error by context length",
}

AXES = {
    "max_num_seqs": "batch cap (max concurrent sequences)",
    "cap": "batch cap (max concurrent sequences)",
    "batch": "batch size (sequences per step)",
    "prompt_len": "prompt length (tokens)",
    "cached": "cached context (tokens)",
    "context": "context length (tokens)",
    "chunk_size": "prefill chunk size (tokens)",
    "rate": "arrival rate (requests/s)",
    "replicas": "replicas (machines)",
    "ttft": "time to first token",
    "tpot": "time per output token",
    "itl": "inter-token latency",
    "e2e": "end-to-end latency",
    "goodput": "goodput (requests/s meeting every SLO)",
    "attainment": "SLO attainment (share of requests meeting every SLO)",
}

POLICIES = {policy.name: policy.label for policy in REGISTRY}

ROUTER_NAMES = {"round_robin": "round-robin router", "join_shortest_queue": "join-shortest-queue router"}

# the name servingplan/plan/hardware.py gives the machine the pipeline runs on
THIS_MACHINE = "this machine"


def _merged() -> dict[str, str]:
    merged: dict[str, str] = {THIS_MACHINE: THIS_MACHINE}
    for table in (TERMS, PROFILE_KINDS, RESIDUAL_AXES, AXES, POLICIES, ROUTER_NAMES):
        for code, name in table.items():
            if merged.get(code, name) != name:
                raise ValueError(f"display name of {code!r} declared twice: {merged[code]!r} and {name!r}")
            merged[code] = name
    return merged


NAMES = _merged()
if set(ROUTERS) != set(ROUTER_NAMES):
    raise ValueError(f"router display names {sorted(ROUTER_NAMES)} differ from the routers {sorted(ROUTERS)}")

# acronyms a hardware name spells in lower case
_ACRONYMS = {"nvidia": "NVIDIA", "amd": "AMD", "cpu": "CPU", "gpu": "GPU", "tpu": "TPU", "ram": "RAM",
             "hbm": "HBM", "sxm": "SXM", "pcie": "PCIe", "gb": "GB", "aws": "AWS", "gcp": "GCP"}
# a model number: letters then digits (t4, a100) or digits then letters (7840u)
_MODEL_NUMBER = re.compile(r"[a-z]{1,2}\d+[a-z]?|\d+[a-z]{1,2}")


def readable_machine(name: str) -> str:
    """A hardware name made readable when its config entry has no description: words split at - and _,
    acronyms and model numbers upper-cased (nvidia-t4 -> NVIDIA T4, laptop-ryzen7-7840u -> Laptop Ryzen7
    7840U)."""
    words = [w for w in re.split(r"[-_\s]+", name) if w]
    if not words:
        raise KeyError(f"machine name {name!r}: empty")

    def word(w: str) -> str:
        lower = w.lower()
        if lower in _ACRONYMS:
            return _ACRONYMS[lower]
        if _MODEL_NUMBER.fullmatch(lower):
            return lower.upper()
        return w[:1].upper() + w[1:]
    return " ".join(word(w) for w in words)


def machine(entry: Mapping) -> str:
    """A config `hardware:` entry's display name: its description if it gives one, else its name made
    readable."""
    description = entry.get("description")
    return description if description else readable_machine(entry["name"])


def brief(text: str) -> str:
    """A display name without its parenthesised detail, for axis ticks and legends where a machine's full
    description does not fit ("NVIDIA T4 GPU (published spec: ...)" -> "NVIDIA T4 GPU")."""
    return text.split(" (", 1)[0]


def display(code_name: str, hardware: Iterable[Mapping] = ()) -> str:
    """The name a reader sees for `code_name`. `hardware` is the config's `hardware:` list: a machine name
    found there reads as its description (or a readable form of its name). Raises KeyError for a name with
    no entry, so a test catches a missing one before a code name reaches the report."""
    for entry in hardware:
        if entry["name"] == code_name:
            return machine(entry)
    try:
        return NAMES[code_name]
    except KeyError:
        raise KeyError(f"no display name for {code_name!r}: add it to servingplan/plan/names.py") from None
