"""llama-server's own per-step log, read back into steps: what each iteration (one llama_decode) held and
how long it took.

llama-server at `-lv 5 --log-timestamps` (servingplan.llamacpp.server.STEP_LOG_ARGS) stamps every line with
its time since start ("MM.SS.mmm.uuu") and prints, from its serving loop (tools/server/server-context.cpp of
0c1e570), for each iteration:
- `new prompt, ..., task.n_tokens = N` when a slot starts a request's prompt of N tokens;
- `cached n_tokens = X, memory_seq_rm [X, end)` for each slot adding prompt tokens to the batch, X of them
  already in its cache (a chunk runs from X to where the slot's next chunk starts, or to N);
- `slot decode token, ..., n_tokens = C` for each generating slot it adds one token for (C: its context);
- `n_batch (effective) = ..., off = 0`, then `yielding to queue` and `done yielding to queue` around
  llama_decode: the step's time is from the first to the last (the decode and the wait for its result).
HTTP threads log too, between those lines; only the lines above are read.

`check_rule` holds the steps against llama-server's batch rule as the `llamacpp` policy simulates it
(servingplan.simulate.llamacpp_slots): every step's tokens fit n_batch, and a step that leaves prompt tokens for a
later step is full.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

# "MM.SS.mmm.uuu " (--log-timestamps), then the level letter
TIMESTAMP = re.compile(r"^(\d+)\.(\d{2})\.(\d{3})\.(\d{3}) (?:[A-Z] )?(.*)$")
# where a stamped line starts: a line the server printed without its newline (its chat parser's notice) runs
# into the next one
LINE_START = re.compile(r"(?=(?<!\d)\d+\.\d{2}\.\d{3}\.\d{3} [A-Z] )")
SLOT_LINE = re.compile(r"^slot\s+\S+: id\s+(\d+) \| task (-?\d+) \| (.*)$")
NEW_PROMPT = re.compile(r"^new prompt, .*task\.n_tokens = (\d+)")
CHUNK = re.compile(r"^cached n_tokens = (\d+), memory_seq_rm")
DECODE_TOKEN = re.compile(r"^slot decode token, id=-?\d+, n_ctx = \d+, n_tokens = (\d+)")
DECODE_CALL = re.compile(r"^srv\s+decode: n_batch \(effective\) = (\d+), off = (\d+)")
DECODE_DONE = re.compile(r"^que\s+yield_to_que: done yielding to queue")


class ServerLogError(ValueError):
    """The log does not read as llama-server's step log: one line saying where."""


@dataclass
class Step:
    start_s: float
    n_batch: int
    end_s: float | None = None
    decodes: list = field(default_factory=list)       # (slot, context) of each decode token
    prefills: list = field(default_factory=list)      # (slot, tokens, cached) of each prompt chunk
    prompt_left: bool = False                         # a prompt in it continues in a later step

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def tokens(self) -> int:
        return len(self.decodes) + sum(tokens for _, tokens, _ in self.prefills)


def _seconds(match) -> float:
    minutes, seconds, millis, micros = (int(g) for g in match.groups()[:4])
    return minutes * 60 + seconds + millis / 1e3 + micros / 1e6


def read_steps(text: str) -> list[Step]:
    """The decoded steps of a llama-server log, in order (see the module docstring)."""
    steps: list[Step] = []
    decodes, chunks = [], []                 # what the next decode call carries
    prompt_tokens: dict[int, int] = {}       # task -> its prompt's tokens
    starts: list[tuple] = []                 # (step index, slot, task, cached) of every chunk
    lines = (part for line in text.splitlines() for part in LINE_START.split(line) if part)
    for number, line in enumerate(lines, 1):
        stamped = TIMESTAMP.match(line)
        if not stamped:
            continue
        t_s, body = _seconds(stamped), stamped.group(5)
        slot_line = SLOT_LINE.match(body)
        if slot_line:
            slot, task, rest = int(slot_line.group(1)), int(slot_line.group(2)), slot_line.group(3)
            if NEW_PROMPT.match(rest):
                prompt_tokens[task] = int(NEW_PROMPT.match(rest).group(1))
            elif CHUNK.match(rest):
                chunks.append((slot, task, int(CHUNK.match(rest).group(1))))
            elif DECODE_TOKEN.match(rest):
                decodes.append((slot, int(DECODE_TOKEN.match(rest).group(1))))
            continue
        call = DECODE_CALL.match(body)
        if call:
            if int(call.group(2)) != 0:
                raise ServerLogError(f"server log entry {number}: a batch decoded in parts (off = {call.group(2)}): "
                                     "the KV cache ran out of room")
            starts += [(len(steps), slot, task, cached) for slot, task, cached in chunks]
            steps.append(Step(t_s, int(call.group(1)), decodes=decodes))
            decodes, chunks = [], []
        elif DECODE_DONE.match(body) and steps and steps[-1].end_s is None:
            steps[-1].end_s = t_s
    if not steps:
        raise ServerLogError("server log: no `n_batch (effective)` line; was llama-server run at -lv 5 with "
                             "--log-timestamps?")
    # a chunk ends where its task's next chunk starts, or at the end of the prompt
    for position, (index, slot, task, cached) in enumerate(starts):
        later = [c for i, _, t, c in starts[position + 1:] if t == task]
        if task not in prompt_tokens:
            raise ServerLogError(f"server log: task {task} adds prompt tokens but its `new prompt` line is missing")
        end = later[0] if later else prompt_tokens[task]
        steps[index].prefills.append((slot, end - cached, cached))
        steps[index].prompt_left |= end < prompt_tokens[task]
    return [step for step in steps if step.end_s is not None]


def check_rule(steps: list[Step]) -> dict:
    """llama-server's batch rule, as the `llamacpp` policy simulates it, held against the logged steps: how
    many steps exceed n_batch, and how many left prompt tokens for a later step without being full (both 0
    when the rule holds)."""
    return {"steps": len(steps), "over_n_batch": sum(1 for step in steps if step.tokens > step.n_batch),
            "split_without_full_batch": sum(1 for step in steps if step.prompt_left and step.tokens < step.n_batch),
            "prompt_chunks": sum(len(step.prefills) for step in steps),
            "split_chunks": sum(1 for step in steps for _, _, cached in step.prefills if cached)}
