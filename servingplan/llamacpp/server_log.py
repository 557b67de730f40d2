"""llama-server's own per-step log, read back into steps: what each iteration (one llama_decode) held and
how long it took.

llama-server at `-lv 5 --log-timestamps` (servingplan.llamacpp.server.STEP_LOG_ARGS) prints, from its one
serving loop (tools/server/server-context.cpp of 0c1e570):
- `processing task` when a slot takes a request;
- `slot decode token, ..., n_tokens = N` for each generating slot it adds to the batch (N: the tokens the
  slot holds, its context);
- `n_batch (effective) = ..., off = 0` right before llama_decode;
- after the decode, `n_gen = ...` for each slot that sampled a token, and the next iteration's lines.
HTTP threads log too (requests received, responses sent); only the serving loop's lines mark a step.

A step starts at its `n_batch (effective)` line and ends at the serving loop's next line: the decode, its
sampling and the next batch's assembly (sub-millisecond beside a step). The log does not count the prompt
tokens a step carries, so they are reconstructed by llama-server's rule, which the `llamacpp` policy
simulates: the prompts of the slots still prefilling fill the batch, in slot order, up to n_batch minus the
decode tokens. A slot's prompt length is the context its first decode token reports. The reconstruction is
checked against the log: a slot whose prompt it completes in a step must add its first decode token in the
next step (`check`, counted, never hidden).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

# "MM.SS.mmm.uuu " from --log-timestamps (minutes, seconds, milliseconds, microseconds since start), then
# the optional level letter of --log-prefix
TIMESTAMP = re.compile(r"^(\d+)\.(\d{2})\.(\d{3})\.(\d{3}) (?:[A-Z] )?(.*)$")
SLOT_LINE = re.compile(r"^slot\s+\S+: id\s+(\d+) \| task (-?\d+) \| (.*)$")
LAUNCH = re.compile(r"^processing task")
DECODE_TOKEN = re.compile(r"^slot decode token, id=\d+, n_ctx = \d+, n_tokens = (\d+)")
RELEASE = re.compile(r"^stop processing: n_tokens = (\d+)")
DECODE_CALL = re.compile(r"^srv\s+decode: n_batch \(effective\) = (\d+), off = (\d+)")
# serving-loop lines of the server itself (not its HTTP threads)
LOOP_SRV = re.compile(r"^srv\s+(update_slots|decode|process_sing|pop_deferre):")


class ServerLogError(ValueError):
    """The log does not read as llama-server's step log: one line saying where."""


@dataclass
class Step:
    start_s: float
    end_s: float | None = None
    decodes: list = field(default_factory=list)       # (slot, context) of each decode token
    prefills: list = field(default_factory=list)      # (slot, tokens, cached) of each prompt chunk

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


def _seconds(match) -> float:
    minutes, seconds, millis, micros = (int(g) for g in match.groups()[:4])
    return minutes * 60 + seconds + millis / 1e3 + micros / 1e6


def read_events(text: str) -> list[tuple]:
    """The serving loop's events in order: (t_s, kind, slot, task, value), kind one of launch,
    decode_token (value: context), release, decode_call, loop (any other serving-loop line)."""
    events = []
    for number, line in enumerate(text.splitlines(), 1):
        stamped = TIMESTAMP.match(line)
        if not stamped:
            continue
        t_s, body = _seconds(stamped), stamped.group(5)
        slot_line = SLOT_LINE.match(body)
        if slot_line:
            slot, task, rest = int(slot_line.group(1)), int(slot_line.group(2)), slot_line.group(3)
            if LAUNCH.match(rest):
                events.append((t_s, "launch", slot, task, None))
            elif DECODE_TOKEN.match(rest):
                events.append((t_s, "decode_token", slot, task, int(DECODE_TOKEN.match(rest).group(1))))
            elif RELEASE.match(rest):
                events.append((t_s, "release", slot, task, None))
            else:
                events.append((t_s, "loop", slot, task, None))
            continue
        call = DECODE_CALL.match(body)
        if call:
            if int(call.group(2)) != 0:
                raise ServerLogError(f"server log line {number}: a batch decoded in parts (off = {call.group(2)}): "
                                     "the KV cache ran out of room")
            events.append((t_s, "decode_call", None, None, int(call.group(1))))
        elif LOOP_SRV.match(body):
            events.append((t_s, "loop", None, None, None))
    return events


def prompt_lengths(events) -> dict[int, int]:
    """{task: prompt tokens}: the context its slot reports with its first decode token."""
    lengths = {}
    for _, kind, _, task, value in events:
        if kind == "decode_token" and task not in lengths:
            lengths[task] = value
    return lengths


def read_steps(text: str, n_batch: int) -> tuple[list[Step], dict]:
    """The steps of a llama-server log (see the module docstring) and the reconstruction's check:
    {steps, prompts_completed, first_token_next_step (how many of those the log confirms), unknown_prompts
    (tasks that never decoded: their prompts cannot be sized, and the steps they were in are left out)}."""
    events = read_events(text)
    if not any(kind == "decode_call" for _, kind, *_ in events):
        raise ServerLogError("server log: no `n_batch (effective)` line; was llama-server run at -lv 5 with "
                             "--log-timestamps?")
    lengths = prompt_lengths(events)
    prefilling: dict[int, list] = {}      # slot -> [task, prompt tokens done]
    pending_decodes: list = []
    steps: list[Step] = []
    open_step: Step | None = None
    completed_in: dict[int, int] = {}     # task -> index of the step that completed its prompt
    first_decode_step: dict[int, int] = {}
    unknown, dropped = set(), set()
    for t_s, kind, slot, task, value in events:
        if open_step is not None and kind != "decode_call" and open_step.end_s is None:
            open_step.end_s = t_s
        if kind == "launch":
            prefilling[slot] = [task, 0]
        elif kind == "decode_token":
            pending_decodes.append((slot, value))
            first_decode_step.setdefault(task, len(steps))
        elif kind == "decode_call":
            if open_step is not None and open_step.end_s is None:
                open_step.end_s = t_s
            step = Step(t_s, decodes=pending_decodes)
            pending_decodes = []
            room = value - len(step.decodes)
            for prompt_slot in sorted(prefilling):
                prompt_task, done = prefilling[prompt_slot]
                if prompt_task not in lengths:
                    unknown.add(prompt_task)
                    dropped.add(len(steps))
                    continue
                tokens = min(lengths[prompt_task] - done, room)
                if tokens <= 0:
                    continue
                step.prefills.append((prompt_slot, tokens, done))
                prefilling[prompt_slot][1] += tokens
                room -= tokens
                if prefilling[prompt_slot][1] == lengths[prompt_task]:
                    completed_in[prompt_task] = len(steps)
            prefilling = {s: v for s, v in prefilling.items() if v[1] < lengths.get(v[0], float("inf"))}
            steps.append(step)
            open_step = step
        elif kind == "release":
            prefilling.pop(slot, None)
    confirmed = sum(1 for task, index in completed_in.items() if first_decode_step.get(task) == index + 1)
    kept = [step for index, step in enumerate(steps) if index not in dropped and step.end_s is not None]
    return kept, {"steps": len(steps), "steps_kept": len(kept), "prompts_completed": len(completed_in),
                  "first_token_next_step": confirmed, "unknown_prompts": len(unknown)}
