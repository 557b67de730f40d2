"""The one registry of scheduling policies. The scheduler implements each name; the config schema's
allowed values, the rules' wildcard, the report's labels, colours and markers all read this list, so
adding a policy means a scheduling method in scheduler.py and an entry here, nothing else."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Policy:
    name: str
    label: str          # how the report names it in prose and legends
    color: str          # from the Okabe-Ito palette, distinguishable with any colour vision
    marker: str
    # the policy this one refines by splitting prompts into chunks, for the inter-token comparison
    unchunked: str | None = None


# in the report's order: from the simplest scheduler to the most refined
REGISTRY = (
    Policy("static", "static batching", "#999999", "s"),
    Policy("continuous", "continuous batching", "#0072B2", "o"),
    Policy("continuous_chunked", "continuous + chunked prefill", "#D55E00", "^", unchunked="continuous"),
    # llama-server's own scheduler (servingplan/simulate/llamacpp_slots.py): chunk_size is its n_batch
    Policy("llamacpp", "llama.cpp server slots", "#009E73", "D"),
)
BY_NAME = {p.name: p for p in REGISTRY}
POLICIES = tuple(BY_NAME)

# What a chunking policy's per-step budget (its chunk size) counts. The first is the default: the
# source's chunked prefill, whose prompt chunks ride along with the decodes.
CHUNK_BUDGETS = {
    "prompt_tokens": "prompt tokens only (the source's chunked prefill: each step's decodes ride along outside "
                     "the chunk)",
    "step_tokens": "every token of the step, one per decoding sequence included (vLLM's max_num_batched_tokens, "
                   "Sarathi-Serve)",
}
DEFAULT_CHUNK_BUDGET = "prompt_tokens"


def chunk_budget(sweep: dict) -> str:
    """The config's sweep.chunk_budget (optional: absent means the default)."""
    return sweep.get("chunk_budget", DEFAULT_CHUNK_BUDGET)


def chunks(name: str) -> bool:
    """Does the policy split prompts into chunks under a per-step token budget?"""
    return BY_NAME[name].unchunked is not None


def label(name: str) -> str:
    return BY_NAME[name].label if name in BY_NAME else name


def order(name: str) -> int:
    return POLICIES.index(name) if name in BY_NAME else len(POLICIES)


def wildcard() -> str:
    """The Snakemake wildcard constraint matching exactly the registered names."""
    return "|".join(sorted(POLICIES, key=len, reverse=True))
