"""llama-server's own steps against llama-batched-bench's, paired in time: the server terms of the llama.cpp cost
model (results/llamacpp/server/: pairs.csv, terms.json, and costmodel.json, the fit with the terms added, which
the validation and the engine comparison simulate llama-server on).

    measure_server_terms(gguf, profile_meta, cap, max_context, seed, log_file, vocab_size) -> pairs (DataFrame)
    summarize(pairs, seed) -> terms;  server_cost_model(fitted, terms) -> CostModel

The profile times llama.cpp through its benchmark tool, while the validation serves a real llama-server.
Their prompt steps were not the same cost: over the default-size validations of 2026-12-04 the server's
prompt-only steps ran 1.06x to 1.22x what the tool's prompts cost, read in the same run; sent alone and
paired with the tool back to back (2026-12-05), prompts of 64 and 192 tokens cost the same, and prompts of
320 to 512 tokens 5% to 15% more. So the server is measured against the tool here, on the same GGUF, with the
same threads, n_batch and n_ubatch, and with the validation's slots and context (n_parallel =
validation.cap, -c cap x memory.max_context). Each pair is one tool run and one request to the server,
back to back, in alternating order so a drift of the machine's speed falls on both sides:
- prefill: the tool's prefill point of L tokens (the median of its timed calls) against the server's step
  for a lone prompt of L tokens (llama-server's step log, servingplan.llamacpp.server_log);
- decode: the tool's decode point of one sequence after L cached tokens (its timed steps, contexts L and
  on) against the same request's decode steps at those contexts (its first `warmup` dropped, as the tool
  drops its warm-up calls);
- prefill_cached: the tool's point of a chunk of C tokens after P cached (the difference of its prompts of
  P + C and P at -b C) against the last step of a lone prompt of P + C tokens served at -b C, which the
  server decodes in chunks of C: its chunk after P.

L runs over the profile's prompt lengths at a quarter, half and all of its range (those a slot holds with
the replies), and the chunks over the profile's chunks after cached tokens, `rounds` pairs each: 12 pairs of
a prompt and a decode step, 16 of a chunk, at the default profile.

The server's extra time over the tool's is fitted per kind in the model's own terms, each at least zero (the
server runs the library's decode and its own work besides): a prompt's per-token and per-token-squared
terms, a decode step's fixed and per-context-token terms, and a chunk's per-token-times-cached term (on what
the prompt terms do not already give it). They are added to the fit only when the 90% interval of the
extra at the largest shape measured (a percentile bootstrap over the pairs, seeded) lies above zero: an
interval that holds zero shows no difference, and the fit stands. Added terms only raise the fit's, which
its roofline floors hold.
"""
from __future__ import annotations

import dataclasses
import random
import time
from pathlib import Path

import numpy as np
import pandas as pd
from scipy.optimize import nnls

from servingplan.costmodel import CostModel
from servingplan.llamacpp import build
from servingplan.llamacpp.client import random_prompts, run_trace
from servingplan.llamacpp.profile import run_bench
from servingplan.llamacpp.server import FLOAT32_KV, STEP_LOG_ARGS, LlamaServer
from servingplan.llamacpp.server_log import ServerLogError, read_steps
from servingplan.pipeline import terminal
from servingplan.profile.measure import GridPoint

# what the server's extra time over the tool's is fitted on, per kind: a prompt's tokens L and L^2 (the work
# per token and the attention's); a decode step's fixed part and its context (one sequence: its KV read); a
# chunk's tokens times the tokens cached before it (its attention over them), beyond what the prompt terms
# give a fresh prompt of the chunk's length
FEATURES = {"prefill": lambda x: np.column_stack([x, x * x]), "decode": lambda x: np.column_stack([np.ones_like(x), x]),
            "prefill_cached": lambda x: np.column_stack([x])}
