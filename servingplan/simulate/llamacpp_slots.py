"""The `llamacpp` policy: llama-server's own slot scheduler (llama.cpp 0c1e570, the commit vendored by
llama-cpp-python 0.3.36; tools/server/server-context.cpp), so the simulator predicts a llama-server.

- `max_num_seqs` slots (llama-server's `-np`). A request takes an idle slot, least recently used first
  (get_available_slot: among idle slots the smallest t_last_used, set when a slot is released; ties go
  to the *last* slot scanned, `<=`, so the very first request takes the highest slot id). With no idle
  slot it waits in a FIFO (the deferred queue). Each slot released puts the deferred queue's head at the
  *front* of the task queue (server_queue::pop_deferred_task), so when m slots are released at once the
  m oldest deferred requests take slots in reverse order, ahead of requests that arrived meanwhile.
  (A request counts as deferred once a planned iteration found no slot for it; the simulator's
  fast-forward over identical decode steps plans no iteration, so a request arriving during one counts
  as new: a difference only when several slots are released at once.) Prompt-similarity slot selection
  does not apply: prompts are distinct random token ids, so no cached prefix passes the 0.1 threshold.
- Each iteration (update_slots) is one llama_decode of one batch: first every generating slot adds its
  one sampled token, in slot order; then prompt tokens of slots still processing their prompt fill the
  batch up to `n_batch` (`chunk_size` here; it counts the decode tokens too), in slot order, so a prompt
  is split across iterations. The iteration that adds a prompt's last token samples its first output
  token.
- llama_decode cuts the batch into micro-batches, each one pass over the weights (`micro_batches`, from
  llama_batch_allocr::split_equal, which a KV cache per slot runs "sequential": src/llama-batch.cpp and
  src/llama-kv-cache.cpp). A micro-batch takes sequences whose slot ids run consecutively, in the batch's
  order, and as many tokens from each, at most `n_ubatch` in all. So decodes in slots 0, 1 and 5 are two
  passes, {0, 1} and {5}: at a load that leaves slots idle between busy ones, a step of B decodes costs
  several smaller steps (measured on this machine's replays: decode steps of batch 2 to 7 ran 15-40%
  longer than one batch of B). `step_time` prices an iteration that way; the Scheduler plans it (the
  slots of its decodes and prompt chunks are on the Step).
- KV is held per slot, so nothing is preempted: a request reserves its whole context (prompt + output)
  when it takes a slot, and one that could never fit is refused at arrival.

The scheduler (servingplan.simulate.scheduler) calls `schedule` as the policy's planning method; the slot
table lives on the Scheduler instance.
"""
from __future__ import annotations


class Slots:
    """Which request each slot holds and when each idle slot was last released."""

    def __init__(self, n: int):
        self.seq = [None] * n          # the Seq a slot holds, None when idle
        self.released = [None] * n     # (iteration, slot id) of the last release; None: never used
        self.iteration = 0
        self.deferred = set()          # ids of the requests llama-server has deferred (no slot was idle)

    def pick(self) -> int | None:
        """llama-server's LRU choice among idle slots, None if all are busy."""
        idle = [i for i, s in enumerate(self.seq) if s is None]
        if not idle:
            return None
        never = [i for i in idle if self.released[i] is None]
        if never:                      # t_last_used = -1 for all of them; `<=` keeps the last scanned
            return never[-1]
        # released in different iterations: earliest first; in the same iteration slots are released in
        # slot order, so the lower id has the smaller timestamp
        return min(idle, key=lambda i: self.released[i])

    def slot_of(self, seq) -> int:
        return self.seq.index(seq)


def slots_of(sched) -> Slots:
    table = getattr(sched, "_llamacpp_slots", None)
    if table is None:
        table = sched._llamacpp_slots = Slots(sched.max_num_seqs)
    return table


