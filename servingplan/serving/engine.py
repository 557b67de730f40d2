"""A real continuous-batching GPT-2 engine: the simulator's Scheduler driven by the wall clock.

Each iteration asks the very Scheduler the simulator uses for a step, runs it on the model, and
hands it back with `complete`; time comes from the clock instead of the cost model, so the gap
between a replay and a simulation of the same trace is the cost model's error (plus the machine's
noise), not a difference in scheduling. The model calls are the profiler's own `prefill_call` /
`decode_call`, with the same cache type (transformers' DynamicCache), so the profile times what
the engine runs.

KV cache. Every running sequence owns a slot of one preallocated pool per K and V, shaped
[layer, slot, head, position, head_dim]; its entries sit at positions 0..n-1 of its slot.

- Prefill of n prompt tokens after `cached` ones: a DynamicCache whose layers are views of the
  slot's first `cached` positions (no copy; nothing at all for a fresh prompt), one prefill_call,
  then the n new entries are copied into the slot.
- Decode of B sequences: the decoding sequences are kept in slots 0..B-1, so the batch's past is
  the view pool[:, :B, :, :T] (T = the longest context, shorter ones right-padded), built without
  copying. The attention mask is 1 on each sequence's own entries and on the new token, 0 on the
  padding; position_ids are each sequence's own length. After the call the new token's entry
  (column T of what the call returns) is scattered to position n_b of each slot: one indexed write
  per layer for K and V.

Per-step overhead beyond the model calls (reported per step as overhead_s and kv_moved_tokens):
Python scheduling, building masks and views, the scatter above, freeing what the decode call
returned (the profiler frees its previous cache inside the timed call instead), and slot moves.
A slot move copies one sequence's entries when it has to join the decoding block 0..B-1 (a prompt
finished its prefill in a high slot, or a decoder finished and left a hole), which happens O(1)
times per request. The padding is real work: the decode reads B * T entries, ctx_mode "padded_max" of the
cost model. Inside decode_call DynamicCache concatenates the new token onto the past, copying
B * (T + 1) entries per layer; the profiler's decode points include that copy, so the fitted
per-context cost does too.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch
from transformers import DynamicCache

from servingplan.profiling.machine import configure_threads
from servingplan.profiling.measure import configure_allocator, decode_call, prefill_call
from servingplan.sim.scheduler import BlockManager, Scheduler, Seq
from servingplan.sim.simulator import SimResult, queue_growth
from servingplan.workload import Trace

DEFAULT_MAX_WALL_S = 600.0
WARMUP_PROMPT_TOKENS = 8

STEP_COLUMNS = ["step", "start_s", "duration_s", "batch", "ctx_sum", "ctx_max", "prefill_calls",
                "n_prefill_calls", "prefill_tokens", "admitted", "preempted", "emitted",
                "prefill_s", "decode_s", "overhead_s", "kv_moved_tokens"]


def request_problem(prompt_tokens: int, output_tokens: int, n_positions: int,
                    arrival_s: float = 0.0) -> str | None:
    """Why the model cannot serve a request, or None if it can."""
    if not (math.isfinite(arrival_s) and arrival_s >= 0):
        return f"arrival_s={arrival_s}: a request needs a finite arrival time >= 0"
    if prompt_tokens < 1:
        return f"prompt_tokens={prompt_tokens}: a request needs at least one prompt token"
    if output_tokens < 1:
        return f"output_tokens={output_tokens}: a request must ask for at least one token"
    if prompt_tokens + output_tokens > n_positions:
        return (f"prompt_tokens + output_tokens = {prompt_tokens} + {output_tokens} exceeds the "
                f"model's n_positions={n_positions}")
    return None


class KVPool:
    """The KV entries of every running sequence, one slot each, in two preallocated tensors."""

    def __init__(self, config, slots: int, capacity: int):
        head_dim = config.n_embd // config.n_head
        shape = (config.n_layer, slots, config.n_head, capacity, head_dim)
        # zeros, not empty: padded positions are masked, but a NaN left in memory would still
        # poison the attention output (0 * NaN) through the value product.
        self.keys = torch.zeros(shape)
        self.values = torch.zeros(shape)
        self.config = config
        self.owner: list[Seq | None] = [None] * slots
        # entries each slot holds, counted here: a Seq's counters move only when its step completes
        self.stored = [0] * slots
        self.slot_of: dict[Seq, int] = {}

    def acquire(self, seq: Seq) -> int:
        """The highest free slot: decoders gather at the low end, so a new prompt disturbs them least."""
        slot = max(i for i, owner in enumerate(self.owner) if owner is None)
        self.owner[slot] = seq
        self.stored[slot] = 0
        self.slot_of[seq] = slot
        return slot

    def release(self, seq: Seq) -> None:
        slot = self.slot_of.pop(seq, None)
        if slot is not None:
            self.owner[slot] = None

    def holds(self, seq: Seq) -> bool:
        return seq in self.slot_of

    def cache_view(self, slots: slice, length: int) -> DynamicCache:
        """A DynamicCache over the first `length` positions of `slots`, sharing the pool's memory."""
        cache = DynamicCache(config=self.config)
        for layer, keys, values in zip(cache.layers, self.keys[:, slots, :, :length],
                                       self.values[:, slots, :, :length]):
            # Assigned rather than passed to the constructor, which concatenates them into copies.
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
        return cache

    def store_prefill(self, seq: Seq, cache: DynamicCache, start: int, tokens: int) -> None:
        slot = self.slot_of[seq]
        for index, layer in enumerate(cache.layers):
            self.keys[index, slot, :, start:start + tokens] = layer.keys[0, :, start:start + tokens]
            self.values[index, slot, :, start:start + tokens] = layer.values[0, :, start:start + tokens]
        self.stored[slot] = start + tokens

    def store_decode(self, cache: DynamicCache, lengths: torch.Tensor) -> None:
        """Scatter the newest entry of batch row b (slot b) to position lengths[b]."""
        rows = torch.arange(len(lengths))
        for index, layer in enumerate(cache.layers):
            self.keys[index, rows, :, lengths] = layer.keys[:, :, -1]
            self.values[index, rows, :, lengths] = layer.values[:, :, -1]
        self.stored[:len(lengths)] = (lengths + 1).tolist()

    def gather_decoders(self, decoders: list) -> tuple[list, int]:
        """Move the decoding sequences into slots 0..B-1 so their batch is a view; returns them in
        slot order and the KV entries copied to get there."""
        batch = len(decoders)
        taken = {self.slot_of[s] for s in decoders}
        holes = [slot for slot in range(batch) if slot not in taken]
        misplaced = [s for s in decoders if self.slot_of[s] >= batch]
        moved = sum(self._swap(self.slot_of[seq], hole) for seq, hole in zip(misplaced, holes))
        return sorted(decoders, key=self.slot_of.__getitem__), moved

    def _swap(self, a: int, b: int) -> int:
        length_a = self.stored[a] if self.owner[a] else 0
        length_b = self.stored[b] if self.owner[b] else 0
        for pool in (self.keys, self.values):
            held_by_b = pool[:, b, :, :length_b].clone()
            pool[:, b, :, :length_a] = pool[:, a, :, :length_a]
            pool[:, a, :, :length_b] = held_by_b
        self.owner[a], self.owner[b] = self.owner[b], self.owner[a]
        self.stored[a], self.stored[b] = self.stored[b], self.stored[a]
        for slot in (a, b):
            if self.owner[slot] is not None:
                self.slot_of[self.owner[slot]] = slot
        return length_a + length_b


