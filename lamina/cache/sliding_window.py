"""Freeing the KV blocks that fell out of every sliding window.

The KV layers that share a block table (cache/specs.py) can give a block back only when none of them will
read it again. A query at position p of a sliding-window layer reads keys (p - window, p] and later queries
sit further right, so the blocks wholly before the horizon of the earliest query a step computes are dead:
they are returned to the allocator and their block-table entries point at the allocator's null block from
then on. That applies to the one table of a model whose KV layers are all sliding-window ones (Mistral,
Gemma 3 variants configured sliding-only), and to the window group's table of a model that interleaves them
with full-attention layers (Gemma 2/3: cache/kv_groups.py), whose full layers keep every block in theirs.

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
    """The window after which blocks are dead: the largest window (a block is dead once no layer reads it)
    when every KV layer is sliding-window, else None (some layer reads the whole context, or there is no KV
    layer)."""
    if not specs or not all(isinstance(s, SlidingWindowSpec) for s in specs):
        return None
    return max(s.window for s in specs)


def first_live_block(position: int, window: int, block_size: int) -> int:
    """Index of the first block a query at `position` (or later) reads: keys from position - window + 1."""
    return max(0, position - window + 1) // block_size


def window_blocks(window: int, chunk: int, block_size: int) -> int:
    """The most blocks one sequence holds at once: the window behind its first query plus a chunk of
    `chunk` new tokens, each end possibly straddling a block boundary."""
    return (window - 1 + chunk + block_size - 1) // block_size + 1


def drop_dead_blocks(table: list[int], position: int, allocator: BlockAllocator, block_size: int,
                     window: int) -> tuple[list[int], int]:
    """Frees the blocks of `table` wholly before the window of a query at `position` and returns (the table
    with their entries pointing at the null block: a new list if anything changed, and how many went back).

    A table's null entries always form a prefix (drops null a prefix, a prefix-cache hit starts with one,
    growth appends blocks), so a call that has nothing to drop costs O(1) and one that has, a binary search
    for where the nulls end plus the new list: this runs for every running sequence every step."""
    null = allocator.null_block
    assert null is not None, "the allocator must reserve a null block"
    n = min(first_live_block(position, window, block_size), len(table))
    if n == 0 or table[n - 1] == null:
        return table, 0
    lo, hi = 0, n - 1  # the first non-null entry is in [lo, hi]
    while lo < hi:
        mid = (lo + hi) // 2
        if table[mid] == null:
            lo = mid + 1
        else:
            hi = mid
    dead = table[lo:n]
    allocator.free(dead)  # oldest first, so a registered one is evicted before the ones dropped after it
    return [null] * n + table[n:], len(dead)


def drop_out_of_window(seq: WindowedSequence, allocator: BlockAllocator, block_size: int, window: int) -> int:
    """Frees the sequence's blocks wholly before the window of its next query (num_computed_tokens) and
    points their entries at the null block; returns how many blocks went back."""
    seq.block_table, n = drop_dead_blocks(seq.block_table, seq.num_computed_tokens, allocator, block_size, window)
    return n
