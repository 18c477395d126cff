"""Prefix caching: full KV blocks keyed by a hash chain of (parent hash, the block's token ids[, extra]).

A new sequence reuses the longest chain of cached blocks that matches its tokens; the shared blocks are
reference-counted by the allocator, which keeps unreferenced cached blocks until it must evict them (LRU).
For hybrid models a hit also needs a snapshot of the recurrent state at its end (cache/state_snapshots.py).
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Protocol

from lamina.cache.block_allocator import BlockAllocator
from lamina.cache.kv_groups import WindowGroup
from lamina.cache.sliding_window import first_live_block
from lamina.cache.state_snapshots import StateSnapshots

ROOT = bytes(32)  # the parent digest of a sequence's first block


def chain_hash(parent: bytes | None, tokens: list[int] | tuple[int, ...], extra: bytes = b"") -> bytes:
    """SHA-256 of (parent digest, extra, the block's token ids as int32 bytes): a collision-resistant key,
    so a prompt cannot be crafted to land on another request's cached blocks, and stable across processes.

    `extra` is whatever else changes a block's KV for the same tokens (a LoRA adapter, later); it is
    length-prefixed so that it cannot run into the token bytes. ~1.6 us per 16-token block on one CPU core
    (Python hash() of the tuple: ~0.2 us), computed once per block of a sequence."""
    h = hashlib.sha256(parent if parent is not None else ROOT)
    h.update(len(extra).to_bytes(4, "little"))
    h.update(extra)
    h.update(array("i", tokens).tobytes())
    return h.digest()


class CachedSequence(Protocol):
    """What the prefix cache reads and writes on a sequence (engine/request.py's Sequence has all of it)."""

    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    window_table: list[int]
    state_slot: int | None
    block_hashes: list[bytes]
    num_registered_blocks: int
    claimed: list[bytes]
    claim_start: int
    wait_depth: int
    num_cached_tokens: int
    num_preemptions: int

    @property
    def num_tokens(self) -> int: ...


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, block_size: int, snapshots: StateSnapshots | None = None,
                 window: int | None = None, window_group: WindowGroup | None = None) -> None:
        self.allocator, self.block_size = allocator, block_size
        # Models mixing sliding-window and full layers: blocks are registered in both groups' allocators, and
        # a hit also needs the window group's blocks its first query's window reaches (cache/kv_groups.py).
        self.window_group = window_group
        self.snapshots = snapshots  # hybrid models: recurrent-state snapshots keyed by the same chain hashes
        # Sliding-window-only models (cache/sliding_window.py): a hit needs only the blocks the window of its
        # first computed token reaches; the ones before it come back as the allocator's null block.
        self.window = window
        self.queried_tokens = 0
        self.hit_tokens = 0
        # Block hash -> running sequences that will compute that block. A new request whose next uncached
        # block is being computed right now waits for it instead of computing the same prefix again (a
        # burst of requests sharing a system prompt would otherwise all prefill it at once).
        self.computing: dict[bytes, int] = {}

    def _hashes(self, seq: CachedSequence, n_blocks: int) -> list[bytes]:
        bs = self.block_size
        hashes = seq.block_hashes
        while len(hashes) < n_blocks:
            i = len(hashes)
            hashes.append(chain_hash(hashes[-1] if hashes else None, seq.token_ids[i * bs:(i + 1) * bs]))
        return hashes[:n_blocks]

    def match(self, seq: CachedSequence) -> tuple[list[int], int | None]:
        """Cached blocks for the longest usable matching prefix, each now shared by `seq`, and (hybrid models)
        the snapshot to restore at its end. At least one token is always left to compute, since the step must
        produce logits. With snapshots, the prefix ends at the deepest block whose chain hash has both a
        cached KV block chain up to it and a state snapshot: KV without the state there is useless. With a
        window group the sequence's window_table is set to that group's blocks of the same prefix."""
        usable = (seq.num_tokens - 1) // self.block_size
        hashes = self._hashes(seq, usable)
        if self.window is not None:
            return self._match_windowed(hashes)
        found = []
        for h in hashes:
            b = self.allocator.lookup(h)
            if b is None:
                break
            found.append(b)
        if self.window_group is not None:
            return self._match_mixed(seq, hashes, found)
        snap = None
        if self.snapshots is not None:
            depth = 0
            for i in range(len(found) - 1, -1, -1):
                snap = self.snapshots.lookup(hashes[i])
                if snap is not None:
                    depth = i + 1
                    break
            found = found[:depth]
        for b in found:
            self.allocator.share(b)
        return found, snap

    def _match_windowed(self, hashes: list[bytes]) -> tuple[list[int], int | None]:
        """The deepest prefix of d blocks whose blocks [first_live_block(d * bs), d) are all cached (and, with
        snapshots, that has a snapshot at its end); each block's chain hash names its whole prefix."""
        bs = self.block_size
        blocks = [self.allocator.lookup(h) for h in hashes]
        best, snap = self._deepest_live(blocks, hashes, self.window)
        start = first_live_block(best * bs, self.window, bs)
        found = [self.allocator.null_block] * start + blocks[start:best]
        for b in found[start:]:
            self.allocator.share(b)
        return found, snap

    def _match_mixed(self, seq: CachedSequence, hashes: list[bytes], found: list[int]) -> tuple[list[int], int | None]:
        """The deepest prefix of d blocks within the primary chain `found` whose window-group blocks
        [first_live_block(d * bs), d) are cached too (and, with snapshots, that has a snapshot at its end)."""
        bs, wg = self.block_size, self.window_group
        wins = [wg.allocator.lookup(h) for h in hashes[:len(found)]]
        best, snap = self._deepest_live(wins, hashes, wg.window)
        start = first_live_block(best * bs, wg.window, bs)
        seq.window_table = [wg.allocator.null_block] * start + wins[start:best]
        for b in seq.window_table[start:]:
            wg.allocator.share(b)
        found = found[:best]
        for b in found:
            self.allocator.share(b)
        return found, snap

    def _deepest_live(self, blocks: list[int | None], hashes: list[bytes], window: int
                      ) -> tuple[int, int | None]:
        """(d, its snapshot): the largest d whose blocks [first_live_block(d * bs, window), d) are all cached
        (None: not cached) and, with snapshots, that has a snapshot at its end; (0, None) when none has."""
        bs = self.block_size
        run = 0  # cached blocks ending at index d - 1
        best, snap = 0, None
        for d in range(1, len(blocks) + 1):
            run = run + 1 if blocks[d - 1] is not None else 0
            if run < d - first_live_block(d * bs, window, bs):
                continue
            s = self.snapshots.lookup(hashes[d - 1]) if self.snapshots is not None else None
            if self.snapshots is None or s is not None:
                best, snap = d, s
        return best, snap

    def cached_depth(self, seq: CachedSequence) -> int:
        """Leading blocks of a waiting sequence whose KV is cached now (not counting the block it must
        compute; with a window, an underestimate once head blocks are evicted: only admission order uses it).
        Rescans from where the last call stopped, so a request that waits for many steps costs O(1)
        per call; blocks evicted meanwhile only make this an overestimate, which match() corrects."""
        usable = (seq.num_tokens - 1) // self.block_size
        if len(seq.block_hashes) < usable:
            self._hashes(seq, usable)
        hashes = seq.block_hashes  # not _hashes()'s copy: this runs for every waiting request every step
        d = seq.wait_depth
        while d < usable and self.allocator.lookup(hashes[d]) is not None:
            d += 1
        seq.wait_depth = d
        return d

    def waits(self, seq: CachedSequence) -> bool:
        """Whether the first block of `seq` that is not cached yet is being computed by a running sequence."""
        if not self.computing:
            return False
        d = self.cached_depth(seq)
        return d < (seq.num_tokens - 1) // self.block_size and self.computing.get(seq.block_hashes[d], 0) > 0

    def mostly_cached(self, seq: CachedSequence) -> bool:
        """At least half of the prompt is cached: admitting it first costs little and gives a first token soon."""
        return 2 * self.cached_depth(seq) * self.block_size >= seq.num_tokens

    def claim(self, seq: CachedSequence, cached_tokens: int) -> None:
        """An admitted sequence announces the full blocks it will compute (past its cached prefix)."""
        full = seq.num_tokens // self.block_size
        seq.claim_start = cached_tokens // self.block_size  # not len(block_table): it already has the chunk
        seq.claimed = self._hashes(seq, full)[seq.claim_start:]
        for h in seq.claimed:
            self.computing[h] = self.computing.get(h, 0) + 1

    def unclaim(self, seq: CachedSequence, upto: int | None = None) -> None:
        """Drops the sequence's claims on blocks before index `upto` (all of them when None)."""
        n = len(seq.claimed) if upto is None else max(0, min(len(seq.claimed), upto - seq.claim_start))
        for h in seq.claimed[:n]:
            left = self.computing[h] - 1
            if left:
                self.computing[h] = left
            else:
                del self.computing[h]
        seq.claimed = seq.claimed[n:]
        seq.claim_start += n

    def restore(self, snap: int | None, slot: int | None) -> None:
        """Copies the matched snapshot into the sequence's freshly leased state slot."""
        if snap is not None:
            self.snapshots.restore(snap, slot)

    def snapshot(self, seq: CachedSequence) -> None:
        """Called right after a step was launched: snapshots the sequence's state if the step ended at a
        snapshot position (the scheduler cuts chunks so that it does)."""
        p = seq.num_computed_tokens
        if self.snapshots is None or seq.state_slot is None or not self.snapshots.is_snapshot_pos(seq.num_tokens, p):
            return
        h = self._hashes(seq, p // self.block_size)[-1]  # p < num_tokens: every hashed token is known
        self.snapshots.save(seq.state_slot, h, p, lambda ch: self.allocator.lookup(ch) is not None)

    def next_snapshot(self, seq: CachedSequence) -> int | None:
        """Where the sequence's next prefill chunk must end so that its state there can be snapshotted."""
        if self.snapshots is None:
            return None
        return self.snapshots.next_pos(seq.num_tokens, seq.num_computed_tokens)

    @property
    def snapshot_hits(self) -> int:
        return self.snapshots.hits if self.snapshots is not None else 0

    def reset_stats(self) -> None:
        """Zeroes the hit statistics (after the engine's start-up warm-up)."""
        self.queried_tokens = self.hit_tokens = 0
        if self.snapshots is not None:
            self.snapshots.hits = 0

    def count(self, seq: CachedSequence, hit_tokens: int) -> None:
        """Statistics of an admission that went through (a failed one is retried and counted then)."""
        self.queried_tokens += seq.num_tokens
        self.hit_tokens += hit_tokens
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = hit_tokens

    def register_computed(self, seq: CachedSequence, known_tokens: int) -> None:
        """Registers the sequence's blocks that became full and computed since the last call; only the
        first known_tokens token ids are final (later ones may still be in flight on the device)."""
        full = min(min(seq.num_computed_tokens, known_tokens) // self.block_size, len(seq.block_table))
        if full <= seq.num_registered_blocks:
            return
        hashes = self._hashes(seq, full)
        for i in range(seq.num_registered_blocks, full):
            self.allocator.register(seq.block_table[i], hashes[i])
        if self.window_group is not None:  # a dropped (null) entry registers nothing
            for i in range(seq.num_registered_blocks, min(full, len(seq.window_table))):
                self.window_group.allocator.register(seq.window_table[i], hashes[i])
        seq.num_registered_blocks = full
        if seq.claimed:
            self.unclaim(seq, full)