@dataclass
class EngineRun:
    """What one replay produced: the SimResult-shaped timeline, one row per step (STEP_COLUMNS),
    every request's prompt and generated token ids, and why each failed request failed."""
    result: SimResult
    steps: pd.DataFrame
    prompts: list
    tokens: list
    errors: dict = field(default_factory=dict)


class Engine:
    """Serves a trace on `model` under one scheduling policy, in real time on this machine."""

    def __init__(self, model, policy: str, max_num_seqs: int, chunk_size: int = 512,
                 kv_blocks: int | None = None, block_size: int = 16, threads: int | None = None):
        self.model = model
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.chunk_size = chunk_size
        self.kv_blocks = kv_blocks
        self.block_size = block_size
        self.threads = configure_threads(threads)
        # the profiler measured under this malloc setting; without it the engine runs slower than its model
        self.allocator = configure_allocator()

    @torch.inference_mode()
    def run(self, trace: Trace, max_wall_s: float = DEFAULT_MAX_WALL_S, seed: int = 0) -> EngineRun:
        """Replay `trace`: request i arrives arrival_s[i] seconds after the start, with seeded random
        prompt token ids. Work left at `max_wall_s` is reported unfinished (the step running then
        completes first)."""
        if max_wall_s <= 0:
            raise ValueError(f"max_wall_s={max_wall_s}: must be > 0")
        return _Run(self, trace, max_wall_s, seed).serve()


