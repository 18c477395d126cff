"""Reference-counted allocator over the fixed-size blocks of the KV pool, with a prefix-cache index.

A full block can be registered under the hash of its content chain. When its last owner lets go, a
registered block is not wiped: it waits in an LRU list, still findable by hash, and is only reused for
new data (evicted) when no never-cached block is left.
"""
from __future__ import annotations

from collections import OrderedDict, deque


class NoFreeBlocks(RuntimeError):
    pass


class BlockAllocator:
    """num_blocks: the pool's blocks. reserve_null: keep the pool's last block out of circulation as the null
    block, which block-table entries that no layer reads any more point at (sliding-window models free the
    blocks that fell out of every window; cache/sliding_window.py). Nobody writes it, so it stays zeros,
    and free/register/forget ignore it; num_blocks then counts the leasable blocks only."""

    def __init__(self, num_blocks: int, reserve_null: bool = False) -> None:
        self.null_block: int | None = num_blocks - 1 if reserve_null else None
        num_blocks -= int(reserve_null)
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # Free (never-cached) blocks: the deque gives the order, the set the truth; a block taken out of order
        # (allocate's `after`) stays in the deque until popped, and popping skips what the set no longer holds.
        self._free: deque[int] = deque(range(num_blocks))
        self._free_set: set[int] = set(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self._by_hash: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}

    @property
    def num_free(self) -> int:
        return len(self._free_set) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._hash_of)

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """n blocks. after: the sequence's last block; the blocks right after it are taken first while free, so
        a sequence's table stays one run of the pool where it can (the CPU attention then reads it in place)."""
        if n > self.num_free:
            raise NoFreeBlocks(f"asked for {n} blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            nxt = None if after is None else after + 1
            if nxt is not None and nxt in self._free_set:
                b = nxt
                self._free_set.discard(b)
            elif self._free_set:
                b = self._free.popleft()
                while b not in self._free_set:  # taken out of order earlier
                    b = self._free.popleft()
                self._free_set.discard(b)
            else:  # evict the least recently used cached block
                b, _ = self._evictable.popitem(last=False)
                del self._by_hash[self._hash_of.pop(b)]
            self.ref_counts[b] = 1
            blocks.append(b)
            after = b
        if len(self._free) > 2 * len(self._free_set) + 64:  # stale entries of out-of-order takes: drop them
            seen: set[int] = set()
            self._free = deque(b for b in self._free if b in self._free_set and not (b in seen or seen.add(b)))
        return blocks

    def share(self, block: int) -> None:
        """Adds an owner: a sequence reusing a block that another holds or that waits in the cache."""
        if self.ref_counts[block] == 0:
            assert block in self._evictable, f"block {block} is neither leased nor cached"
            del self._evictable[block]
        self.ref_counts[block] += 1

    def free(self, blocks: list[int]) -> None:
        # Callers pass a block table tail-first, so a chain's tail is evicted before its shared head.
        for b in blocks:
            if b == self.null_block:
                continue
            if self.ref_counts[b] <= 0:
                raise AssertionError(f"double free of block {b}")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.append(b)
                    self._free_set.add(b)

    def lookup(self, block_hash: bytes) -> int | None:
        return self._by_hash.get(block_hash)

    def forget(self, blocks: list[int]) -> None:
        """Unregisters blocks whose content cannot be trusted (their step failed)."""
        for b in blocks:
            h = self._hash_of.pop(b, None)
            if h is not None:
                del self._by_hash[h]
                if self.ref_counts[b] == 0:
                    del self._evictable[b]
                    self._free.append(b)
                    self._free_set.add(b)

    def register(self, block: int, block_hash: bytes) -> None:
        """Makes a full, computed block findable by its content hash (first writer wins)."""
        if block == self.null_block:
            return
        if block_hash not in self._by_hash and block not in self._hash_of:
            self._by_hash[block_hash] = block
            self._hash_of[block] = block_hash
