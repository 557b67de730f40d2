"""A real continuous-batching GPT-2 engine: the simulator's Scheduler driven by the wall clock.

Each iteration asks the very Scheduler the simulator uses for a step, runs it on the model, and
hands it back with `complete`; time comes from the clock instead of the cost model, so the gap
between a replay and a simulation of the same trace is the cost model's error (plus the machine's
noise), not a difference in scheduling.

KV cache and model calls: servingplan.profile.kvpool, the same functions and layout the profiler
times (a pool slot per running sequence; decoders in slots 0..B-1, so a decode batch is a view).

Per-step overhead beyond the model calls (reported per step as overhead_s and kv_moved_tokens):
Python scheduling, reading the emitted tokens, and slot moves. A slot move copies one sequence's
entries when it has to join the decoding block 0..B-1 (a prompt finished its prefill in a high slot,
or a decoder finished and left a hole), which happens O(1) times per request.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import psutil
import torch

from servingplan.device import model_device
from servingplan.profile.kvpool import KVPool, configure_allocator, decode_step, prefill_step
from servingplan.profile.machine import configure_threads
from servingplan.simulate.policies import DEFAULT_CHUNK_BUDGET
from servingplan.simulate.scheduler import BlockManager, Scheduler, Seq
from servingplan.simulate.simulator import SimResult
from servingplan.simulate.steps import StepRecorder
from servingplan.simulate.workload import Trace

DEFAULT_MAX_WALL_S = 600.0
WARMUP_PROMPT_TOKENS = 8

# the engine's own columns after the shared recorder's (servingplan.simulate.steps.STEP_COLUMNS)
ENGINE_STEP_COLUMNS = ("overhead_s", "kv_moved_tokens")


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


@dataclass
class EngineRun:
    """What one replay produced: the SimResult-shaped timeline, one row per step (the shared recorder's
    STEP_COLUMNS, then ENGINE_STEP_COLUMNS),
    every request's prompt and generated token ids, and why each failed request failed."""
    result: SimResult
    steps: pd.DataFrame
    prompts: list
    tokens: list
    errors: dict = field(default_factory=dict)


class Engine:
    """Serves a trace on `model` under one scheduling policy, in real time on this machine."""

    def __init__(self, model, policy: str, max_num_seqs: int, chunk_size: int = 512,
                 kv_blocks: int | None = None, block_size: int = 16, threads: int | None = None,
                 chunk_budget: str = DEFAULT_CHUNK_BUDGET):
        self.model = model
        # the KV pool goes where the model is (config model.device)
        self.device = model_device(model)
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.chunk_size = chunk_size
        self.chunk_budget = chunk_budget
        self.kv_blocks = kv_blocks
        self.block_size = block_size
        self.threads = configure_threads(threads)
        # the profiler measured under this malloc setting; without it the engine runs slower than its model
        self.allocator = configure_allocator()

    @torch.inference_mode()
    def run(self, trace: Trace, max_wall_s: float = DEFAULT_MAX_WALL_S, seed: int = 0,
            while_idle=None, on_finished=None) -> EngineRun:
        """Replay `trace`: request i arrives arrival_s[i] seconds after the start, with seeded random
        prompt token ids. Work left at `max_wall_s` is reported unfinished (the step running then
        completes first). `while_idle(gap_s, steps)`, when given, is called whenever the engine has
        nothing to run and the next request arrives gap_s seconds later (`steps`: the step rows
        recorded so far); it must return within gap_s, so that no request waits for it.
        `on_finished(count)`, when given, is called after every step that finished requests, with how
        many have finished so far (progress)."""
        if max_wall_s <= 0:
            raise ValueError(f"max_wall_s={max_wall_s}: must be > 0")
        return _Run(self, trace, max_wall_s, seed, while_idle, on_finished).serve()