TERMS = {"prefill": ("prefill_per_token_s", "prefill_per_token_sq_s"),
         "decode": ("decode_fixed_s", "decode_per_ctx_token_s"),
         "prefill_cached": ("prefill_per_token_ctx_s",)}
INTERVAL = 90
BOOTSTRAP_DRAWS = 2000
# a request that takes longer than this is stuck (the longest default pair's request takes under a second)
REQUEST_TIMEOUT_S = 120.0
# how long a lone request's steps may take to reach the server's log after its response, and how often to look
LOG_WAIT_S = 10.0
LOG_POLL_S = 0.05


def say(message: str) -> None:
    print(f"llama.cpp server terms: {message}", file=terminal(), flush=True)


def term_lengths(prefill_lengths, max_context: int, decode_calls: int) -> list[int]:
    """The prompt lengths the pairs are measured at: the profile's at a quarter, half and all of its list,
    each leaving a slot room for its reply (decode_calls + 1 tokens) within max_context."""
    fits = sorted(int(n) for n in prefill_lengths if int(n) + decode_calls + 1 <= max_context)
    if not fits:
        raise ValueError(f"llama.cpp server terms: no profiled prompt length leaves room for {decode_calls + 1} "
                         f"generated tokens within memory.max_context = {max_context}")
    return sorted({fits[(len(fits) - 1) // 4], fits[(len(fits) - 1) // 2], fits[-1]})


def measure_server_terms(gguf, profile_meta: dict, cap: int, max_context: int, seed: int,
                         log_file, vocab_size: int) -> pd.DataFrame:
    """One row per pair: its kind, L (a chunk's C) and the tokens cached before it, the feature its extra is
    fitted on, its round, which side ran first, the tool's seconds, the server's and their ratio (see the
    module docstring)."""
    settings = profile_meta["settings"]
    warmup, calls = int(settings["warmup"]), int(settings["warmup"]) + int(settings["repeats"])
    lengths = term_lengths(settings["prefill_lengths"], max_context, calls)
    plan = [(round_number, length) for round_number in range(int(settings["rounds"])) for length in lengths]
    random.Random(seed).shuffle(plan)
    prompts = random_prompts([length for _, length in plan], vocab_size, seed)
    binary = build.binary("llama-batched-bench")
    gguf, log_file = Path(gguf), Path(log_file)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    say(f"{len(plan)} pairs per kind at prompts of {', '.join(map(str, lengths))} tokens, {cap} slots")
    with validation_server(gguf, settings, cap, max_context, int(settings["n_batch"]), int(settings["n_ubatch"]),
                           log_file) as server:
        lone = LoneRequests(server.url, log_file)
        for number, ((round_number, length), prompt) in enumerate(zip(plan, prompts)):
            server_first, served, tool = in_turn(
                number, lambda: lone.read(prompt, calls + 1, lambda steps: request_steps(steps, length, calls, warmup)),
                lambda: (float(np.median(run_bench(GridPoint("prefill", 1, length, 0), settings, gguf, binary))),
                         float(np.median(run_bench(GridPoint("decode", 1, 1, length), settings, gguf, binary)))))
            for kind, tool_s, server_s in zip(("prefill", "decode"), tool, served):
                feature = length if kind == "prefill" else length + (warmup + calls - 1) / 2
                rows.append({"kind": kind, "prompt_len": length, "cached": 0, "feature": feature,
                             "round": round_number, "server_first": server_first, "tool_s": tool_s,
                             "server_s": server_s, "ratio": server_s / tool_s})
    rows += measure_chunks(gguf, settings, cap, max_context, seed, log_file, vocab_size)
    return pd.DataFrame(rows)


def measure_chunks(gguf: Path, settings: dict, cap: int, max_context: int, seed: int, log_file: Path,
                   vocab_size: int) -> list[dict]:
    """The profile's chunks after cached tokens (C after P) that a slot holds, `rounds` pairs each: the tool's
    point against a server at -b C (-ub as the tool runs it) given a lone prompt of P + C tokens, which it
    decodes in chunks of C; the last one is the chunk of C after P cached."""
    points = [(int(chunk), int(cached)) for chunk, cached in settings.get("cached_prefill", [])
              if int(chunk) + int(cached) + 1 <= max_context]
    binary = build.binary("llama-batched-bench")
    rows = []
    for chunk in sorted({chunk for chunk, _ in points}):
        plan = [(round_number, cached) for round_number in range(int(settings["rounds"]))
                for point_chunk, cached in points if point_chunk == chunk]
        random.Random(seed + chunk).shuffle(plan)
        prompts = random_prompts([cached + chunk for _, cached in plan], vocab_size, seed + chunk)
        chunk_log = log_file.with_name(f"{log_file.stem}_b{chunk}{log_file.suffix}")
        after = ", ".join(str(cached) for cached in sorted({cached for _, cached in plan}))
        say(f"{len(plan)} pairs of a chunk of {chunk} tokens after {after} cached")
        with validation_server(gguf, settings, cap, max_context, chunk, min(chunk, int(settings["n_ubatch"])),
                               chunk_log) as server:
            lone = LoneRequests(server.url, chunk_log)
            for number, ((round_number, cached), prompt) in enumerate(zip(plan, prompts)):
                server_first, server_s, tool_s = in_turn(
                    number, lambda: lone.read(prompt, 1, lambda steps: last_chunk(steps, chunk, cached)),
                    lambda: float(np.median(run_bench(GridPoint("prefill_cached", 1, chunk, cached), settings,
                                                      gguf, binary))))
                rows.append({"kind": "prefill_cached", "prompt_len": chunk, "cached": cached,
                             "feature": chunk * cached, "round": round_number, "server_first": server_first,
                             "tool_s": tool_s, "server_s": server_s, "ratio": server_s / tool_s})
    return rows


def validation_server(gguf: Path, settings: dict, cap: int, max_context: int, n_batch: int, n_ubatch: int,
                      log_file: Path) -> LlamaServer:
    """A llama-server with the validation's slots and context, the profile's threads, a float32 KV cache and
    the step log, at the given batch sizes."""
    return LlamaServer(gguf, threads=int(settings["threads"]), n_parallel=cap, ctx=cap * max_context,
                       n_batch=n_batch, n_ubatch=n_ubatch, verbosity=5, log_file=log_file,
                       extra_args=FLOAT32_KV + STEP_LOG_ARGS)


class LoneRequests:
    """Requests sent to a server one at a time, each read back from the steps its log added for it. The
    server writes its log from a thread of its own, which can lag the response (on a busy machine, a whole
    request's steps were not in the log yet when its last token arrived): the log is read again until
    `read` accepts the steps, for at most LOG_WAIT_S."""

    def __init__(self, url: str, log_file: Path):
        self.url, self.log_file, self.logged = url, log_file, 0

    def read(self, prompt: list, max_tokens: int, read):
        result = run_trace(self.url, np.array([0.0]), [prompt], [max_tokens], timeout_s=REQUEST_TIMEOUT_S)[0]
        if not result.ok:
            raise RuntimeError(f"llama.cpp server terms: a lone request of {len(prompt)} tokens failed: {result.error}")
        deadline = time.perf_counter() + LOG_WAIT_S
        while True:
            try:
                steps = read_steps(self.log_file.read_text(errors="replace"))
                value = read(steps[self.logged:])
            except (ServerLogError, ValueError):
                if time.perf_counter() < deadline:
                    time.sleep(LOG_POLL_S)
                    continue
                raise
            self.logged = len(steps)
            return value


def in_turn(number: int, serve, bench) -> tuple:
    """A pair's two sides back to back, the server first in odd pairs (so a drift of the machine's speed
    falls on both): (server first, the server's, the tool's)."""
    server_first = number % 2 == 1
    if server_first:
        served = serve()
        return server_first, served, bench()
    tool = bench()
    return server_first, serve(), tool


def last_chunk(steps: list, chunk: int, cached: int) -> float:
    """A lone prompt of cached + chunk tokens at -b chunk: the time of its chunk after `cached`. ValueError
    unless its steps are its chunks alone, each of `chunk` tokens, starting at 0, chunk, ..., cached."""
    shapes = [(step.decodes, [(tokens, before) for _, tokens, before in step.prefills]) for step in steps]
    expected = [([], [(chunk, before)]) for before in range(0, cached + 1, chunk)]
    if shapes != expected:
        raise ValueError(f"llama.cpp server terms: a lone prompt of {cached + chunk} tokens at -b {chunk} logged "
                         f"{len(steps)} steps that are not its chunks of {chunk} alone")
    return steps[-1].duration_s


def request_steps(steps: list, length: int, calls: int, warmup: int) -> tuple[float, float]:
    """A lone request's prompt step and the median of its decode steps after the first `warmup`, from the
    server's steps since it was sent. ValueError unless they are one prompt-only step of `length` tokens
    and `calls` decode steps of one sequence."""
    prompt = [step for step in steps if step.prefills]
    decode = [step for step in steps if step.decodes and not step.prefills]
    if (len(prompt) != 1 or prompt[0].decodes or prompt[0].tokens != length or len(decode) != calls
            or any(len(step.decodes) != 1 for step in decode)):
        raise ValueError(f"llama.cpp server terms: a lone request of {length} tokens logged "
                         f"{len(prompt)} prompt steps and {len(decode)} decode steps; expected one prompt step "
                         f"of {length} tokens and {calls} decode steps of one sequence")
    return prompt[0].duration_s, float(np.median([step.duration_s for step in decode[warmup:]]))


def extra_fit(features: np.ndarray, extra_s: np.ndarray) -> np.ndarray:
    """Non-negative coefficients of the server's extra seconds over the tool's on `features` (least squares, each
    column scaled to one so the solve does not depend on the units)."""
    scale = np.abs(features).max(axis=0)
    scale[scale == 0] = 1.0
    return nnls(features / scale, extra_s)[0] / scale


def kind_term(kind: str, pairs: pd.DataFrame, seed: int, known_s=None) -> dict:
    """One kind's extra terms (see the module docstring): the fitted coefficients, the extra at each measured
    shape, and the INTERVAL% bootstrap interval of the extra at the largest, which decides whether they apply.
    `known_s(rows)`: the part of each pair's extra that other terms already give (the prompt terms' share of a
    chunk)."""
    rows = pairs[pairs["kind"] == kind]
    x = rows["feature"].to_numpy(float)
    features = FEATURES[kind](x)
    extra = (rows["server_s"] - rows["tool_s"]).to_numpy(float)
    if known_s is not None:
        extra = extra - known_s(rows)
    coefficients = extra_fit(features, extra)
    longest = float(x.max())
    at_longest = FEATURES[kind](np.array([longest]))[0]
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(BOOTSTRAP_DRAWS):
        pick = rng.integers(0, len(rows), len(rows))
        draws.append(float(at_longest @ extra_fit(features[pick], extra[pick])))
    tail = (100 - INTERVAL) / 2
    low, high = float(np.percentile(draws, tail)), float(np.percentile(draws, 100 - tail))
    applied = low > 0.0
    by_length = []
    for (length, cached), group in rows.groupby(["prompt_len", "cached"]):
        modelled = float(FEATURES[kind](np.array([group["feature"].iloc[0]]))[0] @ coefficients)
        by_length.append({"prompt_len": int(length), "cached": int(cached), "pairs": int(len(group)),
                          "median_ratio": float(np.median(group["ratio"])),
                          "tool_s": float(np.median(group["tool_s"])), "extra_s": modelled})
    extra_at_longest = float(at_longest @ coefficients)
    largest = rows.loc[rows["feature"].idxmax()]
    tool_at_largest = float(np.median(rows.loc[rows["feature"] == longest, "tool_s"]))
    return {"pairs": int(len(rows)), "terms": dict(zip(TERMS[kind], map(float, coefficients))),
            "by_length": by_length, "longest": longest,
            "largest": {"prompt_len": int(largest["prompt_len"]), "cached": int(largest["cached"])},
            "extra_at_longest_s": extra_at_longest, "extra_at_longest_pct": 100.0 * extra_at_longest / tool_at_largest,
            "interval_s": [low, high], "applied": applied,
            "reason": ("the server's steps cost more than the tool's" if applied else
                       "the interval holds zero: no difference shown")}


def summarize(pairs: pd.DataFrame, seed: int) -> dict:
    """Per kind measured: its extra terms, whether they apply, and why (kind_term). A chunk's extra is what the
    prompt terms, where applied, do not already give a fresh prompt of its length."""
    kinds = {kind: kind_term(kind, pairs, seed) for kind in ("prefill", "decode")}
    if (pairs["kind"] == "prefill_cached").any():
        prompt = kinds["prefill"]
        per_token, per_token_sq = (prompt["terms"][name] if prompt["applied"] else 0.0 for name in TERMS["prefill"])

        def prompt_share(rows):
            tokens = rows["prompt_len"].to_numpy(float)
            return per_token * tokens + per_token_sq * tokens ** 2

        kinds["prefill_cached"] = kind_term("prefill_cached", pairs, seed, prompt_share)
    return {"interval_pct": INTERVAL, "kinds": kinds}


def server_cost_model(fitted: CostModel, terms: dict) -> CostModel:
    """The fitted model with each kind's applied extra terms added: llama-server's step times on this machine."""
    add = {name: value if term["applied"] else 0.0 for term in terms["kinds"].values()
           for name, value in term["terms"].items()}
    fixed = add["decode_fixed_s"]
    return dataclasses.replace(
        fitted, name=f"{fitted.name}-server",
        prefill_per_token_s=fitted.prefill_per_token_s + add["prefill_per_token_s"],
        prefill_per_token_sq_s=fitted.prefill_per_token_sq_s + add["prefill_per_token_sq_s"],
        prefill_per_token_ctx_s=fitted.prefill_per_token_ctx_s + add.get("prefill_per_token_ctx_s", 0.0),
        decode_fixed_s=fitted.decode_fixed_s + fixed,
        decode_per_ctx_token_s=fitted.decode_per_ctx_token_s + add["decode_per_ctx_token_s"],
        decode_batch_fixed_s=tuple((batch, seconds + fixed) for batch, seconds in fitted.decode_batch_fixed_s),
        meta={**fitted.meta, "server_terms": {kind: {key: terms["kinds"][kind][key] for key in
                                                     ("terms", "extra_at_longest_s", "interval_s", "applied")}
                                              for kind in terms["kinds"]}})


def run_server_terms(gguf, fitted: CostModel, profile_meta: dict, cap: int, max_context: int,
                     seed: int, log_file, vocab_size: int) -> tuple[pd.DataFrame, dict, CostModel]:
    begun = time.perf_counter()
    pairs = measure_server_terms(gguf, profile_meta, cap, max_context, seed, log_file, vocab_size)
    terms = {**summarize(pairs, seed), "wall_time_s": time.perf_counter() - begun,
             "settings": {"cap": cap, "ctx": cap * max_context}}
    for kind, term in terms["kinds"].items():
        low, high = term["interval_s"]
        say(f"{kind}: the server's extra over the tool's at {term['longest']:g} tokens {term['extra_at_longest_s'] * 1e3:.2f} ms "
            f"(90% interval {low * 1e3:.2f} to {high * 1e3:.2f} ms) over {term['pairs']} pairs; "
            f"{'applied' if term['applied'] else 'not applied'} ({term['reason']})")
    return pairs, terms, server_cost_model(fitted, terms)