def schedule(sched, step) -> None:
    """Plan one llama-server iteration on `sched` (a servingplan.simulate.scheduler.Scheduler) into `step`."""
    slots = slots_of(sched)
    slots.iteration += 1
    running = set(map(id, sched.running))
    # 1. release the slots whose request finished in the previous iteration, in slot order
    for i, seq in enumerate(slots.seq):
        if seq is not None and id(seq) not in running:
            slots.seq[i] = None
            slots.released[i] = (slots.iteration, i)
    # 2. the task queue: one deferred request per slot released, each pushed to the front (so reversed),
    #    then the requests that arrived since the last iteration, FIFO; each takes an idle slot by LRU and
    #    reserves its whole context, or is deferred (behind those already deferred)
    released = sum(1 for i in range(len(slots.seq)) if slots.released[i] == (slots.iteration, i))
    deferred = [s for s in sched.waiting if id(s) in slots.deferred]
    fresh = [s for s in sched.waiting if id(s) not in slots.deferred]
    popped = deferred[:released]
    queue = popped[::-1] + fresh
    admitted = []
    for seq in queue:
        i = slots.pick()
        if i is None or not sched.kv.grow(seq, seq.prompt_len + seq.output_len - 1):
            break
        admitted.append(seq)
        sched.running.append(seq)
        step.admitted.append(seq)
        slots.seq[i] = seq
    taken = set(map(id, admitted))
    sched.waiting.clear()
    sched.waiting.extend(s for s in deferred + fresh if id(s) not in taken)
    slots.deferred = set(map(id, sched.waiting))
    # 3. every generating slot adds one token, in slot order
    held = [(i, s) for i, s in enumerate(slots.seq) if s is not None]
    generating = [(i, s) for i, s in held if s.prefilled >= s.prefill_target]
    step.decodes = [s for _, s in generating]
    # 4. prompt tokens fill the batch up to n_batch, in slot order
    budget = sched.chunk_size - len(step.decodes)
    prompting = []
    for i, seq in held:
        if budget <= 0:
            break
        if seq.prefilled < seq.prefill_target:
            n = min(seq.prefill_target - seq.prefilled, budget)
            step.prefills.append((seq, n))
            prompting.append(i)
            budget -= n
    step.slots = ([i for i, _ in generating], prompting)


# llama-server's default -ub; a context takes min(n_ubatch, n_batch) (llama_context's constructor)
DEFAULT_N_UBATCH = 512


def micro_batches(decodes, prefills, n_ubatch: int) -> list[tuple[int, list[tuple[int, int]]]]:
    """The micro-batches of one iteration, as llama_batch_allocr::split_equal(n_ubatch, sequential) cuts
    its batch: `decodes` (slot, context) of each decode token, in slot order, then `prefills` (slot,
    tokens, cached) of each prompt chunk, in slot order (the batch's order). Each micro-batch takes, in
    that order, every sequence with tokens left whose slot is one above the last taken, then the same
    number of tokens from each: while every one has another and (tokens + 1) x sequences stays within
    n_ubatch. Returns (tokens per sequence, [(slot, entries it held before them)]) per micro-batch; a
    decode token's context counts the token itself, so it held context - 1."""
    # [slot, tokens left, entries held]
    seqs = [[slot, 1, context - 1] for slot, context in decodes] + [[slot, tokens, cached]
                                                                     for slot, tokens, cached in prefills]
    out = []
    while True:
        taken: list = []
        for seq in seqs:
            if seq[1] and (not taken or seq[0] == taken[-1][0] + 1):
                taken.append(seq)
                if len(taken) > n_ubatch:
                    break
        if not taken:
            return out
        tokens = 0
        while all(seq[1] > tokens for seq in taken):
            tokens += 1
            if (tokens + 1) * len(taken) > n_ubatch:
                break
        out.append((tokens, [(seq[0], seq[2]) for seq in taken]))
        for seq in taken:
            seq[1] -= tokens
            seq[2] += tokens


def step_time(cost, decodes, prefills, n_ubatch: int) -> float:
    """One iteration's time on `cost`, summed over its micro-batches (arguments as micro_batches)."""
    return priced(cost, micro_batches(decodes, prefills, n_ubatch))


def priced(cost, batches) -> float:
    """The time on `cost` of micro_batches' `batches`: one of a token per sequence is a decode step of that
    many sequences (a prompt's token in it reads its cached entries and itself), one of more is a prefill
    call per sequence."""
    total = 0.0
    for tokens, members in batches:
        if tokens == 1:
            contexts = [held + 1 for _, held in members]
            total += cost.decode_time(len(contexts), sum(contexts), max(contexts))
        else:
            total += sum(cost.prefill_time(tokens, held) for _, held in members)
    return total
