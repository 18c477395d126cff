"""Continuous batching: each step, decode tokens of running sequences plus prefill chunks, under a token budget.

Running sequences go first (in arrival order), then waiting ones. When the KV pool runs dry, the most
recently admitted sequence is preempted: its blocks are freed and it is recomputed later from its prompt
plus the tokens it already produced, so its output is unchanged. Under pressure the pool is shared fairly
between requests (fair_share.py): the newest sequence of the request furthest over its share gives way
first, and a request under its share may take blocks from it to be admitted.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from lamina.cache.block_allocator import BlockAllocator
from lamina.cache.kv_groups import WindowGroup, free_tables
from lamina.cache.prefix_cache import PrefixCache
from lamina.cache.sliding_window import drop_out_of_window
from lamina.cache.slot_allocator import SlotAllocator
from lamina.engine.draft_scheduling import DraftScheduling
from lamina.engine.fair_share import (
    Shares,
    compute_shares,
    eviction_victims,
    fair_running_order,
    held_blocks,
    slot_victim,
)
from lamina.engine.request import SeqStatus, Sequence

# How far past waiting requests that wait for a prefix being computed admission looks in one step (keeps a
# long queue of waiters from costing a full scan every step).
WAIT_LOOKAHEAD = 1024
# A cold request passed over this many times for mostly-cached ones goes first itself (bounds its wait).
MAX_PASSED_OVER = 32


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: num_tokens query tokens from position seq.num_computed_tokens on
    (its known tokens, then any draft tokens being verified), of which the last num_sampled rows are sampled.

    num_sampled is 0 for a prompt chunk that does not reach the end, 1 for decode or a final prompt chunk, and
    1 + len(drafts) when the step verifies draft tokens (row j scores the token after position start + j)."""

    seq: Sequence
    num_tokens: int
    num_sampled: int = 0

    def __post_init__(self) -> None:
        self.num_sampled = int(self.num_sampled)  # callers may pass "reaches the end" as a bool
        if not 0 <= self.num_sampled <= self.num_tokens:
            raise ValueError(f"num_sampled {self.num_sampled} outside [0, num_tokens {self.num_tokens}]")

    @property
    def num_drafts(self) -> int:
        return max(0, self.num_sampled - 1)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]


