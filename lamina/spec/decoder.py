"""SpecDecoder: the engine's speculative-decoding side. Before each schedule it asks the proposer for drafts
for the running sequences that are about to decode; after a verify step it records how many stood.

The scheduler budgets the drafts (they count against max_num_batched_tokens and max_tokens), the runner
feeds them after the sequence's last token, the sampler scores every position, and spec/accept.py counts on
the device how many stand; engine.py then keeps the accepted tokens and trims the rejected positions' blocks.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from lamina.engine.request import SeqStatus, Sequence
from lamina.spec.adaptive import AcceptanceGate, BatchGate, GateSettings
from lamina.spec.config import SpeculativeConfig
from lamina.spec.goodput import GoodputGate, GoodputSettings
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
    def __init__(self, config: SpeculativeConfig, proposer: Proposer,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config, self.proposer = config, proposer
        self.k = config.num_speculative_tokens
        self.stats = SpecStats(accepted_per_position=[0] * self.k)
        # Pauses a sequence's drafting while its acceptance stays low (spec/adaptive.py), unless gate is "off";
        # batch-wide, drafting stops where it does not pay (gate "goodput", spec/goodput.py) or while the
        # batch's acceptance stays low (gate "acceptance").
        settings = GateSettings(config.min_acceptance_rate if config.gate != "off" else 0.0, config.probe_interval)
        self.gate = AcceptanceGate(settings)
        self.batch_gate = BatchGate(settings if config.gate == "acceptance" else GateSettings(min_acceptance_rate=0))
        self.goodput = (GoodputGate(GoodputSettings(margin=config.gate_margin, probe_interval=config.probe_interval))
                        if config.gate == "goodput" else None)
        self.clock = clock  # the goodput gate's step timestamps (injected by the tests)
        self.step_drafting: bool | None = None  # the goodput gate's verdict for the step being built
        self._read: list[tuple[bool, int, float]] = []  # goodput samples of the steps read back this engine step
        self._num_read = self._prev_read = 0  # steps read back in this engine step and the one before
        self._last_result: float | None = None  # when the previous engine step returned
        self._step = [0, 0]  # drafts verified and accepted this step (for the batch-wide gate)
        self.num_batch_size_skips = 0  # steps without drafting for disable_by_batch_size
        self.num_verify_steps = 0  # steps launched that verified drafts
        self.num_plain_steps = 0  # steps launched that sampled without verifying any draft
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
        going = [s for s in seqs if not s.finished and s.num_output_tokens + 1 < s.max_tokens]
        if self.goodput is not None and going and not self.goodput.would_allow(len(going)):
            return False
        return any(self.gate.would_allow(s.seq_id) for s in going)

    def count_step(self, verify: bool) -> None:
        """A launched step that samples: whether it verifies drafts."""
        if verify:
            self.num_verify_steps += 1
        else:
            self.num_plain_steps += 1

    def gate_sample(self, scheduled: list, batch: int, verify: bool, held: bool) -> tuple[bool, int] | None:
        """The goodput gate's sample of a step being launched: (drafting, decoding sequences), or None. Only a
        decode-only step that costs what its mode costs: with drafting on, a step that verified drafts (one
        whose sequences all had none, paused or their last token still in flight, is a plain step, and 1 token
        at a plain step's cost would read as drafting that does not pay); with it off, a plain step that
        overlaps the next (held: read back before the next is built, so its interval holds unoverlapped host
        work, as the plain step before a probe does under async scheduling)."""
        drafting = self.step_drafting
        if drafting is None or drafting != verify or (held and not verify):
            return None
        if not all(it.num_sampled and it.num_tokens == it.num_sampled for it in scheduled):
            return None  # a prompt chunk's cost is in it
        return drafting, batch

    def on_read(self, gate_sample: tuple[bool, int] | None, num_accepted: int) -> None:
        """A launched step was read back, its sequences keeping num_accepted drafts in all. gate_sample: (drafting
        on, decoding sequences) of a decode-only step (InFlight.gate_sample), timed by after_step."""
        self._num_read += 1
        if gate_sample is not None and self.goodput is not None:
            drafting, batch = gate_sample
            self._read.append((drafting, batch, 1.0 + num_accepted / max(1, batch)))

    def _time_step(self) -> None:
        """The goodput gate's sample: the interval since the previous step's results, when it covers exactly
        one step read back, a decode-only one (with async scheduling the intervals next to a switch between
        overlapped and synced steps cover none or two)."""
        now = self.clock()
        if self._num_read == 1 and self._prev_read >= 1 and self._read and self._last_result is not None:
            drafting, batch, tokens = self._read[0]
            self.goodput.record(drafting, batch, now - self._last_result, tokens)
        self._prev_read, self._num_read, self._read = self._num_read, 0, []
        self._last_result = now

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
        if self.goodput is not None:
            self._time_step()
        if self._step[0]:
            self.batch_gate.record(*self._step)
            self._step = [0, 0]
        release = getattr(self.proposer, "release_stale", None)
        if release is not None:
            release()

    def propose(self, running: list[Sequence]) -> None:
        """Leaves each eligible sequence's drafts in seq.draft_token_ids (the scheduler caps them). The gates
        count this as a decode step of every sequence about to decode, its last token known or not."""
        self.step_drafting = None
        decoding = []
        running_status = SeqStatus.RUNNING
        for s in running:
            if s.draft_token_ids:
                s.draft_token_ids = []  # never verify drafts proposed for an earlier step
            # decodes_next, inlined (this loop runs between a verify step's read-back and the next launch)
            n = len(s.token_ids)
            if (s.status is running_status and s.num_computed_tokens == n - 1
                    and n - s.num_prompt_tokens + 1 < s.max_tokens
                    and not (s.wants_prompt_logprobs and s.needs_prompt_logprobs())):
                decoding.append(s)
        if not decoding:
            return
        if self._over_batch_limit(len(decoding)):
            self.num_batch_size_skips += 1
            return
        if self.batch_gate.enabled and not self.batch_gate.tick():
            self.gate.maybe_log()  # the per-sequence pauses' log line is due even while everyone is off
            return
        if self.goodput is not None:
            self.step_drafting = self.goodput.allow(len(decoding))
            if not self.step_drafting:
                return
        if self.gate.enabled:
            allowed = self.gate.allow([s.seq_id for s in decoding], {s.seq_id for s in running})
            decoding = [s for s, ok in zip(decoding, allowed) if ok]
        seqs = [s for s in decoding if s.token_ids[-1] != _PENDING]
        if not seqs:
            return
        k = self.k
        for seq, drafts in zip(seqs, self.proposer.propose(seqs, k)):
            if len(drafts):
                # a copy (a slice of a list is one): the scheduler cuts it in place, the proposer may keep its own
                seq.draft_token_ids = drafts[:k] if isinstance(drafts, list) else list(drafts[:k])
            else:  # nothing to propose: a run of these pauses it (spec/adaptive.py)
                self.gate.record_empty(seq.seq_id)
