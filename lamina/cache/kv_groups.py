"""The sliding-window layers' own block pool when a model mixes them with full-attention layers (Gemma 2/3).

A model whose KV layers are all full attention (or all sliding window) keeps one block table per sequence:
block b is row b of every KV layer's allocation (cache/kv_cache.py). When sliding-window and full layers are
interleaved, one shared table would keep every block alive for the full layers, so the sliding layers would
hold the whole context too. Instead the KV layers form two groups:
  - the primary group (full attention, latent attention): `seq.block_table`, the engine's `allocator`;
  - the window group (the sliding-window layers): `seq.window_table`, a WindowGroup's own allocator over a
    pool of its own size. Its entries wholly before the window of the sequence's next query point at that
    allocator's null block (cache/sliding_window.py), and their blocks go back to it.
Both tables index the same logical blocks (entry i covers positions [i * bs, (i + 1) * bs)), have the same
length and grow together; the runner sends each group its own block tables and slot mapping
(AttentionMetadata.window), and a sliding layer bound to the window pool (KVBlocks.windowed) reads those.

Prefix caching registers a computed block under its chain hash in both allocators; a hit of d blocks needs
the primary chain [0, d) and the window group's blocks [first_live_block(d * bs), d) (cache/prefix_cache.py).
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

from lamina.cache.block_allocator import BlockAllocator
from lamina.cache.sliding_window import drop_dead_blocks
from lamina.cache.specs import BlockSpec, SlidingWindowSpec


class WindowedSequence(Protocol):
    window_table: list[int]
    num_computed_tokens: int


class GroupedSequence(WindowedSequence, Protocol):
    block_table: list[int]


def mixed_window(specs: Seq[BlockSpec]) -> int | None:
    """The window group's window (the largest sliding window: a block is dead only once every sliding layer
    stopped reading it) when sliding-window layers sit next to other KV layers; None otherwise (all-sliding
    models free blocks through their one table, cache/sliding_window.py)."""
    sliding = [s.window for s in specs if isinstance(s, SlidingWindowSpec)]
    if not sliding or len(sliding) == len(specs):
        return None
    return max(sliding)


def windowed_layers(specs: Seq[BlockSpec]) -> list[bool]:
    """Which KV layers (in spec order) keep their KV in the window group's pool."""
    if mixed_window(specs) is None:
        return [False] * len(specs)
    return [isinstance(s, SlidingWindowSpec) for s in specs]


def window_pool_blocks(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Blocks (null block included) the window pool needs so that it never runs dry before the primary pool
    for `max_num_seqs` running sequences: a sequence whose next query is at p and that computes n tokens holds
    the blocks of positions [p - window + 1, p + n), at most floor((window - 2 + n) / bs) + 2 of them, which
    is <= floor((window - 2) / bs) + 3 + n / bs; the step's n sum to at most max_num_batched_tokens."""
    per_seq = max(window - 2, 0) // block_size + 3
    return max_num_seqs * per_seq + (max_num_batched_tokens + block_size - 1) // block_size + 1


@dataclass
class WindowGroup:
    """The window group's allocator and the table operations the scheduler mirrors on `seq.window_table`."""

    allocator: BlockAllocator  # reserves a null block
    window: int
    block_size: int

    def __post_init__(self) -> None:
        assert self.allocator.null_block is not None, "the window pool's allocator must reserve a null block"

    def blocks_needed(self, seq: WindowedSequence, total: int) -> int:
        """New blocks for a table of `total` entries, after the dead ones were dropped (drop first)."""
        return max(0, total - len(seq.window_table))

    def fits(self, seq: WindowedSequence, total: int) -> bool:
        """Drops the sequence's dead blocks, then whether its table can grow to `total` entries."""
        self.drop(seq)
        return self.blocks_needed(seq, total) <= self.allocator.num_free

    def drop(self, seq: WindowedSequence) -> int:
        """Frees the blocks wholly before the window of the sequence's next query; returns how many."""
        seq.window_table, n = drop_dead_blocks(seq.window_table, seq.num_computed_tokens, self.allocator,
                                               self.block_size, self.window)
        return n

    def grow(self, seq: WindowedSequence, total: int) -> None:
        """Extends the table to `total` entries (the caller checked blocks_needed against num_free)."""
        need = self.blocks_needed(seq, total)
        if need:
            seq.window_table = seq.window_table + self.allocator.allocate(need)  # a new list: resent

    def release(self, seq: WindowedSequence) -> None:
        self.allocator.free(seq.window_table[::-1])  # tail first, like the primary table
        seq.window_table = []

    def trim(self, seq: WindowedSequence, keep: int) -> None:
        """Keeps the first `keep` entries (the primary table was cut to the same length)."""
        if len(seq.window_table) > keep:
            self.allocator.free(seq.window_table[:keep - 1:-1] if keep else seq.window_table[::-1])
            seq.window_table = seq.window_table[:keep]


def free_tables(seq: GroupedSequence, allocator: BlockAllocator, window_group: WindowGroup | None) -> None:
    """Frees the sequence's blocks of every group (each table tail first: evicted before its shared head)."""
    allocator.free(seq.block_table[::-1])
    seq.block_table = []
    if window_group is not None:
        window_group.release(seq)
