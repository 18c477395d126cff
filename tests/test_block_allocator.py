"""BlockAllocator's contiguity hint (allocate's `after`) against a plain model of the pool: random leases,
frees, registrations and evictions never hand a block to two owners, num_free stays the count of what is
free or evictable, a sequence that grows into free neighbours gets one run of blocks, and the free list's
stale entries are compacted."""
from __future__ import annotations

import random

import pytest

from lamina.cache.block_allocator import BlockAllocator, NoFreeBlocks


def test_after_takes_the_next_free_blocks_then_falls_back():
    a = BlockAllocator(16)
    first = a.allocate(3)
    assert first == [0, 1, 2]
    assert a.allocate(1) == [3]  # block 3 goes to someone else
    grown = a.allocate(2, after=2)  # 3 is leased: some free block, then its neighbour
    assert grown[1] == grown[0] + 1 and 3 not in grown
    a.free([3])
    assert a.allocate(1, after=2) == [3]  # freed: taken out of the free order
    assert a.allocate(3, after=9) == [10, 11, 12]
    assert a.num_free == 16 - 3 - 2 - 1 - 3


def test_after_skips_cached_neighbours():
    a = BlockAllocator(4)
    b = a.allocate(2)
    a.register(b[1], b"h1")
    a.free([b[1]])  # cached, unreferenced: evictable, not free
    assert a.allocate(1, after=b[0]) == [2]  # the cached neighbour is kept for its hash
    assert a.lookup(b"h1") == b[1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_leases_never_double_hand_a_block(seed):
    rng = random.Random(seed)
    n = 24
    a = BlockAllocator(n)
    tables: list[list[int]] = []
    registered = 0
    for _ in range(400):
        op = rng.random()
        if op < 0.5:
            want = rng.randint(1, 3)
            if tables and rng.random() < 0.7:
                t = rng.choice(tables)
                if want > a.num_free:
                    with pytest.raises(NoFreeBlocks):
                        a.allocate(want, after=t[-1])
                    continue
                t += a.allocate(want, after=t[-1])
            elif want <= a.num_free:
                tables.append(a.allocate(want))
        elif tables:
            t = tables.pop(rng.randrange(len(tables)))
            if rng.random() < 0.3:  # full blocks of a finished sequence stay findable
                a.register(t[0], b"%d" % registered)
                registered += 1
            a.free(t[::-1])
        leased = [b for t in tables for b in t]
        assert len(leased) == len(set(leased)), "a block leased twice"
        assert all(a.ref_counts[b] == 1 for b in leased)
        assert a.num_free == n - len(leased)
        assert len(a._free) <= 2 * len(a._free_set) + 64 + 3
    for t in tables:
        a.free(t)
    assert a.num_free == n
