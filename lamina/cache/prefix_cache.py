"""Prefix caching: full KV blocks keyed by a hash chain of (parent hash, the block's token ids[, extra]).

A new sequence reuses the longest chain of cached blocks that matches its tokens; the shared blocks are
reference-counted by the allocator, which keeps unreferenced cached blocks until it must evict them (LRU).
"""
from __future__ import annotations

from lamina.cache.block_allocator import BlockAllocator
from lamina.engine.request import Sequence


def chain_hash(parent: int | None, tokens: tuple[int, ...], extra: object = None) -> int:
    # `extra` is whatever else changes a block's KV for the same tokens (a LoRA adapter, later).
    return hash((parent, tokens, extra))


class PrefixCache:
    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        self.allocator, self.block_size = allocator, block_size
        self.queried_tokens = 0
        self.hit_tokens = 0

    def _hashes(self, seq: Sequence, n_blocks: int) -> list[int]:
        bs = self.block_size
        hashes = seq.block_hashes
        while len(hashes) < n_blocks:
            i = len(hashes)
            hashes.append(chain_hash(hashes[-1] if hashes else None, tuple(seq.token_ids[i * bs:(i + 1) * bs])))
        return hashes[:n_blocks]

    def match(self, seq: Sequence) -> list[int]:
        """Cached blocks for the longest matching prefix, each now shared by `seq`. At least one token is
        always left to compute, since the step must produce logits."""
        usable = (seq.num_tokens - 1) // self.block_size
        blocks = []
        for h in self._hashes(seq, usable):
            b = self.allocator.lookup(h)
            if b is None:
                break
            self.allocator.share(b)
            blocks.append(b)
        return blocks

    def count(self, seq: Sequence, hit_tokens: int) -> None:
        """Statistics of an admission that went through (a failed one is retried and counted then)."""
        self.queried_tokens += seq.num_tokens
        self.hit_tokens += hit_tokens
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = hit_tokens

    def register_computed(self, seq: Sequence, known_tokens: int) -> None:
        """Registers the sequence's blocks that became full and computed since the last call; only the
        first known_tokens token ids are final (later ones may still be in flight on the device)."""
        full = min(min(seq.num_computed_tokens, known_tokens) // self.block_size, len(seq.block_table))
        if full <= seq.num_registered_blocks:
            return
        hashes = self._hashes(seq, full)
        for i in range(seq.num_registered_blocks, full):
            self.allocator.register(seq.block_table[i], hashes[i])
        seq.num_registered_blocks = full