class _Run:
    """The state of one Engine.run."""

    def __init__(self, engine: Engine, trace: Trace, max_wall_s: float, seed: int, while_idle=None,
                 on_finished=None):
        self.engine, self.model, self.max_wall_s = engine, engine.model, max_wall_s
        self.while_idle, self.on_finished, self.finished_count = while_idle, on_finished, 0
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
                                   BlockManager(engine.kv_blocks, engine.block_size), engine.chunk_budget)
        rng = np.random.default_rng(seed)
        # per request: its prompt ids, then room for the generated ids, written as they come; nothing
        # for a refused request, whose sizes may be anything
        self.token_ids = [
            torch.from_numpy(np.concatenate([rng.integers(config.vocab_size, size=s.prompt_len),
                                             np.zeros(s.output_len, dtype=np.int64)]))
            if self.problems[s.id] is None else torch.zeros(0, dtype=torch.long)
            for s in self.seqs]
        # the last generated token is never fed back, so its KV entry is never stored; the warm-up's
        # prompt and token need room too
        longest = max((s.prompt_len + s.output_len - 1 for s in self.seqs if self.problems[s.id] is None),
                      default=1)
        longest = max(longest, WARMUP_PROMPT_TOKENS + 1)
        self.pool = KVPool(config, engine.max_num_seqs, longest, engine.device)

        self.scheduled = np.full(n, np.nan)
        self.first = np.full(n, np.nan)
        self.done = np.full(n, np.nan)
        self.rejected = np.zeros(n, dtype=bool)
        self.spans = [[] for _ in range(n)]
        self.errors: dict[int, str] = {}
        self.recorder = StepRecorder(ENGINE_STEP_COLUMNS)
        self.peak_running = self.peak_blocks = self.peak_tokens = self.events = 0
        # resident memory sampled after every step: what serving at this cap really holds
        self.process = psutil.Process()
        self.peak_rss = self.process.memory_info().rss

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
                gap = min(self.arrivals_due[next_arrival], self.max_wall_s) - self._clock()
                if self.while_idle is not None and gap > 0:
                    self.while_idle(gap, self.recorder.rows)
                time.sleep(max(0.0, min(self.arrivals_due[next_arrival], self.max_wall_s) - self._clock()))
                continue
            self._run_step(step, now)
        return self._outcome(truncated)

    def _clock(self) -> float:
        return time.perf_counter() - self.started

    def _warm_up(self) -> None:
        """One prefill and one decode on the pool before the clock starts: the first calls pay one-time
        setup. They write slot 0's first entries, which no sequence owns yet."""
        ids = torch.zeros(1, WARMUP_PROMPT_TOKENS, dtype=torch.long)
        prefill_step(self.model, self.pool, 0, ids, cached=0)
        decode_step(self.model, self.pool, torch.tensor([WARMUP_PROMPT_TOKENS]), ids[:, :1])

    def _arrive(self, seq: Seq) -> None:
        problem = self.problems[seq.id]
        if problem is None and not self.scheduler.add(seq):
            need = self.scheduler.kv.blocks_for(seq.prompt_len + seq.output_len - 1)
            problem = (f"needs {need} KV blocks of {self.scheduler.kv.block_size} tokens; "
                       f"the cache has {self.scheduler.kv.total}")
        if problem is not None:
            self.rejected[seq.id] = True
            self.errors[seq.id] = problem

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
        self.finished_count += len(finished)
        if finished and self.on_finished is not None:
            self.on_finished(self.finished_count)
        self.peak_rss = max(self.peak_rss, self.process.memory_info().rss)
        self.recorder.record(start, duration, batch, sum(contexts), max(contexts, default=0), prefill_calls,
                             len(step.admitted), len(step.preempted), len(emitted), prefill_s, decode_s,
                             overhead_s=duration - prefill_s - decode_s, kv_moved_tokens=moved)

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
        input_ids = torch.stack([self.token_ids[s.id][s.prompt_len + s.generated - 1] for s in decoders])[:, None]
        started = time.perf_counter()
        logits = decode_step(self.model, self.pool, lengths, input_ids)
        decode_s = time.perf_counter() - started
        for seq, token in zip(decoders, logits.argmax(-1).tolist()):
            self.token_ids[seq.id][seq.prompt_len + seq.generated] = token
        return prefill_s, decode_s, moved

    def _prefill(self, seq: Seq, tokens: int) -> None:
        if not self.pool.holds(seq):
            self.pool.acquire(seq)
        cached = seq.prefilled
        input_ids = self.token_ids[seq.id][cached:cached + tokens][None]
        logits = prefill_step(self.model, self.pool, self.pool.slot_of[seq], input_ids, cached)
        if cached + tokens == seq.prefill_target:
            self.token_ids[seq.id][seq.prefill_target] = int(logits.argmax())

    # -- the result ---------------------------------------------------------------------------------
    def _outcome(self, truncated: bool) -> EngineRun:
        steps = self.recorder.frame()
        engine = self.engine
        result = SimResult(
            arrival_s=self.arrivals, prompt_tokens=self.prompt_tokens, output_tokens=self.output_tokens,
            scheduled_s=self.scheduled, first_token_s=self.first, completion_s=self.done,
            generated=np.array([s.generated for s in self.seqs], dtype=np.int64),
            preemptions=np.array([s.preemptions for s in self.seqs], dtype=np.int64),
            recomputed_tokens=np.array([s.recomputed_tokens for s in self.seqs], dtype=np.int64),
            rejected=self.rejected, token_spans=self.spans, end_s=self._clock(), truncated=truncated,
            steps=len(self.recorder.rows), events=self.events, peak_running=self.peak_running,
            peak_kv_blocks=self.peak_blocks, peak_kv_tokens=self.peak_tokens,
            backlog_growth_s=None, policy=engine.policy,
            max_num_seqs=engine.max_num_seqs, chunk_size=engine.chunk_size,
            meta={"engine": "real", "threads": engine.threads, "max_wall_s": self.max_wall_s,
                  "errors": dict(self.errors), "peak_rss_bytes": int(self.peak_rss),
                  "kv_pool_bytes": int(self.pool.keys.nbytes + self.pool.values.nbytes),
                  "unfinished": [s.id for s in self.seqs if not s.finished and s.id not in self.errors]},
        )
        prompts = [self.token_ids[s.id][:s.prompt_len].tolist() for s in self.seqs]
        tokens = [self.token_ids[s.id][s.prompt_len:s.prompt_len + s.generated].tolist() for s in self.seqs]
        return EngineRun(result, steps, prompts, tokens, dict(self.errors))
