"""SpecDecoder: the engine's speculative-decoding side. Before each schedule it asks the proposer for drafts
for the running sequences that are about to decode; after a verify step it records how many stood.

The scheduler budgets the drafts (they count against max_num_batched_tokens and max_tokens), the runner
feeds them after the sequence's last token, the sampler scores every position, and spec/accept.py counts on
the device how many stand; engine.py then keeps the accepted tokens and trims the rejected positions' blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from lamina.engine.request import SeqStatus, Sequence
from lamina.spec.adaptive import AcceptanceGate, BatchGate, GateSettings
from lamina.spec.config import SpeculativeConfig
from lamina.spec.proposer import Proposer

_PENDING = -1  # lamina.engine.runner.PENDING


@dataclass
class SpecStats:
    """Running totals (the metrics take increments): verify steps per sequence ("drafts"), draft tokens
    verified, drafts accepted, and accepted drafts by position (index j: the j-th draft of a run stood)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_position[j] += 1


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, proposer: Proposer) -> None:
        self.config, self.proposer = config, proposer
        self.k = config.num_speculative_tokens
        self.stats = SpecStats(accepted_per_position=[0] * self.k)
        # Pauses a sequence's drafting while its acceptance stays low, and everyone's while the batch's does
        # (spec/adaptive.py).
        settings = GateSettings(config.min_acceptance_rate, config.probe_interval)
        self.gate, self.batch_gate = AcceptanceGate(settings), BatchGate(settings)
        self._step = [0, 0]  # drafts verified and accepted this step (for the batch-wide gate)
        self.num_batch_size_skips = 0  # steps without drafting for disable_by_batch_size
        # Bench only (replay's forced acceptance): the proposer decides each verify step's accepted count.
        self.forced = bool(getattr(proposer, "forced", False))

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """A verify step of `seq` read back: num_accepted of its num_drafts drafts stood."""
        self.stats.record(num_drafts, num_accepted)
        self.gate.record(seq.seq_id, num_drafts, num_accepted)
        self._step[0] += num_drafts
        self._step[1] += num_accepted

    def record_many(self, verified: list[tuple[int, int, int]]) -> None:
        """record() for a verify step's sequences at once: (seq_id, num_drafts, num_accepted) each."""
        stats, gate, per_pos = self.stats, self.gate, self.stats.accepted_per_position
        drafts = accepted = 0
        for seq_id, nd, na in verified:
            drafts += nd
            accepted += na
            for j in range(na):
                per_pos[j] += 1
            if gate.enabled:
                gate.record(seq_id, nd, na)
        stats.num_drafts += len(verified)
        stats.num_draft_tokens += drafts
        stats.num_accepted_tokens += accepted
        self._step[0] += drafts
        self._step[1] += accepted

    @staticmethod
    def decodes_next(seq: Sequence) -> bool:
        """A running sequence whose next step decodes its last token (known or still in flight), with room for
        at least one more token after it."""
        return (seq.status == SeqStatus.RUNNING and seq.num_computed_tokens == seq.num_tokens - 1
                and seq.num_output_tokens + 1 < seq.max_tokens and not seq.needs_prompt_logprobs())

    @classmethod
    def wants_drafts(cls, seq: Sequence) -> bool:
        """decodes_next, with its last token known (not in flight): drafts follow it."""
        return cls.decodes_next(seq) and seq.token_ids[-1] != _PENDING

    @property
    def batch_paused(self) -> bool:
        """Whether speculation is off batch-wide now (low acceptance across the batch)."""
        return self.batch_gate.paused

    def _over_batch_limit(self, num_decoding: int) -> bool:
        limit = self.config.disable_by_batch_size
        return limit is not None and num_decoding > limit

    def drafts_next(self, seqs: list[Sequence]) -> bool:
        """Whether any of `seqs` (the sampled sequences of a step being launched) may draft in the next step.
        Only then must this step be read back before the next one is built; otherwise the step loop overlaps
        as without speculation (every sequence paused, speculation off batch-wide, or over the batch limit)."""
        if self._over_batch_limit(len(seqs)) or (self.batch_gate.enabled and not self.batch_gate.would_allow()):
            return False
        return any(not s.finished and s.num_output_tokens + 1 < s.max_tokens and self.gate.would_allow(s.seq_id)
                   for s in seqs)

    def forced_counts(self, sampled: list) -> np.ndarray | None:
        """Forced acceptance (bench only): the accepted count per sampled sequence of a verify step."""
        return np.asarray(self.proposer.forced_counts(sampled), np.int64) if self.forced else None

    @property
    def needs_hidden_states(self) -> bool:
        """Whether the proposer reads the target's backbone output (the runner then keeps it: keep_hidden)."""
        return getattr(self.proposer, "needs_hidden_states", False)

    def observe(self, scheduled: list, hidden) -> None:
        """A launched step's backbone output [tokens, H] for a proposer that drafts from it (mtp), before the
        step's bookkeeping moves the sequences' computed lengths on."""
        if self.needs_hidden_states and hidden is not None:
            self.proposer.observe(scheduled, hidden)

    def after_step(self) -> None:
        """After each engine step: the step's acceptance goes to the batch-wide gate; a proposer with state of
        its own per sequence (mtp's KV blocks) returns that of the sequences that finished or were preempted
        (its release_stale)."""
        if self._step[0]:
            self.batch_gate.record(*self._step)
            self._step = [0, 0]
        release = getattr(self.proposer, "release_stale", None)
        if release is not None:
            release()

    def propose(self, running: list[Sequence]) -> None:
        """Leaves each eligible sequence's drafts in seq.draft_token_ids (the scheduler caps them). The gates
        count this as a decode step of every sequence about to decode, its last token known or not."""
        decoding = []
        for s in running:
            s.draft_token_ids = []  # never verify drafts proposed for an earlier step
            if self.decodes_next(s):
                decoding.append(s)
        if not decoding:
            return
        if self._over_batch_limit(len(decoding)):
            self.num_batch_size_skips += 1
            return
        if self.batch_gate.enabled and not self.batch_gate.tick():
            self.gate.maybe_log()  # the per-sequence pauses' log line is due even while everyone is off
            return
        if self.gate.enabled:
            allowed = self.gate.allow([s.seq_id for s in decoding], {s.seq_id for s in running})
            decoding = [s for s, ok in zip(decoding, allowed) if ok]
        seqs = [s for s in decoding if s.token_ids[-1] != _PENDING]
        if not seqs:
            return
        for seq, drafts in zip(seqs, self.proposer.propose(seqs, self.k)):
            seq.draft_token_ids = list(drafts[:self.k])
            if not seq.draft_token_ids:  # nothing to propose: a run of these pauses it (spec/adaptive.py)
                self.gate.record_empty(seq.seq_id)