class Scheduler(DraftScheduling):
    def __init__(self, allocator: BlockAllocator, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, state_slots: SlotAllocator | None = None,
                 prefix_cache: PrefixCache | None = None, window: int | None = None,
                 window_group: WindowGroup | None = None) -> None:
        self.allocator, self.block_size = allocator, block_size
        # Sliding-window-only models: blocks out of every layer's window go back before each step's growth.
        self.window = window
        self.window_group = window_group  # sliding layers' own table next to full ones (cache/kv_groups.py)
        self.prefix_cache = prefix_cache
        # Hybrid models: each running sequence also leases a state-pool slot (admitted -> released).
        self.state_slots = state_slots
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # cumulative, for metrics
        self.num_scheduled_tokens = 0  # tokens in the last step scheduled

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def _blocks_needed(self, seq: Sequence, n: int) -> int:
        total = (seq.num_computed_tokens + n + self.block_size - 1) // self.block_size
        return max(0, total - len(seq.block_table))

    def _grow(self, seq: Sequence, n: int) -> bool:
        if self.window is not None:
            drop_out_of_window(seq, self.allocator, self.block_size, self.window)
        need, wg = self._blocks_needed(seq, n), self.window_group
        if need == 0 and wg is None:  # most decode and verify steps fit the last block: nothing to lease
            return True
        if need > self.allocator.num_free or (wg is not None and not wg.fits(seq, len(seq.block_table) + need)):
            return False
        seq.block_table += self.allocator.allocate(need, after=seq.block_table[-1] if seq.block_table else None)
        if wg is not None:
            wg.grow(seq, len(seq.block_table))
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.release(seq)
        seq.num_computed_tokens = 0
        seq.draft_token_ids = []  # proposed for this step: stale once it resumes (its chunks would verify them)
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def release(self, seq: Sequence) -> None:
        """Returns a sequence's blocks and state slot to the pools (every exit path goes through here)."""
        free_tables(seq, self.allocator, self.window_group)
        seq.num_registered_blocks = 0
        if seq.claimed:
            self.prefix_cache.unclaim(seq)
        if seq.state_slot is not None:
            self.state_slots.free(seq.state_slot)
            seq.state_slot = None
        self.free_candidates(seq)

    def free_candidates(self, seq: Sequence) -> None:
        """Returns the candidate state slots a hybrid verify step leased (after its acceptance, or on exit)."""
        for slot in seq.candidate_slots:
            self.state_slots.free(slot)
        seq.candidate_slots = []

    def trim(self, seq: Sequence, ahead: int = 0) -> None:
        """Frees the blocks past the sequence's computed positions and `ahead` more (after a verify step rejected
        drafts, the blocks grown for them may hold nothing kept). Never a registered block: those are full and
        computed."""
        keep = (seq.num_computed_tokens + ahead + self.block_size - 1) // self.block_size
        if len(seq.block_table) > keep:
            self.allocator.free(seq.block_table[:keep - 1:-1] if keep else seq.block_table[::-1])
            # A new list, not shrunk in place: the runner's block-table rows resend a replaced table, while
            # a table shrunk and regrown to its old length would look unchanged to them.
            seq.block_table = seq.block_table[:keep]
        if self.window_group is not None:
            self.window_group.trim(seq, keep)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        if self.window_group is not None:  # also the sequences this step leaves out: their last chunk's blocks
            for seq in self.running:        # fall out of the window, which the pool's sizing counts on
                self.window_group.drop(seq)
        scheduled: list[ScheduledSeq] = []
        preempted = False
        shares = self._pressure()
        if shares is not None:
            self.running = fair_running_order(self.running, shares)
        i = 0
        # A decode or verify step of a sequence whose blocks already hold it leases nothing: that case is
        # tested inline (it runs between a verify step's read-back and the next launch, per sequence).
        bs = self.block_size
        plain = self.window is None and self.window_group is None
        snapshots = self.prefix_cache is not None and self.prefix_cache.snapshots is not None
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_tokens = len(seq.token_ids)
            if num_tokens - seq.num_prompt_tokens >= seq.max_tokens:  # its last token is still in flight
                i += 1
                continue
            n = num_tokens - seq.num_computed_tokens
            if n > budget or snapshots:
                n = self._chunk(seq, budget)
            drafts = self._drafts(seq, n, budget) if seq.draft_token_ids else 0
            if plain and (seq.num_computed_tokens + n + drafts + bs - 1) // bs <= len(seq.block_table):
                scheduled.append(ScheduledSeq(seq, n + drafts, drafts + 1 if seq.num_computed_tokens + n ==
                                              num_tokens else 0))
                budget -= n + drafts
                i += 1
                continue
            while not self._grow(seq, n + drafts):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                reaches_end = seq.num_computed_tokens + n == seq.num_tokens
                scheduled.append(ScheduledSeq(seq, n + drafts, drafts + 1 if reaches_end else 0))
                budget -= n + drafts
                i += 1
        # New sequences only when nothing was preempted (avoids thrashing the pool), except fresh ones of
        # requests under their fair share.
        if not preempted or shares is not None:
            self._admit_waiting(budget, scheduled, shares, fresh_only=preempted)
        if self.state_slots is not None:
            self._no_drafts_next_to_prefill(scheduled)
        now = time.monotonic()
        for s in scheduled:
            if s.seq.first_scheduled_time is None:
                s.seq.first_scheduled_time = now
        self.num_scheduled_tokens = sum(s.num_tokens for s in scheduled)  # this step's (for metrics)
        return SchedulerOutput(scheduled)

    def _pressure(self) -> Shares | None:
        """The requests' fair shares when the pool is short (fewer free blocks than running sequences, each of
        which may need one) and more than one request is active; None otherwise (arrival order is kept)."""
        if self.allocator.num_free >= len(self.running) + 1 or not self.running:
            return None
        shares = compute_shares(self.running, self.waiting, self.allocator.num_blocks)
        if shares.fair >= self.allocator.num_blocks:  # one request: nothing to share
            return None
        return shares

    def _admit_by_evicting(self, seq: Sequence, budget: int, scheduled: list[ScheduledSeq], shares: Shares | None
                           ) -> tuple[int | None, int]:
        """A waiting sequence of a request under its fair share did not fit: preempts the newest sequences of
        the requests furthest over theirs to make room, then admits it. Returns (its chunk or None, tokens of
        this step's budget given back by preempted sequences already scheduled)."""
        if shares is None:
            return None, 0
        shares.held = held_blocks(self.running)  # this step's growth, preemptions and admissions so far
        self._reuse_prefix(seq)  # measures what it needs as _admit will (undone below)
        need = self._blocks_needed(seq, self._chunk(seq, budget))
        if seq.block_table:
            free_tables(seq, self.allocator, self.window_group)
            seq.num_computed_tokens = 0
        victims = eviction_victims(self.running, shares, seq.request_id, need - self.allocator.num_free)
        if not victims:
            return None, 0
        refund = 0
        for victim in victims:
            for k, item in enumerate(scheduled):
                if item.seq is victim:  # scheduled earlier this step: it gives its tokens back
                    refund += item.num_tokens
                    del scheduled[k]
                    break
            self.running.remove(victim)
            self._preempt(victim)
        n = self._admit(seq, budget + refund, scheduled)
        shares.held = held_blocks(self.running)
        return n, refund

    def _admit_waiting(self, budget: int, scheduled: list[ScheduledSeq], shares: Shares | None = None,
                       fresh_only: bool = False) -> None:
        """Admits waiting sequences (the first WAIT_LOOKAHEAD of them) in fair-share order: preempted ones
        first, then by how many sequences their request already has running plus how many of its sequences
        are ahead of them in line (ties: arrival order). So a request with many prompts or a large n takes
        turns with the ones behind it instead of queueing a small request behind all its sequences.

        Two exceptions when prefix caching is on: a request whose prefix another running sequence is computing
        right now is passed over until that block is cached, and requests that are mostly cached go first (a
        few tokens each, so a burst sharing a system prompt gets its first tokens without queueing behind the
        cold prompts that arrived in between) unless a cold one has been passed over MAX_PASSED_OVER times
        already. Admission stops at the first sequence whose blocks do not fit (it keeps its place).

        Under pressure (`shares`), a sequence of a request under its fair share that does not fit takes blocks
        from the requests furthest over theirs (_admit_by_evicting); one of a request at or over its share is
        passed over instead of stopping admission; with `fresh_only` (this step preempted) only sequences of
        requests under their share that were never preempted are considered."""
        if not self.waiting or budget <= 0:
            return
        full = len(self.running) >= self.max_num_seqs
        window = [self.waiting.popleft() for _ in range(min(len(self.waiting), WAIT_LOOKAHEAD))]
        admitted: set[int] = set()
        try:
            if full:
                budget += self._free_a_slot(window, scheduled)
            self._admit_in_order(self._fair_order(window), budget, scheduled, admitted, shares, fresh_only)
        finally:  # the rest keep their places at the head of the line, in arrival order
            self.waiting.extendleft(reversed([s for s in window if id(s) not in admitted]))

    def _free_a_slot(self, window: list[Sequence], scheduled: list[ScheduledSeq]) -> int:
        """Every sequence slot is taken: if a request in `window` has none and the request running the most
        keeps at least its share of slots without one, preempts that one's newest sequence (at most one per
        step, so such a request gets a slot in the first step it waits). Returns the tokens of this step's
        budget the preempted sequence gave back."""
        running_ids = {s.request_id for s in self.running}
        newcomer = next((s for s in window if s.request_id not in running_ids), None)
        if newcomer is None:
            return 0
        active = running_ids | {s.request_id for s in window}
        victim = slot_victim(self.running, newcomer.request_id, len(active), self.max_num_seqs)
        if victim is None:
            return 0
        refund = 0
        for k, item in enumerate(scheduled):
            if item.seq is victim:  # scheduled earlier this step: it gives its tokens back
                refund = item.num_tokens
                del scheduled[k]
                break
        self.running.remove(victim)
        self._preempt(victim)
        return refund

    def _fair_order(self, window: list[Sequence]) -> list[Sequence]:
        """The window sorted by (not preempted, the request's running + earlier-waiting sequences, arrival)."""
        running: dict[str, int] = {}
        for seq in self.running:
            running[seq.request_id] = running.get(seq.request_id, 0) + 1
        if not running and len({s.request_id for s in window}) <= 1:
            return window  # one request, nothing running: arrival order is the fair order
        ahead: dict[str, int] = {}
        keys = []
        for i, seq in enumerate(window):
            share = running.get(seq.request_id, 0) + ahead.get(seq.request_id, 0)
            ahead[seq.request_id] = ahead.get(seq.request_id, 0) + 1
            keys.append((seq.num_preemptions == 0, share, i))
        return [window[k[2]] for k in sorted(keys)]

    def _admit_in_order(self, order: list[Sequence], budget: int, scheduled: list[ScheduledSeq],
                        admitted: set[int], shares: Shares | None = None, fresh_only: bool = False) -> None:
        """Admits from `order` (ids of admitted sequences go into `admitted`) until the budget, the sequence
        slots, the state slots or the KV pool run out."""
        passes = (True, False) if self.prefix_cache is not None else (False,)
        for hot_only in passes:
            for seq in order:
                if budget <= 0 or len(self.running) >= self.max_num_seqs:
                    return
                if id(seq) in admitted:
                    continue
                if fresh_only and (seq.num_preemptions or shares.over(seq.request_id) >= 0):
                    continue
                if self.state_slots is not None and self.state_slots.num_free == 0:
                    return  # no more sequences than state slots (checked before blocks are taken)
                if self.prefix_cache is not None and not seq.num_computed_tokens:
                    if self.prefix_cache.waits(seq):
                        continue
                    if hot_only and seq.times_passed_over < MAX_PASSED_OVER and \
                            not self.prefix_cache.mostly_cached(seq):
                        seq.times_passed_over += 1
                        continue
                n = self._admit(seq, budget, scheduled)
                if n is None:
                    n, refund = self._admit_by_evicting(seq, budget, scheduled, shares)
                    budget += refund
                if n is None:
                    if shares is not None and shares.over(seq.request_id) >= 0:
                        continue  # at its share already: others may still fit
                    return  # the KV pool is full: the sequence stays in line
                admitted.add(id(seq))
                budget -= n

    def _admit(self, seq: Sequence, budget: int, scheduled: list[ScheduledSeq]) -> int | None:
        """Starts a waiting sequence (the caller takes it out of the line) with a chunk of at most `budget`
        tokens; None (nothing changed) if its blocks do not fit."""
        hit, snap = self._reuse_prefix(seq)
        n = self._chunk(seq, budget)
        if not self._grow(seq, n):
            if hit:  # undo the reuse
                free_tables(seq, self.allocator, self.window_group)
                seq.num_computed_tokens = 0
            return None
        if hit is not None:
            self.prefix_cache.count(seq, hit)
            self.prefix_cache.claim(seq, hit)
        if self.state_slots is not None:
            seq.state_slot = self.state_slots.allocate()
            if snap is not None:  # enqueued before this step's forward, after the step that saved it
                self.prefix_cache.restore(snap, seq.state_slot)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        scheduled.append(ScheduledSeq(seq, n, seq.num_computed_tokens + n == seq.num_tokens))
        return n

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens to compute this step; a prefill chunk of a hybrid model with prefix caching ends at the next
        state-snapshot position, since the recurrent state exists only at the end of a step."""
        n = min(seq.num_tokens - seq.num_computed_tokens, budget)
        if self.prefix_cache is not None:
            nxt = self.prefix_cache.next_snapshot(seq)
            if nxt is not None:
                n = min(n, nxt - seq.num_computed_tokens)
        return n

    def _reuse_prefix(self, seq: Sequence) -> tuple[int | None, int | None]:
        """Starts a fresh sequence after its longest cached prefix; returns the tokens reused (None: the
        cache was not consulted) and, for hybrid models, the state snapshot to restore once a slot is leased."""
        if self.prefix_cache is None or seq.num_computed_tokens or seq.needs_prompt_logprobs():
            return None, None  # prompt logprobs need every prompt position computed
        seq.block_table, snap = self.prefix_cache.match(seq)
        seq.num_computed_tokens = len(seq.block_table) * self.block_size
        return seq.num_computed_tokens, snap

    def snapshot(self, seq: Sequence) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.snapshot(seq)

    def register_computed(self, seq: Sequence, known_tokens: int) -> None:
        if self.prefix_cache is not None:
            self.prefix_cache.register_computed(seq, known_tokens)

    def finish(self, seq: Sequence) -> None:
        """Removes a finished or aborted sequence from whichever queue holds it and frees its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.release(seq)
        seq.status = SeqStatus.FINISHED
