"""The one roofline work model: the bytes every cost-model term must move and the FLOPs it must do.

The profiler (each grid point's floor), the fit (each coefficient's floor, which it may not beat) and
the carry-over to other machines (servingplan.plan.hardware) all count work here, so they agree by
construction. Imports nothing heavy: shapes only (servingplan.architecture's GPT-2 dictionaries).

What a term's unit is, and what it cannot avoid, for a GPT-2 shaped model in float32 (e = n_embd,
I = n_inner or 4e, n = n_layer, V = vocab_size), served the way servingplan.profile.kvpool serves it:

FLOPs count the matrix products alone, 2 per multiply-add: per token and layer the attention's
q/k/v product (e x 3e) and output projection (e x e) and the MLP's up (e x I) and down (I x e), 12 e^2
MACs for GPT-2's I = 4e. Biases, LayerNorm, GELU, softmax and the residual adds are O(e) per token and
layer (under 1% of the products) and not GEMM work: leaving them out keeps every floor a lower bound.
The LM head (e x V, tied to the token embedding) runs once per sequence of a call: a decode step needs
the logits of every sequence, and a prefill call asks for the last token's alone (`logits_to_keep=1`).
This is why a prompt token costs 2 x 12 e^2 n = 170 MFLOP for GPT-2 small and a decoding sequence
2 x (12 e^2 n + e V) = 247 MFLOP: the prefill's LM head belongs to the call (prefill_fixed_s), not to
each prompt token, and counting it per token (as hardware.py once did) puts the floor 45% too high.
Attention: a query and a key make a pair, 4 e FLOPs per layer (2 e for the score summed over heads, 2 e
for the weighted value). A prompt chunk of L tokens after P cached ones forms L P pairs with the cache
and L (L + 1) / 2 among its own tokens under the causal mask (a kernel need not compute the masked
half): L^2 / 2 pairs per prefill_per_token_sq_s unit and 1/2 pair per prompt token. A decode step
attends each sequence's new token to its cached tokens (decode_per_ctx_token_s) and to itself (one
pair per sequence, in decode_per_seq_s).

Bytes count what must reach or leave memory: every weight read once per call (all of them but the
position table, of which a call reads only its tokens' rows; the token embedding is read whole as the
LM head), a cached token's keys and values read once per decode call that attends to them, and the
keys and values of each new token written once. Activations, scores and logits can stay in cache (a
fused kernel never writes the L x L scores), and the cached prefix a prefill chunk attends to is read
once per call, which no term of the cost model is per call: leaving these out keeps the floors lower
bounds. So the per-pair prefill terms move no bytes of their own.

A unit of work takes at least max(bytes / bandwidth, FLOPs / float32 rate) on a machine: its roofline
time, or floor; the larger side is the resource that bounds it.
"""
from __future__ import annotations

from dataclasses import dataclass

from servingplan import architecture

GB = 1e9
GFLOP = 1e9
FLOAT32_BYTES = architecture.FLOAT32_BYTES

TERMS = ("decode_fixed_s", "decode_per_seq_s", "decode_per_ctx_token_s", "prefill_fixed_s",
         "prefill_per_token_s", "prefill_per_token_sq_s", "prefill_per_token_ctx_s")
# What each term's floor counts, in words the fit report carries beside the number.
BASIS = {
    "decode_fixed_s": "every weight read once (the position table aside)",
    "decode_per_seq_s": "one token through every layer's products and the LM head, one attention pair with "
                        "itself, its keys and values written",
    "decode_per_ctx_token_s": "one cached token's keys and values read, one attention pair",
    "prefill_fixed_s": "every weight read once (the position table aside), the LM head on the last token",
    "prefill_per_token_s": "one token through every layer's products, half an attention pair (the causal "
                           "diagonal), its keys and values written",
    "prefill_per_token_sq_s": "half an attention pair per squared prompt token (the causal mask's lower "
                              "triangle, L (L + 1) / 2 pairs)",
    "prefill_per_token_ctx_s": "one attention pair between a prompt token and a cached token",
}


@dataclass(frozen=True)
class Work:
    """What one unit of a cost-model term (or one whole call) moves and computes."""
    bytes: float
    flops: float

    def __add__(self, other: "Work") -> "Work":
        return Work(self.bytes + other.bytes, self.flops + other.flops)

    def times(self, count: float) -> "Work":
        return Work(self.bytes * count, self.flops * count)


def architecture_of(model_meta: dict) -> dict:
    """The shape dictionary of a profile's model (machine.json's `model`); a profile written before
    n_inner was recorded has GPT2Config's default, 4 x n_embd."""
    return {key: model_meta.get(key) if key == "n_inner" else int(model_meta[key]) for key in architecture.GPT2_SMALL}


