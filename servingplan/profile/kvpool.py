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

Both step functions hand the model a PoolCache over the slots they run: each layer writes the call's new
K/V entries into the pool, in place, and attention reads views of the pool. Nothing is allocated or
copied that grows with the batch's past (transformers' DynamicCache would concatenate the new entries
onto a copy of the whole past at every call, B * (T + 1) entries per layer and step).

- Prefill of n prompt tokens after `cached` ones: the n new entries go to positions cached..cached+n-1
  of the slot; attention reads positions 0..cached+n-1.
- Decode of B sequences in slots 0..B-1 holding n_b entries each: row b's new entry goes to position
  n_b of its slot, and attention reads the view pool[:, :B, :, :T+1] (T = the longest n_b), so the
  shorter rows are right-padded. The attention mask is 1 on each row's positions 0..n_b (its own entries
  and its new token) and 0 on the padding after them; position_ids are each sequence's own length. The
  padding is real work: the decode reads B * (T + 1) entries, ctx_mode "padded_max" of the cost model.
"""
from __future__ import annotations

import ctypes
import ctypes.util

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from servingplan.device import wait_for

# glibc mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
INT_MAX = 2**31 - 1


def configure_allocator() -> str:
    """Keep freed memory in the process for reuse instead of handing it back to the OS.

    Under glibc's defaults a block above 32 MiB is mmap-ed fresh each time and all its pages faulted in
    and zeroed. When every decode step concatenated the whole cache into new tensors (one layer's keys
    pass 32 MiB beyond ~11k batch x context tokens for GPT-2 small), decode at batch 64 x 768 tokens took
    1.5 s instead of 0.54 s on the 2-core profiling machine. The step functions now write KV in place,
    but a step still allocates its activations and logits (tens of MiB at large batches and prompts),
    and the profiler's batched prefill grows a DynamicCache. Serving every block from the heap and never
    trimming it reuses the pages. It is process-wide and must be in force in the engine as in the
    profiler, or the engine runs under another allocator than its cost model. Returns what was set.
    """
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return "system default (no glibc mallopt)"
    if mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, INT_MAX):
        return "glibc: no mmap, no trim"
    return "system default (mallopt refused)"


@torch.inference_mode()
def prefill_call(model, input_ids: torch.Tensor, cache: Cache | None = None):
    """Process prompt tokens [B, L] after whatever `cache` holds; the cache grows by L (a fresh one is
    built when None, and returned as .past_key_values). Logits only for the last position."""
    return model(input_ids=input_ids, past_key_values=cache, use_cache=True, logits_to_keep=1)


@torch.inference_mode()
def decode_call(model, input_ids: torch.Tensor, cache: Cache, attention_mask: torch.Tensor,
                position_ids: torch.Tensor):
    """One decode step: input_ids [B, 1], cache holding the B sequences padded to one length T,
    attention_mask [B, T+1] (0 on padding), position_ids [B, 1]. The cache grows by one token."""
    return model(input_ids=input_ids, past_key_values=cache, attention_mask=attention_mask,
                 position_ids=position_ids, use_cache=True)


class PoolLayer(CacheLayerMixin):
    """One layer's K and V for one call, held in the pool: `update` writes the call's new entries into
    their positions, in place, and returns views of the pool for attention to read.

    rows: the pool slots the call's batch rows are (a slice: slot, or slots 0..B-1).
    past: how many entries the longest row holds before the call (what the mask counts as seen).
    write_at: per batch row, the position its one new entry goes to (decode); None writes the call's
    entries at positions past.. of the single row (prefill).
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: slice, past: int,
                 write_at: torch.Tensor | None = None):
        super().__init__()
        self.pool_keys, self.pool_values = keys, values
        self.rows, self.past, self.write_at = rows, past, write_at
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to allocate: the pool is preallocated."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        new = key_states.shape[-2]
        if self.write_at is None:
            self.pool_keys[self.rows, :, self.past:self.past + new] = key_states
            self.pool_values[self.rows, :, self.past:self.past + new] = value_states
        else:
            batch_rows = torch.arange(self.rows.start, self.rows.stop, device=self.write_at.device)
            self.pool_keys[batch_rows, :, self.write_at] = key_states[:, :, 0]
            self.pool_values[batch_rows, :, self.write_at] = value_states[:, :, 0]
        self.keys = self.pool_keys[self.rows, :, :self.past + new]
        self.values = self.pool_values[self.rows, :, :self.past + new]
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.past + query_length, 0

    def get_seq_length(self) -> int:
        return self.past

    def get_max_length(self) -> int:
        return self.pool_keys.shape[-2]


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

    def prefill_cache(self, slot: int, cached: int) -> Cache:
        """The cache a prefill of `slot` after its first `cached` entries runs on."""
        return Cache(layers=[PoolLayer(keys, values, slice(slot, slot + 1), cached)
                             for keys, values in zip(self.keys, self.values)])

    def decode_cache(self, lengths: torch.Tensor) -> Cache:
        """The cache a decode step of slots 0..B-1 holding `lengths` entries runs on."""
        rows, past = slice(0, len(lengths)), int(lengths.max())
        return Cache(layers=[PoolLayer(keys, values, rows, past, write_at=lengths)
                             for keys, values in zip(self.keys, self.values)])

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
    output = prefill_call(model, input_ids.to(pool.device), pool.prefill_cache(slot, cached))
    pool.stored[slot] = cached + input_ids.shape[1]
    wait_for(pool.device)
    return output.logits[0, -1]


def decode_mask(lengths: torch.Tensor) -> torch.Tensor:
    """[B, T+1] attention mask of a batch padded to T = max(lengths): row b's own entries and its new
    token, which the step writes at position lengths[b]."""
    past = int(lengths.max())
    return (torch.arange(past + 1, device=lengths.device) <= lengths[:, None]).long()


def decode_step(model, pool: KVPool, lengths: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """One decode step of the sequences in slots 0..B-1 holding `lengths` entries, fed input_ids
    [B, 1]; writes each new entry at position lengths[b] of its slot and returns the logits [B, vocab]."""
    lengths = lengths.to(pool.device)
    logits = decode_call(model, input_ids.to(pool.device), pool.decode_cache(lengths), decode_mask(lengths),
                         lengths[:, None]).logits
    pool.stored[:len(lengths)] = (lengths + 1).tolist()
    wait_for(pool.device)
    return logits[:, -1]
