"""Pure scheduling: which sequences run in the next engine step and how many prompt tokens each gets.

Nothing here reads a clock. The simulator drives a Scheduler with cost-model time; the real engine
(servingplan.engine) drives the very same Scheduler with the wall clock, so a gap between the two
is the cost model's error alone.

Token accounting follows vLLM. A sequence first prefills its prompt (`prefill_target` tokens); the
step that completes the prefill emits the first output token. Each decode step then emits one token
and adds one KV entry. A preempted sequence loses its KV cache and, when readmitted, recomputes
prompt + generated tokens in a new prefill, whose completion emits its next token.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from servingplan.simulate.policies import CHUNK_BUDGETS, DEFAULT_CHUNK_BUDGET, POLICIES, chunks


@dataclass(eq=False)
class Seq:
    id: int
    prompt_len: int
    output_len: int
    prefill_target: int = 0
    prefilled: int = 0
    generated: int = 0
    blocks: int = 0
    preemptions: int = 0
    recomputed_tokens: int = 0
    admitted_once: bool = False

    def __post_init__(self):
        self.prefill_target = self.prompt_len

    @property
    def prefilling(self) -> bool:
        return self.prefilled < self.prefill_target

    @property
    def kv_tokens(self) -> int:
        """KV entries in the cache now (the newest token's entry is written by its next decode)."""
        return self.prefilled if self.prefilling else self.prompt_len + self.generated - 1

    @property
    def decode_context(self) -> int:
        """KV entries a decode step of this sequence reads: prompt and every generated token, the
        newest included (its entry is written by this very step)."""
        return self.prompt_len + self.generated

    @property
    def finished(self) -> bool:
        return self.generated >= self.output_len


@dataclass
class Step:
    prefills: list = field(default_factory=list)   # (Seq, prompt tokens this step)
    decodes: list = field(default_factory=list)    # Seq
    preempted: list = field(default_factory=list)  # Seq, evicted while planning this step
    admitted: list = field(default_factory=list)   # Seq, moved from waiting to running this step
    # llamacpp: (slot of each decode, slot of each prefill), which its micro-batches follow (llamacpp_slots)
    slots: tuple = ()

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes

    def prefill_calls(self):
        """(tokens, already cached) per prefill call, the cost model's input."""
        return [(n, s.prefilled) for s, n in self.prefills]


class BlockManager:
    """Paged KV cache: `total` blocks of `block_size` tokens; None means unlimited."""

    def __init__(self, total: int | None, block_size: int = 16):
        if block_size < 1:
            raise ValueError(f"block_size={block_size}: must be >= 1")
        self.total = total
        self.block_size = block_size
        self.used = 0

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    @property
    def free(self) -> float:
        return math.inf if self.total is None else self.total - self.used

    def fits(self, tokens: int) -> bool:
        return self.total is None or self.blocks_for(tokens) <= self.total

    def grow(self, seq: Seq, tokens: int) -> bool:
        """Make room for `tokens` KV entries of `seq`; False if the cache is full."""
        need = -(-tokens // self.block_size) - seq.blocks
        if need <= 0:
            return True
        if self.total is not None and need > self.total - self.used:
            return False
        seq.blocks += need
        self.used += need
        return True

    def release(self, seq: Seq) -> None:
        self.used -= seq.blocks
        seq.blocks = 0


class Scheduler:
    """Waiting queue (FCFS), running set and KV cache under one of the POLICIES.

    static:             a batch of up to `max_num_seqs` is formed when the engine is idle; it runs,
                        prefill then decodes, until its last sequence finishes. No admission meanwhile.
    continuous:         iteration-level scheduling. Whenever a slot and KV room exist, waiting prompts
                        are admitted and prefilled whole in a prefill-only step (prefill first);
                        otherwise all running sequences decode.
    continuous_chunked: every step decodes all running sequences first; up to `chunk_size` prompt
                        tokens ride along, split over prefilling sequences in admission order, and new
                        prompts are admitted while that budget and a slot remain. With `chunk_budget`
                        "step_tokens" the decodes count against `chunk_size` too (vLLM's
                        max_num_batched_tokens): a step with d decodes carries chunk_size - d prompt tokens.
    """

    def __init__(self, policy: str, max_num_seqs: int, chunk_size: int = 512,
                 kv: BlockManager | None = None, chunk_budget: str = DEFAULT_CHUNK_BUDGET):
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r}: allowed {', '.join(POLICIES)}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs}: must be >= 1")
        if chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size}: must be >= 1")
        if chunk_budget not in CHUNK_BUDGETS:
            raise ValueError(f"chunk_budget={chunk_budget!r}: allowed {', '.join(CHUNK_BUDGETS)}")
        # As vLLM requires: the decodes of a full running set then leave at least one token for a
        # prefilling sequence, so every step makes progress.
        if chunk_budget == "step_tokens" and chunks(policy) and chunk_size < max_num_seqs:
            raise ValueError(f"chunk_size={chunk_size}: counting every token of a step, must be >= "
                             f"max_num_seqs ({max_num_seqs})")
        self.policy = policy
        self.max_num_seqs = max_num_seqs
        self.chunk_size = chunk_size
        self.chunk_budget = chunk_budget
        self.kv = kv or BlockManager(None)
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.rejected: list[Seq] = []

    # -- queue -------------------------------------------------------------------------------------
    def add(self, seq: Seq) -> bool:
        """Queue a request; refuse (False) one that could never fit in the whole KV cache."""
        # the last reply token's KV entry is never written: no decode step follows it
        if not self.kv.fits(seq.prompt_len + seq.output_len - 1):
            self.rejected.append(seq)
            return False
        self.waiting.append(seq)
        return True

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running

    def admits_arrivals(self) -> bool:
        """Would a request arriving now change the next step? (lets the simulator fast-forward)"""
        if self.policy == "static":
            return not self.running
        return len(self.running) < self.max_num_seqs and not self.waiting

    def arrival_changes_plan(self) -> bool:
        """Could a request arriving during a run of decode steps change a step of it, or the first after it?
        (bounds the simulator's fast-forward). Under vLLM's FCFS policies only when admits_arrivals: a request
        behind a blocked head, or with every slot taken, waits the same wherever it arrives in the run. Under
        llama-server's (llamacpp) it can whenever a request runs: each iteration tries the requests that
        arrived since the last before those it deferred, so a new request can take an idle slot that a
        deferred one could not, and one deferred during the run re-enters the queue by the slots released,
        not behind the others as one added after the run would."""
        return self.policy == "llamacpp" or self.admits_arrivals()

    # -- planning ----------------------------------------------------------------------------------
    def schedule(self) -> Step:
        step = Step()
        getattr(self, PLANNERS[self.policy])(step)
        return step

    def _admit(self, step: Step, budget: float = math.inf) -> None:
        """Move waiting sequences to running (FCFS) while a slot, KV room and prompt budget remain."""
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if not self.kv.grow(seq, seq.prefill_target):
                break
            self.waiting.popleft()
            self.running.append(seq)
            step.admitted.append(seq)
            n = min(seq.prefill_target - seq.prefilled, budget)
            step.prefills.append((seq, n))
            budget -= n

    def _reserve_decodes(self, step: Step, seqs) -> list:
        """Grow each decoding sequence by one KV entry, preempting the newest running ones if full."""
        # The hot path of every simulation, so Seq's properties are spelled out (a call costs more
        # than the arithmetic) and only sequences whose blocks are full go through grow().
        block_size = self.kv.block_size
        ready = [s for s in seqs if s.prefilled >= s.prefill_target]
        for seq in [s for s in ready if s.prompt_len + s.generated > s.blocks * block_size]:
            if seq.prefilled < seq.prefill_target:   # preempted earlier in this loop
                continue
            while not self.kv.grow(seq, seq.prompt_len + seq.generated):
                victim = self.running[-1]
                self._preempt(victim, step)
                if victim in ready:
                    ready.remove(victim)
                if victim is seq:
                    break
        return ready

    def _preempt(self, seq: Seq, step: Step) -> None:
        self.running.remove(seq)
        self.kv.release(seq)
        seq.preemptions += 1
        seq.recomputed_tokens += seq.prompt_len + seq.generated
        seq.prefill_target = seq.prompt_len + seq.generated
        seq.prefilled = 0
        self.waiting.appendleft(seq)
        step.preempted.append(seq)
        step.prefills = [(s, n) for s, n in step.prefills if s is not seq]

    def _schedule_static(self, step: Step) -> None:
        if not self.running:
            self._admit(step)
        else:
            step.decodes = self._reserve_decodes(step, list(self.running))

    def _schedule_prefill_first(self, step: Step) -> None:
        self._admit(step)
        if not step.prefills:
            step.decodes = self._reserve_decodes(step, list(self.running))

    def _schedule_chunked(self, step: Step) -> None:
        step.decodes = self._reserve_decodes(step, list(self.running))
        budget = self.chunk_size - (len(step.decodes) if self.chunk_budget == "step_tokens" else 0)
        for seq in [s for s in self.running if s.prefilled < s.prefill_target]:
            if budget <= 0:
                break
            n = min(seq.prefill_target - seq.prefilled, budget)
            step.prefills.append((seq, n))
            budget -= n
        self._admit(step, budget)

    def _schedule_llamacpp(self, step: Step) -> None:
        from servingplan.simulate import llamacpp_slots   # llama-server's slots, LRU, n_batch filling
        llamacpp_slots.schedule(self, step)

    # -- applying a finished step ------------------------------------------------------------------
    def complete(self, step: Step) -> tuple[list, list]:
        """Apply an executed step. Returns (sequences that emitted a token, sequences that finished)."""
        emitted, finished = [], []
        for seq, n in step.prefills:
            seq.prefilled += n
            seq.admitted_once = True
            if not seq.prefilling:
                seq.generated += 1
                emitted.append(seq)
                if seq.finished:
                    finished.append(seq)
        # hot loop: Seq.finished spelled out
        for seq in step.decodes:
            seq.generated += 1
            if seq.generated >= seq.output_len:
                finished.append(seq)
        emitted += step.decodes
        for seq in finished:
            self.running.remove(seq)
            self.kv.release(seq)
        return emitted, finished

    # -- repeating a decode-only step (the simulator's fast-forward) ---------------------------------
    def repeatable(self, step: Step, limit: int) -> int:
        """How many times (<= limit) a decode-only step can run back to back with no new KV blocks
        beyond those free now; the step itself counts as one."""
        if self.kv.total is None:
            return limit
        free, block_size = self.kv.free, self.kv.block_size

        def extra_blocks(k):
            # blocks_for and decode_context spelled out: this runs for every fast-forwarded decode run
            return sum([-(-(s.prompt_len + s.generated + k - 1) // block_size) - s.blocks for s in step.decodes])

        if extra_blocks(limit) <= free:     # the usual case, a cache with room: one sum, not a bisection
            return limit
        lo, hi = 1, limit - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if extra_blocks(mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def repeat_decodes(self, step: Step, extra: int) -> None:
        """Apply `extra` decode steps of `step` before the final one that `complete` applies."""
        block_size = self.kv.block_size
        for seq in step.decodes:
            seq.generated += extra
            context = seq.prompt_len + seq.generated
            if context > seq.blocks * block_size:
                grown = self.kv.grow(seq, context)
                assert grown, "repeat_decodes past the KV cache; call repeatable() first"


# Each registered policy's planning method; a name registered without one fails at import.
PLANNERS = {"static": "_schedule_static", "continuous": "_schedule_prefill_first",
            "llamacpp": "_schedule_llamacpp",
            "continuous_chunked": "_schedule_chunked"}
if set(PLANNERS) != set(POLICIES) or not all(hasattr(Scheduler, m) for m in PLANNERS.values()):
    raise ImportError(f"scheduler: policies {sorted(POLICIES)} and planning methods {sorted(PLANNERS)} differ")