def block_products(arch: dict) -> dict[str, tuple[int, int]]:
    """(inner, outer) of each matrix product one token goes through in every layer."""
    e = arch["n_embd"]
    inner = arch["n_inner"] or 4 * e
    return {"attention_qkv": (e, 3 * e), "attention_out": (e, e), "mlp_up": (e, inner), "mlp_down": (inner, e)}


def lm_head(arch: dict) -> tuple[int, int]:
    return arch["n_embd"], arch["vocab_size"]


def token_flops(arch: dict) -> float:
    """FLOPs of one token through every layer's matrix products."""
    return 2.0 * arch["n_layer"] * sum(k * n for k, n in block_products(arch).values())


def pair_flops(arch: dict) -> float:
    """FLOPs of one query-key pair in every layer: the score and the weighted value."""
    return 4.0 * arch["n_embd"] * arch["n_layer"]


def weights_read_bytes(arch: dict) -> float:
    """Bytes of the weights a call reads whole: all but the position table."""
    return float(architecture.weight_bytes(arch) - FLOAT32_BYTES * arch["n_positions"] * arch["n_embd"])


def term_work(arch: dict) -> dict[str, Work]:
    """The work behind one unit of each cost-model term (see the module docstring)."""
    kv = float(architecture.kv_bytes_per_token(arch))
    k, n = lm_head(arch)
    head = 2.0 * k * n
    pair = pair_flops(arch)
    weights = weights_read_bytes(arch)
    return {
        "decode_fixed_s": Work(weights, 0.0),
        "decode_per_seq_s": Work(kv, token_flops(arch) + head + pair),
        "decode_per_ctx_token_s": Work(kv, pair),
        "prefill_fixed_s": Work(weights, head),
        "prefill_per_token_s": Work(kv, token_flops(arch) + pair / 2),
        "prefill_per_token_sq_s": Work(0.0, pair / 2),
        "prefill_per_token_ctx_s": Work(0.0, pair),
    }


def call_units(kind: str, batch: int, prompt_len: int, cached: int) -> dict[str, float]:
    """How many units of each term one profiled call holds (servingplan.profile.measure's kinds). A
    decode batch is padded to its longest sequence, `cached` tokens, as the engine pads it; a batched
    prefill is `batch` prompts of `prompt_len` tokens in one call, so it reads the weights once."""
    if kind == "decode":
        return {"decode_fixed_s": 1.0, "decode_per_seq_s": float(batch),
                "decode_per_ctx_token_s": float(batch * cached)}
    if kind in ("prefill", "prefill_cached", "prefill_batch"):
        return {"prefill_fixed_s": float(batch), "prefill_per_token_s": float(batch * prompt_len),
                "prefill_per_token_sq_s": float(batch * prompt_len**2),
                "prefill_per_token_ctx_s": float(batch * prompt_len * cached)}
    raise ValueError(f"call kind {kind!r}: allowed decode, prefill, prefill_cached, prefill_batch")


def call_work(arch: dict, kind: str, batch: int, prompt_len: int, cached: int) -> Work:
    """The work one profiled call cannot avoid: the sum of its terms' units, the weights read once."""
    work = term_work(arch)
    total = Work(0.0, 0.0)
    for term, count in call_units(kind, batch, prompt_len, cached).items():
        total = total + work[term].times(count)
    if kind == "prefill_batch":
        total = total + Work(-(batch - 1) * weights_read_bytes(arch), 0.0)
    return total


def batch_work(arch: dict, batch: int) -> Work:
    """The batch-dependent part f(B) of a decode step: the weights once and B sequences' work."""
    work = term_work(arch)
    return work["decode_fixed_s"] + work["decode_per_seq_s"].times(batch)


def floor(work: Work, bandwidth_gbs: float, gflops: float) -> tuple[float, str]:
    """(seconds, bound): the roofline time of `work` and the resource that sets it."""
    memory_s, compute_s = work.bytes / (bandwidth_gbs * GB), work.flops / (gflops * GFLOP)
    return (memory_s, "memory") if memory_s >= compute_s else (compute_s, "compute")


def term_floors(arch: dict, bandwidth_gbs: float, gflops: float) -> dict[str, tuple[float, str]]:
    """Each term's floor on a machine of this bandwidth and float32 rate."""
    return {term: floor(work, bandwidth_gbs, gflops) for term, work in term_work(arch).items()}


def gemm_shapes(arch: dict, decode_batch: int, prefill_tokens: int) -> list[tuple[int, int, int]]:
    """(rows, inner, outer) of the model's own products at the profile's token counts: every layer's
    four products at the largest decode batch and the longest prefill, and the LM head at the largest
    decode batch (a prefill computes it for one token). The peak GEMM rate is measured on these."""
    shapes = [(tokens, k, n) for tokens in sorted({decode_batch, prefill_tokens})
              for k, n in block_products(arch).values()]
    return shapes + [(decode_batch, *lm_head(arch))]
