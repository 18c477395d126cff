"""Which data-parallel replica serves a request: prefix-cache-aware, bounded by load.

Each replica keeps its own prefix cache, so a prompt that shares a prefix with one a replica served recently
is cheapest there. The router keeps, per replica, an LRU-bounded record of the chained hashes of the first
few blocks of the prompts it sent there (a hash of block k covers blocks 0..k, so a match of k hashes is a
match of the whole k-block prefix). A request goes to the replica with the longest recorded match, unless
that replica's load (requests in flight) exceeds the least-loaded one's by more than `load_margin`; with no
match it goes to the least-loaded replica (ties: round robin, so a light load still spreads). Text prompts
(no token ids here) are hashed by character chunks, which finds repeated text the same way.

The record is a hint, not the truth: a replica may have evicted those blocks, and that only costs a
recompute. Nothing here blocks or does I/O; the caller serialises calls (one lock).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

PROMPT_BLOCKS = 16  # blocks of a prompt recorded (its first ones: where prompts share system text)
TEXT_CHUNK = 64  # characters per "block" of a text prompt


def prefix_hashes(prompt: str | Sequence[int], block_size: int, max_blocks: int = PROMPT_BLOCKS) -> list[int]:
    """Chained hashes of the prompt's first full blocks (at most max_blocks): hash k covers blocks 0..k."""
    size = TEXT_CHUNK if isinstance(prompt, str) else block_size
    out: list[int] = []
    h = 0
    for k in range(min(len(prompt) // size, max_blocks)):
        chunk = prompt[k * size:(k + 1) * size]
        h = hash((h, chunk if isinstance(chunk, str) else tuple(chunk)))
        out.append(h)
    return out


@dataclass
class Route:
    replica: int
    matched_blocks: int  # 0: chosen by load alone


class PrefixRouter:
    """Routes requests over `num_replicas` replicas; remembers up to `capacity` block hashes per replica."""

    def __init__(self, num_replicas: int, block_size: int, capacity: int = 4096, load_margin: int = 4) -> None:
        if num_replicas < 1:
            raise ValueError("num_replicas must be >= 1")
        self.block_size = block_size
        self.capacity = capacity
        self.load_margin = load_margin
        self._seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        self._next = 0  # round robin among the least loaded

    def choose(self, prompt: str | Sequence[int], loads: Sequence[int], usable: Sequence[bool] | None = None) -> Route:
        """The replica for `prompt` given each replica's requests in flight; records the prompt there.
        `usable`: replicas that may be chosen (a dead one may not); at least one must be."""
        usable = usable if usable is not None else [True] * len(loads)
        candidates = [i for i in range(len(loads)) if usable[i]]
        if not candidates:
            raise ValueError("no replica is usable")
        n = len(loads)
        least = min(candidates, key=lambda i: (loads[i], (i - self._next) % n))
        hashes = prefix_hashes(prompt, self.block_size)
        best, best_len = least, 0
        for i in candidates:
            k = self._match(i, hashes)
            if k > best_len or (k == best_len and k > 0 and loads[i] < loads[best]):
                best, best_len = i, k
        if best_len and loads[best] - loads[least] > self.load_margin:
            best, best_len = least, 0
        if best_len == 0:
            self._next = (best + 1) % n
        self._record(best, hashes)
        return Route(best, best_len)

    def forget(self, replica: int) -> None:
        """A replica that died: what it cached is gone."""
        self._seen[replica].clear()

    def _match(self, replica: int, hashes: list[int]) -> int:
        seen = self._seen[replica]
        n = 0
        for h in hashes:  # chained: the first miss ends the match
            if h not in seen:
                break
            n += 1
        return n

    def _record(self, replica: int, hashes: list[int]) -> None:
        seen = self._seen[replica]
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)