class _Run:
    """The state of one Engine.run."""

    def __init__(self, engine: Engine, trace: Trace, max_wall_s: float, seed: int):
        self.engine, self.model, self.max_wall_s = engine, engine.model, max_wall_s
        config = self.model.config
        n = len(trace)
        self.arrivals = np.asarray(trace.arrival_s, dtype=float)
        self.prompt_tokens = np.asarray(trace.prompt_tokens, dtype=np.int64)
        self.output_tokens = np.asarray(trace.output_tokens, dtype=np.int64)
        self.seqs = [Seq(i, int(p), int(o))
                     for i, (p, o) in enumerate(zip(self.prompt_tokens, self.output_tokens))]
        self.problems = {s.id: request_problem(s.prompt_len, s.output_len, config.n_positions, self.arrivals[s.id])
                         for s in self.seqs}
        # a refused request arrives (and is turned away) at once: a NaN time would never come due
        self.arrivals_due = np.where([self.problems[i] is None for i in range(n)], self.arrivals, 0.0)
        self.scheduler = Scheduler(engine.policy, engine.max_num_seqs, engine.chunk_size,
                                   BlockManager(engine.kv_blocks, engine.block_size))
        rng = np.random.default_rng(seed)
        # per request: its prompt ids, then room for the generated ids, written as they come; nothing
        # for a refused request, whose sizes may be anything
        self.token_ids = [
            torch.from_numpy(np.concatenate([rng.integers(config.vocab_size, size=s.prompt_len),
                                             np.zeros(s.output_len, dtype=np.int64)]))
            if self.problems[s.id] is None else torch.zeros(0, dtype=torch.long)
            for s in self.seqs]
        # the last generated token is never fed back, so its KV entry is never stored
        longest = max((s.prompt_len + s.output_len - 1 for s in self.seqs if self.problems[s.id] is None),
                      default=1)
        self.pool = KVPool(config, engine.max_num_seqs, longest)

        self.scheduled = np.full(n, np.nan)
        self.first = np.full(n, np.nan)
        self.done = np.full(n, np.nan)
        self.rejected = np.zeros(n, dtype=bool)
        self.spans = [[] for _ in range(n)]
        self.errors: dict[int, str] = {}
        self.step_rows: list[dict] = []
        self.queue_times: list[float] = []
        self.queue_waiting: list[int] = []
        self.peak_running = self.peak_blocks = self.peak_tokens = self.events = 0

    # -- the loop ----------------------------------------------------------------------------------
    def serve(self) -> EngineRun:
        self._warm_up()
        self.started = time.perf_counter()
        n, next_arrival, truncated = len(self.seqs), 0, False
        while True:
            now = self._clock()
            while next_arrival < n and self.arrivals_due[next_arrival] <= now:
                self._arrive(self.seqs[next_arrival])
                next_arrival += 1
            if now >= self.max_wall_s:
                truncated = not self.scheduler.idle or next_arrival < n
                break
            step = None
            if not self.scheduler.idle:
                step = self.scheduler.schedule()
                self.events += 1
            if step is None or step.empty:
                if next_arrival >= n:
                    break
                time.sleep(max(0.0, min(self.arrivals_due[next_arrival], self.max_wall_s) - self._clock()))
                continue
            self._run_step(step, now)
        return self._outcome(truncated)

    def _clock(self) -> float:
        return time.perf_counter() - self.started

    def _warm_up(self) -> None:
        """One prefill and one decode before the clock starts: the first calls pay one-time setup."""
        ids = torch.zeros(1, WARMUP_PROMPT_TOKENS, dtype=torch.long)
        cache = prefill_call(self.model, ids).past_key_values
        decode_call(self.model, ids[:, :1], cache, torch.ones(1, WARMUP_PROMPT_TOKENS + 1, dtype=torch.long),
                    torch.full((1, 1), WARMUP_PROMPT_TOKENS))

    def _arrive(self, seq: Seq) -> None:
        problem = self.problems[seq.id]
        if problem is None and not self.scheduler.add(seq):
            need = self.scheduler.kv.blocks_for(seq.prompt_len + seq.output_len - 1)
            problem = (f"needs {need} KV blocks of {self.scheduler.kv.block_size} tokens; "
                       f"the cache has {self.scheduler.kv.total}")
        if problem is not None:
            self.rejected[seq.id] = True
            self.errors[seq.id] = problem
        self.queue_times.append(float(self.arrivals_due[seq.id]))
        self.queue_waiting.append(len(self.scheduler.waiting))

    def _run_step(self, step, start: float) -> None:
        for seq in step.admitted:
            if math.isnan(self.scheduled[seq.id]):
                self.scheduled[seq.id] = start
        batch = len(step.decodes)
        contexts = [s.decode_context for s in step.decodes]
        prefill_calls = step.prefill_calls()
        self.peak_running = max(self.peak_running, len(self.scheduler.running))
        self.peak_blocks = max(self.peak_blocks, self.scheduler.kv.used)
        self.peak_tokens = max(self.peak_tokens, sum(s.kv_tokens for s in self.scheduler.running))
        try:
            prefill_s, decode_s, moved = self._execute(step)
        except Exception as error:  # noqa: BLE001 - a failed step must not take the other requests down
            self._abort([s for s, _ in step.prefills] + list(step.decodes), f"step failed: {error!r}")
            return
        emitted, finished = self.scheduler.complete(step)
        for seq in finished:
            self.pool.release(seq)
        end = self._clock()
        duration = end - start
        for seq in emitted:
            if math.isnan(self.first[seq.id]):
                self.first[seq.id] = end
            self.spans[seq.id].append((start, 1, duration, 0.0))
        for seq in finished:
            self.done[seq.id] = end
        self.step_rows.append({
            "step": len(self.step_rows), "start_s": start, "duration_s": duration, "batch": batch,
            "ctx_sum": sum(contexts), "ctx_max": max(contexts, default=0), "prefill_calls": prefill_calls,
            "n_prefill_calls": len(prefill_calls), "prefill_tokens": sum(n for n, _ in prefill_calls),
            "admitted": len(step.admitted), "preempted": len(step.preempted), "emitted": len(emitted),
            "prefill_s": prefill_s, "decode_s": decode_s,
            "overhead_s": duration - prefill_s - decode_s, "kv_moved_tokens": moved,
        })

    def _abort(self, seqs: list, reason: str) -> None:
        for seq in seqs:
            if seq in self.scheduler.running:
                self.scheduler.running.remove(seq)
                self.scheduler.kv.release(seq)
            self.pool.release(seq)
            self.errors[seq.id] = reason

    # -- running a step on the model ----------------------------------------------------------------
    def _execute(self, step) -> tuple[float, float, int]:
        """Run the step's prefill calls and its one batched decode call; write each emitted token
        into its sequence's ids. Returns (seconds in prefill calls, seconds in the decode call,
        KV entries moved between slots)."""
        for seq in step.preempted:
            self.pool.release(seq)
        # before the prefills, so that prompts admitted now take slots above the decoding block
        decoders, moved = self.pool.gather_decoders(list(step.decodes))
        prefill_s = 0.0
        for seq, tokens in step.prefills:
            started = time.perf_counter()
            self._prefill(seq, tokens)
            prefill_s += time.perf_counter() - started
        if not decoders:
            return prefill_s, 0.0, moved
        lengths = torch.tensor([s.kv_tokens for s in decoders])
        past = int(lengths.max())
        cache = self.pool.cache_view(slice(0, len(decoders)), past)
        attention_mask = (torch.arange(past + 1) < lengths[:, None]).long()
        attention_mask[:, past] = 1
        input_ids = torch.stack([self.token_ids[s.id][s.prompt_len + s.generated - 1] for s in decoders])[:, None]
        started = time.perf_counter()
        logits = decode_call(self.model, input_ids, cache, attention_mask, lengths[:, None]).logits
        decode_s = time.perf_counter() - started
        self.pool.store_decode(cache, lengths)
        for seq, token in zip(decoders, logits[:, -1].argmax(-1)):
            self.token_ids[seq.id][seq.prompt_len + seq.generated] = token
        return prefill_s, decode_s, moved

    def _prefill(self, seq: Seq, tokens: int) -> None:
        if not self.pool.holds(seq):
            self.pool.acquire(seq)
        cached = seq.prefilled
        input_ids = self.token_ids[seq.id][cached:cached + tokens][None]
        slot = self.pool.slot_of[seq]
        cache = self.pool.cache_view(slice(slot, slot + 1), cached) if cached else None
        output = prefill_call(self.model, input_ids, cache)
        self.pool.store_prefill(seq, output.past_key_values, cached, tokens)
        if cached + tokens == seq.prefill_target:
            self.token_ids[seq.id][seq.prefill_target] = output.logits[0, -1].argmax()

    # -- the result ---------------------------------------------------------------------------------
    def _outcome(self, truncated: bool) -> EngineRun:
        steps = pd.DataFrame(self.step_rows, columns=STEP_COLUMNS)
        engine = self.engine
        result = SimResult(
            arrival_s=self.arrivals, prompt_tokens=self.prompt_tokens, output_tokens=self.output_tokens,
            scheduled_s=self.scheduled, first_token_s=self.first, completion_s=self.done,
            generated=np.array([s.generated for s in self.seqs], dtype=np.int64),
            preemptions=np.array([s.preemptions for s in self.seqs], dtype=np.int64),
            recomputed_tokens=np.array([s.recomputed_tokens for s in self.seqs], dtype=np.int64),
            rejected=self.rejected, token_spans=self.spans, end_s=self._clock(), truncated=truncated,
            steps=len(self.step_rows), events=self.events, peak_running=self.peak_running,
            peak_kv_blocks=self.peak_blocks, peak_kv_tokens=self.peak_tokens,
            queue_growth=queue_growth(self.queue_times, self.queue_waiting), policy=engine.policy,
            max_num_seqs=engine.max_num_seqs, chunk_size=engine.chunk_size,
            meta={"engine": "real", "threads": engine.threads, "max_wall_s": self.max_wall_s,
                  "errors": dict(self.errors),
                  "unfinished": [s.id for s in self.seqs if not s.finished and s.id not in self.errors]},
        )
        prompts = [self.token_ids[s.id][:s.prompt_len].tolist() for s in self.seqs]
        tokens = [self.token_ids[s.id][s.prompt_len:s.prompt_len + s.generated].tolist() for s in self.seqs]
        return EngineRun(result, steps, prompts, tokens, dict(self.errors))
