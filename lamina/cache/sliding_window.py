"""Freeing the KV blocks that fell out of every sliding window.

All KV layers share one block table (cache/specs.py), so a block can go back to the pool only when no layer
will read it again. With full-attention layers in the model (Gemma 2/3 interleave them) that never happens:
those layers read every past token. When every KV layer is a sliding-window layer (Mistral, Gemma 3
variants configured sliding-only), a query at position p reads keys (p - window, p] and later queries sit
further right, so the blocks wholly before the horizon of the earliest query a step computes are dead: they
are returned to the allocator and their block-table entries point at the allocator's null block from then on.

Why this is safe:
  - The entries are replaced before the step's blocks are allocated and relative to the first position the
    step computes (num_computed_tokens), which no later step goes below (rejected draft tokens roll back to
    at least that position); a block freed now is reused by a later write, which runs after every kernel that
    read it (stream order).
  - The attention kernels never read a key before (q - window): the Triton kernels start their loops at the
    window's first key, and the torch reference reads the null block (zeros, never written) and masks it.
  - The table is replaced by a new list, so engine/block_tables.py resends the row to the device.

Prefix caching: a dropped block that is registered waits in the allocator's LRU like any released cached
block. A later match does not need the chain from position 0: for a prefix of d blocks it needs only the
blocks its first query's window reaches (cache/prefix_cache.py, `window`). The chain digests make each
block's hash name its whole prefix, so a hit is exact even with the head blocks evicted.
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from typing import Protocol

from lamina.cache.block_allocator import BlockAllocator
from lamina.cache.specs import BlockSpec, SlidingWindowSpec


class WindowedSequence(Protocol):
    block_table: list[int]
    num_computed_tokens: int


def release_horizon(specs: Seq[BlockSpec]) -> int | None:
    """The window after which blocks are dead: the smallest window when every KV layer is sliding-window,
    else None (some layer reads the whole context, or there is no KV layer)."""
    if not specs or not all(isinstance(s, SlidingWindowSpec) for s in specs):
        return None
    return min(s.window for s in specs)


def first_live_block(position: int, window: int, block_size: int) -> int:
    """Index of the first block a query at `position` (or later) reads: keys from position - window + 1."""
    return max(0, position - window + 1) // block_size


def window_blocks(window: int, chunk: int, block_size: int) -> int:
    """The most blocks one sequence holds at once: the window behind its first query plus a chunk of
    `chunk` new tokens, each end possibly straddling a block boundary."""
    return (window - 1 + chunk + block_size - 1) // block_size + 1


def drop_out_of_window(seq: WindowedSequence, allocator: BlockAllocator, block_size: int, window: int) -> int:
    """Frees the sequence's blocks wholly before the window of its next query (num_computed_tokens) and
    points their entries at the null block; returns how many blocks went back."""
    null = allocator.null_block
    assert null is not None, "the allocator must reserve a null block"
    table = seq.block_table
    n = min(first_live_block(seq.num_computed_tokens, window, block_size), len(table))
    dead = [b for b in table[:n] if b != null]
    if not dead:
        return 0
    seq.block_table = [null] * n + table[n:]
    allocator.free(dead)  # oldest first, so a registered one is evicted before the ones dropped after it
    return len(dead)
