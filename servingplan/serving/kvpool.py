"""The engine's KV layout and the two step functions that run the model on it.

The profiler times these same functions on the same layout, so a profiled point and an engine step of
the same shape execute the same code (views, masks, copies), and the cost model fitted on the profile
describes what the engine does:

    configure_allocator()                                process-wide malloc setting both must run under
    prefill_call(model, input_ids, cache=None)           one prompt (or chunk), logits of its last token
    decode_call(model, input_ids, cache, mask, positions) one new token for each of B padded sequences
    KVPool(config, slots, capacity, device)              one preallocated K and V tensor per pool
    prefill_step(model, pool, slot, input_ids, cached)   prefill a slot after its `cached` entries
    decode_step(model, pool, lengths, input_ids)         one decode step of slots 0..B-1

The pool lives on the model's device (config `model.device`); the two step functions take their ids and
lengths from anywhere, move them there, and return only once the device has done the step's work
(servingplan.device.wait_for), so whoever times them, the profiler or the engine, times the work.

KV layout. Every running sequence owns a slot of one preallocated pool per K and V, shaped
[layer, slot, head, position, head_dim]; its entries sit at positions 0..n-1 of its slot.

- Prefill of n prompt tokens after `cached` ones: a DynamicCache whose layers are views of the slot's
  first `cached` positions (no copy; nothing at all for a fresh prompt), one prefill_call, then the n
  new entries are copied into the slot.
- Decode of B sequences in slots 0..B-1: the batch's past is the view pool[:, :B, :, :T] (T = the
  longest context, shorter ones right-padded), built without copying. The attention mask is 1 on each
  sequence's own entries and on the new token, 0 on the padding; position_ids are each sequence's own
  length. Inside decode_call DynamicCache concatenates the new token onto the past, copying B * (T + 1)
  entries per layer; afterwards the new entry is scattered to position n_b of each slot. The padding is
  real work: the decode reads B * T entries, ctx_mode "padded_max" of the cost model.
"""
from __future__ import annotations

import ctypes
import ctypes.util

import torch
from transformers import DynamicCache

from servingplan.device import wait_for

# glibc mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
INT_MAX = 2**31 - 1


def configure_allocator() -> str:
    """Keep freed memory in the process for reuse instead of handing it back to the OS.

    A DynamicCache grows by torch.cat, which allocates every layer's cache anew at each decode step.
    Under glibc's defaults a block above 32 MiB (one layer's keys beyond ~11k batch x context tokens
    for GPT-2 small) is mmap-ed fresh each time and all its pages faulted in and zeroed: on the 2-core
    profiling machine decode at batch 64 x 768 tokens took 1.5 s instead of 0.54 s, and the step time
    bent upward past that size instead of growing linearly with the KV tokens read. Serving every block
    from the heap and never trimming it reuses the pages. It is process-wide and must be in force in
    the engine as in the profiler, or the engine runs slower than its cost model. Returns what was set.
    """
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return "system default (no glibc mallopt)"
    if mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, INT_MAX):
        return "glibc: no mmap, no trim"
    return "system default (mallopt refused)"


@torch.inference_mode()
def prefill_call(model, input_ids: torch.Tensor, cache: DynamicCache | None = None):
    """Process prompt tokens [B, L] after whatever `cache` holds; the cache grows by L (a fresh one is
    built when None, and returned as .past_key_values). Logits only for the last position."""
    return model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)


@torch.inference_mode()
def decode_call(model, input_ids: torch.Tensor, cache: DynamicCache, attention_mask: torch.Tensor,
                position_ids: torch.Tensor):
    """One decode step: input_ids [B, 1], cache holding the B sequences padded to one length T,
    attention_mask [B, T+1] (0 on padding), position_ids [B, 1]. The cache grows by one token."""
    return model(input_ids=input_ids, past_key_values=cache, attention_mask=attention_mask,
                 position_ids=position_ids, use_cache=True)


class KVPool:
    """The KV entries of every running sequence, one slot each, in two preallocated tensors."""

    def __init__(self, config, slots: int, capacity: int, device: torch.device | str = "cpu"):
        head_dim = config.n_embd // config.n_head
        shape = (config.n_layer, slots, config.n_head, capacity, head_dim)
        self.device = torch.device(device)
        # zeros, not empty: padded positions are masked, but a NaN left in memory would still
        # poison the attention output (0 * NaN) through the value product.
        self.keys = torch.zeros(shape, device=self.device)
        self.values = torch.zeros(shape, device=self.device)
        self.config = config
        self.owner: list = [None] * slots
        # entries each slot holds, counted here: a Seq's counters move only when its step completes
        self.stored = [0] * slots
        self.slot_of: dict = {}

    def acquire(self, seq) -> int:
        """The highest free slot: decoders gather at the low end, so a new prompt disturbs them least."""
        slot = max(i for i, owner in enumerate(self.owner) if owner is None)
        self.owner[slot] = seq
        self.stored[slot] = 0
        self.slot_of[seq] = slot
        return slot

    def release(self, seq) -> None:
        slot = self.slot_of.pop(seq, None)
        if slot is not None:
            self.owner[slot] = None

    def holds(self, seq) -> bool:
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

    def store_prefill(self, slot: int, cache: DynamicCache, start: int, tokens: int) -> None:
        for index, layer in enumerate(cache.layers):
            self.keys[index, slot, :, start:start + tokens] = layer.keys[0, :, start:start + tokens]
            self.values[index, slot, :, start:start + tokens] = layer.values[0, :, start:start + tokens]
        self.stored[slot] = start + tokens

    def store_decode(self, cache: DynamicCache, lengths: torch.Tensor) -> None:
        """Scatter the newest entry of batch row b (slot b) to position lengths[b]."""
        rows = torch.arange(len(lengths), device=lengths.device)
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
        length_a = self.stored[a] if self.owner[a] is not None else 0
        length_b = self.stored[b] if self.owner[b] is not None else 0
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


def prefill_step(model, pool: KVPool, slot: int, input_ids: torch.Tensor, cached: int) -> torch.Tensor:
    """Prefill input_ids [1, n] into `slot` after its first `cached` entries; the logits of the last
    prompt token."""
    tokens = input_ids.shape[1]
    cache = pool.cache_view(slice(slot, slot + 1), cached) if cached else None
    output = prefill_call(model, input_ids.to(pool.device), cache)
    pool.store_prefill(slot, output.past_key_values, cached, tokens)
    wait_for(pool.device)
    return output.logits[0, -1]


def decode_mask(lengths: torch.Tensor) -> torch.Tensor:
    """[B, T+1] attention mask of a batch padded to T = max(lengths): each row's own entries and the
    new token."""
    past = int(lengths.max())
    mask = (torch.arange(past + 1, device=lengths.device) < lengths[:, None]).long()
    mask[:, past] = 1
    return mask


def decode_step(model, pool: KVPool, lengths: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """One decode step of the sequences in slots 0..B-1 holding `lengths` entries, fed input_ids
    [B, 1]; stores each new entry and returns the logits [B, vocab]."""
    cache = pool.cache_view(slice(0, len(lengths)), int(lengths.max()))
    lengths = lengths.to(pool.device)
    logits = decode_call(model, input_ids.to(pool.device), cache, decode_mask(lengths), lengths[:, None]).logits
    pool.store_decode(cache, lengths)
    wait_for(pool.device)
    return logits[:, -1]
