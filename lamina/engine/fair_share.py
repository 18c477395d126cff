"""Fair shares of the KV pool between requests, for the scheduler's preemption and admission under pressure.

Each request (all its samples together) is entitled to total_blocks / active requests, where a request is
active while any of its sequences runs or waits. When the pool is short, a request holding more than that
gives way first: its newest sequences are preempted (recomputed later, same output) before anyone else's,
and a request under its share that cannot get blocks may take them from the one furthest over its share.
So one n=32 stream cannot hold every block while a small request waits.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from lamina.engine.request import Sequence


@dataclass
class Shares:
    held: dict[str, int]  # blocks in the tables of each request's running sequences
    fair: float  # blocks each active request is entitled to

    def over(self, request_id: str) -> float:
        """How far a request is over its share (negative: under it)."""
        return self.held.get(request_id, 0) - self.fair


def held_blocks(running: list[Sequence]) -> dict[str, int]:
    held: dict[str, int] = {}
    for seq in running:
        held[seq.request_id] = held.get(seq.request_id, 0) + len(seq.block_table)
    return held


def compute_shares(running: list[Sequence], waiting: Iterable[Sequence], num_blocks: int) -> Shares:
    held = held_blocks(running)
    active = set(held)
    active.update(s.request_id for s in waiting)
    return Shares(held, num_blocks / max(1, len(active)))


def fair_running_order(running: list[Sequence], shares: Shares) -> list[Sequence]:
    """Running sequences with the requests under their share first and the one furthest over it last (each
    request's sequences keep their order): the scheduler grows them in this order and preempts from the
    end, so the newest sequence of the biggest holder gives way first."""
    index = {id(s): i for i, s in enumerate(running)}
    return sorted(running, key=lambda s: (max(0.0, shares.over(s.request_id)), index[id(s)]))


def eviction_victims(running: list[Sequence], shares: Shares, request_id: str, need: int) -> list[Sequence]:
    """Sequences to preempt so that `request_id` (under its share) gets `need` blocks: the newest ones of
    the requests furthest over their share, each taken only if its request keeps at least its share without
    it (so requests never take turns evicting each other, and a one-sequence request is never evicted).
    Empty if they cannot free enough (then nothing should be preempted)."""
    held = held_blocks(running)
    if held.get(request_id, 0) >= shares.fair:
        return []
    by_request: dict[str, list[Sequence]] = {}
    for seq in running:
        if seq.request_id != request_id and seq.num_output_tokens < seq.max_tokens and seq.block_table:
            by_request.setdefault(seq.request_id, []).append(seq)  # (ones with a last token in flight end soon)
    victims: list[Sequence] = []
    freed = 0
    while freed < need:
        hogs = [r for r, seqs in by_request.items()
                if seqs and held[r] - len(seqs[-1].block_table) >= shares.fair]
        if not hogs:
            return []
        hog = max(hogs, key=lambda r: held[r])
        seq = by_request[hog].pop()  # its newest
        victims.append(seq)
        held[hog] -= len(seq.block_table)
        freed += len(seq.block_table)
    return victims


def slot_victim(running: list[Sequence], request_id: str, num_active: int, max_seqs: int) -> Sequence | None:
    """With every sequence slot taken: a sequence to preempt so that `request_id`, running fewer than its
    share of the max_seqs slots, gets one. The newest of the request running the most, only if that one
    keeps at least its share without it; None otherwise."""
    share = max_seqs / max(1, num_active)
    counts: dict[str, int] = {}
    for seq in running:
        counts[seq.request_id] = counts.get(seq.request_id, 0) + 1
    if counts.get(request_id, 0) + 1 > share:
        return None
    others = [(c, r) for r, c in counts.items() if r != request_id]
    if not others:
        return None
    most, hog = max(others)
    if most - 1 < share:
        return None
    for seq in reversed(running):
        if seq.request_id == hog and seq.num_output_tokens < seq.max_tokens:
            return seq
    return None
