"""SpecDecoder: the engine's speculative-decoding side. Before each schedule it asks the proposer for drafts
for the running sequences that are about to decode; after a verify step it records how many stood.

The scheduler budgets the drafts (they count against max_num_batched_tokens and max_tokens), the runner
feeds them after the sequence's last token, the sampler scores every position, and spec/accept.py counts on
the device how many stand; engine.py then keeps the accepted tokens and trims the rejected positions' blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from lamina.engine.request import SeqStatus, Sequence
from lamina.spec.adaptive import AcceptanceGate, GateSettings
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
        # Pauses a sequence's drafting while its acceptance stays low (spec/adaptive.py).
        self.gate = AcceptanceGate(GateSettings(config.min_acceptance_rate, config.probe_interval))

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """A verify step of `seq` read back: num_accepted of its num_drafts drafts stood."""
        self.stats.record(num_drafts, num_accepted)
        self.gate.record(seq.seq_id, num_drafts, num_accepted)

    @staticmethod
    def wants_drafts(seq: Sequence) -> bool:
        """A running sequence whose next step decodes its last token, known (not in flight), with room for
        at least one more token after it."""
        return (seq.status == SeqStatus.RUNNING and seq.num_computed_tokens == seq.num_tokens - 1
                and seq.token_ids[-1] != _PENDING and seq.num_output_tokens + 1 < seq.max_tokens
                and not seq.needs_prompt_logprobs())

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
        """After each engine step: a proposer with state of its own per sequence (mtp's KV blocks) returns that
        of the sequences that finished or were preempted (its release_stale)."""
        release = getattr(self.proposer, "release_stale", None)
        if release is not None:
            release()

    def propose(self, running: list[Sequence]) -> None:
        """Leaves each eligible sequence's drafts in seq.draft_token_ids (the scheduler caps them)."""
        seqs = []
        for s in running:
            s.draft_token_ids = []  # never verify drafts proposed for an earlier step
            if self.wants_drafts(s):
                seqs.append(s)
        if seqs and self.gate.enabled:
            allowed = self.gate.allow([s.seq_id for s in seqs], {s.seq_id for s in running})
            seqs = [s for s, ok in zip(seqs, allowed) if ok]
        if not seqs:
            return
        for seq, drafts in zip(seqs, self.proposer.propose(seqs, self.k)):
            seq.draft_token_ids = list(drafts[:self.k])
