"""The event loop: drives a Scheduler with cost-model time.

Between events the batch does not change, so a run of identical decode-only steps is advanced in
closed form: the step time grows by a constant (one more KV entry per sequence per step), so k
steps take k*d0 + dd*k*(k-1)/2. Events are arrivals that could be admitted, completions, and KV
block exhaustion.

Keeping up is judged by how much a replica's backlog grew over the arrivals, in seconds: the time its
last request spent in the system (its E2E latency: the queue ahead of it at its arrival plus its own
service) minus the slack the replica had before that arrival, the time during which it could have taken a
new request at once (a free slot, nobody waiting: the time an engine of one slot sat idle).
A replica keeps up when that growth is below -LOAD_RESOLUTION of the trace's duration (its last arrival,
measured from time 0, the span Trace.mean_rate_rps divides by). For one slot, FCFS, this is exact: the
engine works without a break from the last arrival until the last request completes, so the growth is
(the trace's total service) - (its duration), and the test reads "the trace's own load, total service
over duration, is below 1 - LOAD_RESOLUTION": every rate at or above the trace's own saturation rate is
unstable (an M/G/1 queue at load 1 is null-recurrent: its queue grows as the square root of the
requests). With more slots, a request's long decode chain alone does not count against keeping up, only
waiting for a slot and the service itself. Once the last request is in and the clock passes its arrival
plus the slack, with the request unfinished, the verdict is settled, so a run that only needs the
verdict stops there (`stop_when_unstable`).

A fleet of more than one replica is judged on its replicas' mean growth, whatever its router. Each
replica's growth is taken over the trace's whole span, up to the trace's last arrival T
(`Replica.growth_over_trace`: its own growth minus T - its last arrival, time it also had to work its
backlog off), so that the replicas' growths cover one span; up to each one's own last arrival, the mean
would also charge the fleet the gaps between the trace's last r arrivals. For one slot, FCFS, a replica's
growth over [0, T] is its own total service minus T (its work left at T minus its slack until T: it works
without a break from its own last arrival until its last request completes, so its busy time is its own
service), whichever requests the router sent it. So under any router the mean is (the trace's total
service) / r - T, and the test reads "the fleet's mean per-replica load, total service over r * duration,
is below 1 - LOAD_RESOLUTION": the single replica's test on each replica's share of the trace.

Why the mean and not the busiest replica. Round robin fixes each request's replica up front, every r-th
request to the same one, so the replicas are independent queues with the same statistics: in the long run
each keeps up iff their common load, the fleet's mean per-replica load, is below 1. One replica's own
sub-trace, n/r requests, is a small sample of that load (64 replicas at 9 req/s get about 9 requests each,
and one whose few requests happen to carry more service than their span grows a backlog although the
fleet's load is well below 1); the mean pools every request. Join shortest queue sends each request to a
replica with the fewest requests in it, so while one replica's backlog grows and another sits idle, every
arrival goes to the idle one (or another as short) and the long one's backlog only drains: a growing
backlog on one replica beside an idle one cannot persist. The fleet is then close to work-conserving, one
queue served by r engines, which keeps up iff its load, total service over r engines' time, the same mean
per-replica load, is below 1. The busiest replica's own growth measures instead which replica held the
last requests, and how much slack it happened to have: ties go to the lowest index, so replica 0 takes
every arrival that finds the fleet idle and has little slack (4-19 s before its last arrival against
150-164 s on replica 3, in 4 one-slot replicas at mean load 0.8), its growth is about its last request's
time in the system, and it judged such fleets unstable on some seeds, which oversized join-shortest-queue
fleets.

The early stop holds for the mean too. Once the trace's last request has arrived, no request is routed
any more and each replica serves what it holds alone, so the replicas drain one after the other (the run
of a state-reading router advances them together, arrival by arrival, up to the last arrival, and stops
none of them before it). While a replica's last request is unfinished, its growth over the trace exceeds
its clock minus T minus its slack, so once these lower bounds (a drained replica's exact growth) sum to
-LOAD_RESOLUTION * T per replica or more, the verdict is settled (`drain_judged_on_mean`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from servingplan.costmodel import CostModel
from servingplan.simulate import llamacpp_slots
from servingplan.simulate.policies import DEFAULT_CHUNK_BUDGET
from servingplan.simulate.scheduler import BlockManager, Scheduler, Seq
from servingplan.simulate.steps import StepRecorder
from servingplan.simulate.workload import Trace

if TYPE_CHECKING:
    import pandas as pd

    from servingplan.simulate.misses import MissLimit, MissWatch


@dataclass
class SimResult:
    """Per-request timeline (seconds) and run-level facts of one simulation."""
    arrival_s: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray
    scheduled_s: np.ndarray       # first admission; NaN if never admitted
    first_token_s: np.ndarray     # NaN if no token before the run stopped
    completion_s: np.ndarray      # NaN if unfinished
    generated: np.ndarray         # tokens emitted (== output_tokens when finished)
    preemptions: np.ndarray
    recomputed_tokens: np.ndarray
    rejected: np.ndarray          # bool: could never fit in the KV cache
    token_spans: list | None      # per request: [(start_s, k, first_step_s, step_increment_s), ...]
    end_s: float
    truncated: bool               # stopped at the horizon with work left
    steps: int
    events: int
    peak_running: int
    peak_kv_blocks: int
    peak_kv_tokens: int
    backlog_growth_s: float | None  # the backlog growth keeping up is judged on (module's note): one replica's,
                                    # a fleet's replicas' mean over the trace, whatever its router; None where
                                    # not measured (the real engine): judged on completion alone
    policy: str
    max_num_seqs: int
    chunk_size: int
    meta: dict = field(default_factory=dict)
    step_table: pd.DataFrame | None = None   # one row per engine step (STEP_COLUMNS) when recorded
    misses_settled: bool = False  # stopped once every verdict watching it was settled failing (simulate.misses):
                                  # it has no latency or stability figure to report

    @property
    def finished(self) -> np.ndarray:
        return ~np.isnan(self.completion_s)

    @property
    def stable(self) -> bool:
        """Kept up: ran to completion, and its load stayed below saturation: one replica's, a fleet's mean
        per-replica load, whatever its router (see the module's note)."""
        duration = float(self.arrival_s[-1]) if len(self.arrival_s) else 0.0
        return (not self.truncated and not self.rejected.any()
                and (self.backlog_growth_s is None or self.backlog_growth_s < -LOAD_RESOLUTION * duration))

    def token_times(self, i: int) -> np.ndarray:
        """Emission time of every token of request i (needs record_tokens=True)."""
        if self.token_spans is None:
            raise ValueError("simulation ran with record_tokens=False")
        parts = []
        for start, k, d0, dd in self.token_spans[i]:
            j = np.arange(1, k + 1, dtype=float)
            parts.append(start + j * d0 + dd * j * (j - 1) / 2)
        return np.concatenate(parts) if parts else np.empty(0)


def steps_to_reach(gap: float, d0: float, dd: float) -> int:
    """Smallest k >= 1 whose k steps (durations d0, d0+dd, ...) last at least `gap`."""
    if gap <= d0:
        return 1
    if dd <= 0:
        return max(1, math.ceil(gap / d0 - 1e-12))
    k = max(1, math.ceil((-(d0 - dd / 2) + math.sqrt((d0 - dd / 2) ** 2 + 2 * dd * gap)) / dd - 1e-9))

    def lasts(n: int) -> float:
        return n * d0 + dd * n * (n - 1) / 2

    # The closed form is off by a step or two through rounding; the answer is pinned by bisection, not by
    # stepping k one at a time: with steps of 1e-56 s (an imported model may allow them) k is about 1e55,
    # where k + 1 rounds to k and a one-step walk never ends.
    if k > 1 and lasts(k - 1) >= gap:
        below, above = 0, k - 1
    elif lasts(k) < gap:
        below, width = k, 1
        while lasts(k + width) < gap:
            below, width = k + width, width * 2
        above = k + width
    else:
        return k
    while above - below > 1:   # lasts(below) < gap <= lasts(above)
        middle = (below + above) // 2
        if lasts(middle) >= gap:
            above = middle
        else:
            below = middle
    return max(1, above)


# The keeps-up test's resolution, a share of the trace's duration: a backlog growth above -1e-9 of it counts
# as saturated (unstable); for one slot, a load within 1e-9 of 1. It only absorbs the rounding of summed
# step times (about n * 1e-16 relative), far below any rate tolerance.
LOAD_RESOLUTION = 1e-9




def miss_watch(trace: Trace, limits: list[MissLimit] | None) -> MissWatch | None:
    """A watch over `trace`'s requests for the verdicts `limits` settle, or none."""
    if not limits:
        return None
    # imported here: the real-time replay loads SimResult from this module, and its rule lists none of the
    # simulator's other modules among its inputs (editing them must not rerun it)
    from servingplan.simulate.misses import MissWatch
    return MissWatch(limits, trace.arrival_s, trace.output_tokens)


class Timeline:
    """Per-request timestamps, shared by every replica serving one trace."""

    def __init__(self, n: int, record_tokens: bool, watch: MissWatch | None = None):
        self.scheduled = np.full(n, np.nan)
        self.first = np.full(n, np.nan)
        self.done = np.full(n, np.nan)
        self.spans = [[] for _ in range(n)] if record_tokens else None
        self.watch = watch

    @property
    def misses_settled(self) -> bool:
        return self.watch is not None and self.watch.settled


class Replica:
    """One engine: a Scheduler advanced with cost-model time."""

    def __init__(self, cost: CostModel, policy: str, max_num_seqs: int, chunk_size: int,
                 kv_blocks: int | None, block_size: int, timeline: Timeline, recorder: StepRecorder | None = None,
                 chunk_budget: str = DEFAULT_CHUNK_BUDGET, n_ubatch: int | None = None):
        self.cost = cost
        # the llamacpp policy's micro-batch size (llama-server's -ub, at most its -b, chunk_size)
        if n_ubatch is not None and n_ubatch < 1:
            raise ValueError(f"n_ubatch={n_ubatch}: must be >= 1")
        self.n_ubatch = min(llamacpp_slots.DEFAULT_N_UBATCH if n_ubatch is None else n_ubatch, chunk_size)
        self.recorder = recorder
        self.sched = Scheduler(policy, max_num_seqs, chunk_size, BlockManager(kv_blocks, block_size), chunk_budget)
        self.timeline = timeline
        self.t = 0.0
        self.slack = 0.0          # time so far with a free slot and nobody waiting
        self.stepped_free = False  # whether the last step counted as slack
        self.last = None          # (its last request's id, its arrival, the slack until then)
        self.steps = self.events = 0
        self.peak_running = self.peak_blocks = self.peak_tokens = 0

    @property
    def outstanding(self) -> int:
        return len(self.sched.waiting) + len(self.sched.running)

    def add(self, seq: Seq, arrival: float) -> bool:
        # a slack step that ran past the arrival counts only up to it
        self.last = (seq.id, arrival, self.slack - (max(0.0, self.t - arrival) if self.stepped_free else 0.0))
        return self.sched.add(seq)

    def backlog_growth(self, unfinished_at: float = math.inf) -> float:
        """Its last request's time in the system minus the slack before its arrival. An unfinished last
        request counts as finishing at `unfinished_at`: inf (no finite growth), or the clock (the growth
        known so far, a lower bound)."""
        if self.last is None:
            return -math.inf
        i, arrival, slack = self.last
        done = self.timeline.done[i]
        return float(((unfinished_at if math.isnan(done) else done) - arrival) - slack)

    def growth_over_trace(self, duration: float, unfinished_at: float = math.inf) -> float:
        """Its backlog growth over the trace's whole span, up to the trace's last arrival `duration` rather
        than up to its own: the time after its own last arrival also served to work its backlog off
        (module's note). A replica that got no request had only slack. `unfinished_at` as in backlog_growth."""
        if self.last is None:
            return -duration
        return self.backlog_growth(unfinished_at) - (duration - self.last[1])

    def advance(self, until: float, horizon: float, settled_by: float = math.inf) -> None:
        """Run steps while the clock is before `until` (a step that starts before it runs to its
        end); an idle engine waits until then. Stops early past `horizon`, or past `settled_by` with its
        last request unfinished."""
        sched, watch = self.sched, self.timeline.watch
        while self.t < until and self.t <= horizon:
            if self.t >= settled_by and math.isnan(self.timeline.done[self.last[0]]):
                return
            if watch is not None and watch.settled:
                return
            if sched.waiting or sched.running:
                stepped = self._step(until)
            else:
                # what _step does with nothing to serve (an empty plan, one event, no step), without
                # planning it: most replicas of a large fleet are idle at most arrivals
                self.events += 1
                stepped = False
            if not stepped:
                if math.isinf(until):
                    return
                self.slack += until - self.t
                self.t = until

    def _step(self, next_arrival: float) -> bool:
        """Plan and run one step, or a run of identical decode steps up to the next event."""
        sched, tl = self.sched, self.timeline
        step = sched.schedule()
        self.events += 1
        prefills, decodes = step.prefills, step.decodes
        if not prefills and not decodes:
            return False
        for seq in step.admitted:
            if math.isnan(tl.scheduled[seq.id]):
                tl.scheduled[seq.id] = self.t

        batch = len(decodes)
        if batch:
            # Seq.decode_context spelled out: this runs for every sequence of every step
            ctx = [s.prompt_len + s.generated for s in decodes]
            ctx_sum, ctx_max = sum(ctx), max(ctx)
        else:
            ctx, ctx_sum, ctx_max = [], 0, 0
        if step.slots:
            # llama-server: one pass per micro-batch. A run of decode-only steps keeps its micro-batches,
            # each reading one more entry per sequence a step, so the run grows by dd as any other does.
            d0 = self._micro_batched(step, ctx, prefills)
        else:
            d0 = self.cost.step_time(batch, ctx_sum, step.prefill_calls() if prefills else (), ctx_max)
        k, dd = 1, 0.0
        if batch and not prefills:
            dd = self.cost.decode_per_ctx_token_s * batch
            limit = min([s.output_len - s.generated for s in decodes])
            if math.isfinite(next_arrival) and sched.arrival_changes_plan():
                limit = min(limit, steps_to_reach(next_arrival - self.t, d0, dd))
            k = sched.repeatable(step, limit)
            if k > 1:
                sched.repeat_decodes(step, k - 1)

        running = sched.running
        if len(running) > self.peak_running:
            self.peak_running = len(running)
        if sched.kv.used > self.peak_blocks:
            self.peak_blocks = sched.kv.used
        if not prefills and len(running) == batch:
            # everyone decodes, k - 1 steps in: each cache holds its context + k - 2 entries
            self.peak_tokens = max(self.peak_tokens, ctx_sum + batch * (k - 2))
        elif sched.kv.used * sched.kv.block_size > self.peak_tokens:
            # counted only when the allocated blocks could hold a new peak; Seq.kv_tokens spelled out
            self.peak_tokens = max(self.peak_tokens, sum([
                s.prefilled if s.prefilled < s.prefill_target else s.prompt_len + s.generated - 1 for s in running]))
        start = self.t
        elapsed = k * d0 + dd * k * (k - 1) / 2
        self.stepped_free = sched.admits_arrivals()
        if self.stepped_free:
            self.slack += elapsed
        self.t += elapsed
        self.steps += k
        emitted, finished = sched.complete(step)
        if self.recorder is not None:
            decode_s = (self._micro_batched(step, ctx, ()) if step.slots
                        else self.cost.decode_time(batch, ctx_sum, ctx_max))
            self._record(step, start, k, d0, dd, batch, ctx_sum, ctx_max, decode_s, len(emitted))
        # a first token only ever comes from a prefill
        for seq, _ in prefills:
            if seq.generated and math.isnan(tl.first[seq.id]):
                tl.first[seq.id] = self.t
                if tl.watch is not None:
                    tl.watch.first_token(seq.id, self.t)
        if tl.spans is not None:
            for seq in emitted:
                tl.spans[seq.id].append((start, k, d0, dd))
        for seq in finished:
            tl.done[seq.id] = self.t
            if tl.watch is not None:
                tl.watch.finished(seq.id, self.t)
        return True


    def _micro_batched(self, step, ctx: list, prefills) -> float:
        """A llamacpp step's time over its micro-batches (llamacpp_slots.step_time); `prefills` empty
        prices its decodes alone."""
        decode_slots, prefill_slots = step.slots
        chunks = [(slot, n, seq.prefilled) for slot, (seq, n) in zip(prefill_slots, prefills)]
        return llamacpp_slots.step_time(self.cost, list(zip(decode_slots, ctx)), chunks, self.n_ubatch)

    def _record(self, step, start, k, d0, dd, batch, ctx_sum, ctx_max, decode_s, emitted) -> None:
        """The step as rows: a run of k identical decode steps unrolled, the j-th starting after j steps
        and reading j more KV entries per sequence (the fast-forward's own closed form). `decode_s` is the
        first step's decode part."""
        calls = step.prefill_calls() if step.prefills else []
        for j in range(k):
            duration = d0 + j * dd
            first, last = j == 0, j == k - 1
            self.recorder.record(start + j * d0 + dd * j * (j - 1) / 2, duration, batch, ctx_sum + j * batch,
                                 ctx_max + j if batch else 0, calls if first else [],
                                 len(step.admitted) if first else 0, len(step.preempted) if first else 0,
                                 emitted if last else batch, duration - decode_s - j * dd if first else 0.0,
                                 decode_s + j * dd)


def run_replicas(trace: Trace, replicas: list[Replica], route, horizon_factor: float, policy: str,
                 max_num_seqs: int, chunk_size: int, stop_when_unstable: bool = False,
                 route_reads_state: bool = True) -> SimResult:
    """Feed the trace's arrivals to the replicas through `route(replicas, seq) -> index`, then drain.
    The run stops at `horizon_factor` trace-durations (at least 60 s past the last arrival); work
    left then marks it truncated, i.e. the queue was unstable. With `stop_when_unstable` it also stops,
    truncated, as soon as the backlog growth settles the run unstable (for searches that read only
    verdicts: such a run's latencies are not the full run's); with a miss watch on the timeline, as soon as
    the watch is settled (`misses_settled`: the run then has no verdict on keeping up either). A route
    that reads no replica's state
    (`route_reads_state` False: round robin) fixes every request's replica up front, so each replica
    serves its own arrivals alone, as its own simulation would (no other replica's arrival interrupts its
    fast-forwarded decode runs); one that does advances every replica to each arrival. After the last
    arrival the replicas drain alone, and more than one are judged on their mean growth, whatever the
    route (the module's note)."""
    n = len(trace)
    timeline = replicas[0].timeline
    seqs = [Seq(i, int(p), int(o)) for i, (p, o) in enumerate(zip(trace.prompt_tokens, trace.output_tokens))]
    arrivals = np.asarray(trace.arrival_s, dtype=float)
    horizon = max(horizon_factor * trace.duration_s, trace.duration_s + 60.0)
    rejected = np.zeros(n, dtype=bool)
    arrived = 0
    if route_reads_state:
        for i, arrival in enumerate(arrivals.tolist()):
            if arrival > horizon or timeline.misses_settled:
                break
            for replica in replicas:
                replica.advance(arrival, horizon)
            target = replicas[route(replicas, seqs[i])]
            rejected[i] = not target.add(seqs[i], arrival)
            arrived += 1
    else:
        own = [[] for _ in replicas]
        for i, arrival in enumerate(arrivals.tolist()):
            if arrival > horizon:
                break
            own[route(replicas, seqs[i])].append((i, arrival))
            arrived += 1
        for replica, requests in zip(replicas, own):
            for i, arrival in requests:
                if timeline.misses_settled:
                    break
                replica.advance(arrival, horizon)
                rejected[i] = not replica.add(seqs[i], arrival)
    duration = trace.duration_s
    # every replica has had its last arrival: from here on the replicas run independently, whatever the router
    if len(replicas) > 1:
        drain_judged_on_mean(replicas, duration, horizon, stop_when_unstable)
        backlog_growth = math.fsum(r.growth_over_trace(duration) for r in replicas) / len(replicas)
    else:
        replica, = replicas
        settled_by = (replica.last[1] + replica.last[2] - LOAD_RESOLUTION * duration
                      if stop_when_unstable and replica.last is not None else math.inf)
        replica.advance(math.inf, horizon, settled_by)
        backlog_growth = replica.backlog_growth()
    settled = timeline.misses_settled
    truncated = settled or any(not r.sched.idle for r in replicas) or arrived < n

    return SimResult(
        arrival_s=arrivals, prompt_tokens=np.asarray(trace.prompt_tokens),
        output_tokens=np.asarray(trace.output_tokens), scheduled_s=timeline.scheduled,
        first_token_s=timeline.first, completion_s=timeline.done,
        generated=np.array([s.generated for s in seqs]), preemptions=np.array([s.preemptions for s in seqs]),
        recomputed_tokens=np.array([s.recomputed_tokens for s in seqs]), rejected=rejected,
        token_spans=timeline.spans, end_s=max(r.t for r in replicas), truncated=truncated,
        steps=sum(r.steps for r in replicas), events=sum(r.events for r in replicas),
        peak_running=max(r.peak_running for r in replicas), peak_kv_blocks=max(r.peak_blocks for r in replicas),
        peak_kv_tokens=max(r.peak_tokens for r in replicas),
        # a run stopped on its missed SLO never settled whether it keeps up
        backlog_growth_s=None if settled else backlog_growth,
        policy=policy, max_num_seqs=max_num_seqs, chunk_size=chunk_size, meta={"replicas": len(replicas)},
        step_table=replicas[0].recorder.frame() if len(replicas) == 1 and replicas[0].recorder is not None else None,
        misses_settled=settled,
    )


def drain_judged_on_mean(replicas: list[Replica], duration: float, horizon: float, stop_when_unstable: bool) -> None:
    """Drain replicas judged on their mean growth over the trace, one after the other (past the trace's
    last arrival each serves what it holds alone, whatever routed it there). With `stop_when_unstable`, a
    replica stops, its last request unfinished, once its clock makes the mean of every replica's lower
    bound (growth_over_trace at its clock) reach the unstable side, -LOAD_RESOLUTION * duration; each replica
    drained after it then stops at once."""
    unstable_sum = -LOAD_RESOLUTION * duration * len(replicas)
    bounds = [r.growth_over_trace(duration, r.t) for r in replicas]
    for k, replica in enumerate(replicas):
        settled_by = math.inf
        if stop_when_unstable and replica.last is not None:
            # its bound while its last request is unfinished is clock - slack - duration: the clock at
            # which the bounds' sum reaches unstable_sum
            settled_by = replica.last[2] + duration + unstable_sum - math.fsum(bounds[:k] + bounds[k + 1:])
        replica.advance(math.inf, horizon, settled_by)
        bounds[k] = replica.growth_over_trace(duration, replica.t)


def simulate(trace: Trace, cost: CostModel, policy: str, max_num_seqs: int, chunk_size: int = 512,
             kv_blocks: int | None = None, block_size: int = 16, horizon_factor: float = 20.0,
             record_tokens: bool = False, record_steps: bool = False,
             chunk_budget: str = DEFAULT_CHUNK_BUDGET, stop_when_unstable: bool = False,
             stop_when_missed: list[MissLimit] | None = None, n_ubatch: int | None = None) -> SimResult:
    """Serve `trace` on one replica; with `record_steps`, every engine step is a row of `step_table`;
    with `stop_when_unstable`, stop as soon as the run is settled unstable (see run_replicas); with
    `stop_when_missed`, as soon as every one of those verdicts is settled failing (simulate.misses).
    `chunk_budget` says what `chunk_size` counts (servingplan.simulate.policies.CHUNK_BUDGETS); `n_ubatch` is the
    llamacpp policy's micro-batch size (llama-server's -ub; default its default, at most chunk_size, its -b)."""
    timeline = Timeline(len(trace), record_tokens, miss_watch(trace, stop_when_missed))
    replica = Replica(cost, policy, max_num_seqs, chunk_size, kv_blocks, block_size, timeline,
                      StepRecorder() if record_steps else None, chunk_budget, n_ubatch)
    return run_replicas(trace, [replica], lambda replicas, seq: 0, horizon_factor, policy, max_num_seqs,
                        chunk_size, stop_when_unstable)
