"""Snapshots of the recurrent state (Marconi-style prefix caching for hybrid models).

A linear-attention layer's state after token p cannot be recovered from its state after any later token, so
KV blocks alone cannot serve a prefix hit for a hybrid model. The pool therefore keeps copies of every state
layer's declared state tensors (gated delta net: conv window, recurrent state) at block-aligned positions,
keyed by the prefix-cache chain hash of the KV block that ends at that position. A hit restores the copy
into the sequence's leased slot and reuses the KV blocks up to there.

Storage is a fixed number of snapshot rows per state layer, allocated once at start-up next to the state
pool from the same specs (cache/specs.py), so whatever tensors a layer declared are snapshotted whole; a
full store evicts by a FLOP-aware score (see `_victim`).

Where snapshots are taken: every `interval` tokens and at the last full block a re-sent prompt can reuse
((num_tokens - 1) // block_size * block_size, since one token is always left to compute). The scheduler
cuts prefill chunks so that a chunk ends exactly there; only positions < num_tokens are used, so every token
hashed is known on the host (the only PENDING token of a sequence is its last one).

Stream order, why a snapshot may be restorable as soon as it is saved: `save` is called from the engine's
launch of the step that computes the state, right after that step's forward was enqueued, and enqueues the
copy slot -> snapshot behind it. A restore (snapshot -> slot) is enqueued when the scheduler admits a
sequence, which is always in a later `schedule()` call, i.e. after the producing step and its copy were
enqueued on the same stream, and before the restoring step's forward. The device runs them in that order, so
a restore never reads a snapshot whose producing step is still in flight, even though the host reads that
step's sampled tokens back one step late. Reusing a snapshot row after eviction is ordered the same way. (On
the CPU everything is synchronous anyway.) Should snapshots ever be taken on another stream, `save` would
have to record an event and `restore` wait on it.
"""
from __future__ import annotations

import logging

from lamina.cache.specs import SlotRows
from lamina.cache.state_pool import StatePool

log = logging.getLogger("lamina")


class StateSnapshots:
    def __init__(self, pool: StatePool, num_snapshots: int, interval: int, block_size: int) -> None:
        if num_snapshots < 1:
            raise ValueError("num_state_snapshots must be >= 1 with prefix caching on a hybrid model")
        if interval < block_size or interval % block_size:
            raise ValueError(f"state_snapshot_interval {interval} must be a positive multiple of "
                             f"block_size {block_size}")
        self.pool, self.num_snapshots = pool, num_snapshots
        self.interval, self.block_size = interval, block_size
        self.views: list[SlotRows] = [spec.allocate(num_snapshots, view.device)
                                      for spec, view in zip(pool.specs, pool.views)]
        self._free = list(range(num_snapshots - 1, -1, -1))
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._pos = [0] * num_snapshots  # token position each snapshot was taken at
        self._used = [0] * num_snapshots  # logical time of last save / restore (recency)
        self._clock = 0
        self.hits = 0  # restores (one per admission that reused a snapshot)
        self.saves = 0
        self.evictions = 0
        bytes_per = pool.bytes_per_slot(pool.specs)
        log.info("state snapshots: %d x %.2f MiB, every %d tokens", num_snapshots, bytes_per / 2**20, interval)

    @property
    def num_used(self) -> int:
        return len(self._hash_of)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def positions(self) -> list[int]:
        """Token positions of the snapshots held (stats, tests)."""
        return sorted(self._pos[s] for s in self._hash_of)

    # ---- positions ------------------------------------------------------------------------------------
    def is_snapshot_pos(self, num_tokens: int, p: int) -> bool:
        """Whether the state after token p of a sequence of num_tokens tokens should be snapshotted."""
        if p <= 0 or p % self.block_size or p >= num_tokens:
            return False
        return p % self.interval == 0 or p == (num_tokens - 1) // self.block_size * self.block_size

    def next_pos(self, num_tokens: int, num_computed: int) -> int | None:
        """The first snapshot position after num_computed (a prefill chunk must end there), or None."""
        nxt = (num_computed // self.interval + 1) * self.interval
        last = (num_tokens - 1) // self.block_size * self.block_size
        if last > num_computed:
            nxt = min(nxt, last)
        return nxt if self.is_snapshot_pos(num_tokens, nxt) and nxt > num_computed else None

    # ---- store ----------------------------------------------------------------------------------------
    def _tick(self, snap: int) -> None:
        self._clock += 1
        self._used[snap] = self._clock

    def lookup(self, chain_hash: bytes) -> int | None:
        return self._by_hash.get(chain_hash)

    def save(self, slot: int, chain_hash: bytes, p: int, kv_cached) -> None:
        """Copies the state of `slot` (after token p, chain `chain_hash`) into a snapshot row; restorable at
        once (see the module docstring for why stream order makes that safe). kv_cached(hash) tells whether
        a chain's last KV block is still cached, for eviction."""
        snap = self._by_hash.get(chain_hash)
        if snap is not None:  # the same prefix again: same state, just fresher
            self._tick(snap)
            return
        snap = self._free.pop() if self._free else self._victim(kv_cached)
        for live, saved in zip(self.pool.views, self.views):
            saved.copy_row(snap, live, slot)
        self.pool.notify_copy("save", slot, snap)
        self._by_hash[chain_hash], self._hash_of[snap], self._pos[snap] = snap, chain_hash, p
        self._tick(snap)
        self.saves += 1

    def restore(self, snap: int, slot: int) -> None:
        """Copies snapshot `snap` into the leased `slot`, before the step that continues from it."""
        for live, saved in zip(self.pool.views, self.views):
            live.copy_row(slot, saved, snap)
        self.pool.notify_copy("restore", snap, slot)
        self._tick(snap)
        self.hits += 1

    def forget(self, chain_hashes: list[bytes]) -> None:
        """Drops snapshots whose state cannot be trusted (their step failed)."""
        for h in chain_hashes:
            snap = self._by_hash.pop(h, None)
            if snap is not None:
                del self._hash_of[snap]
                self._free.append(snap)

    def _victim(self, kv_cached) -> int:
        """Evicts and returns the snapshot row worth least.

        A snapshot whose KV block chain was already evicted can never hit: it goes first. Otherwise, after
        Marconi (Pan et al., 2024), score = recency + flops, both normalized to [0, 1] over the candidates:
          recency = (last_used - oldest) / (newest - oldest)   (plain LRU when alone)
          flops   = p / max_p                                   (what a hit saves)
        and the lowest score is evicted. A hit at p saves recomputing p tokens, and the per-token cost of the
        linear layers, MLPs and projections is constant, so FLOPs saved ~ p (attention adds a p^2 term that
        only strengthens the preference); every snapshot takes the same memory, so FLOPs per byte ~ p too.
        Weighing both keeps a long, shared system prompt cached over many short recent prefixes, yet lets
        a deep prefix that stopped being used age out.
        """
        snaps = list(self._hash_of)
        orphans = [s for s in snaps if not kv_cached(self._hash_of[s])]
        if orphans:
            victim = min(orphans, key=lambda s: self._used[s])
        else:
            lo, hi = min(self._used[s] for s in snaps), max(self._used[s] for s in snaps)
            max_p = max(self._pos[s] for s in snaps)
            span = max(hi - lo, 1)
            victim = min(snaps, key=lambda s: (self._used[s] - lo) / span + self._pos[s] / max_p)
        del self._by_hash[self._hash_of.pop(victim)]
        self.evictions += 1
        return victim
