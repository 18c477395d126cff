"""Speculation that pays for itself: each sequence's drafting pauses while its measured acceptance stays low,
and is probed again later.

Per sequence, its accepted and its proposed drafts summed over its verify steps, each sum decaying by
`seq_alpha` a verify step (a window of ~1/seq_alpha steps), and half a step's drafts added to the
accepted sum (a prior, so that a few unlucky steps are not taken for a drafter that never matches): once it
has at least `min_verifies` verify steps and (accepted + K/2) / proposed is below `min_acceptance_rate`, the
sequence decodes plainly for `probe_interval` decode steps (no proposal, no verify: a wrong drafter then
costs nothing); after that it drafts again from fresh sums, so a text that became predictable (a quoted
passage, code being repeated) gets speculation back. Output never changes: drafts are only ever guesses.
Sequences not running any more are forgotten (a preempted one starts afresh).

BatchGate does the same for the whole batch (speculation off for every sequence, new ones too): an average of
each verify step's accepted / proposed drafts over all its sequences; below `min_acceptance_rate` after
`min_verifies` such steps, no sequence drafts for `probe_interval` engine steps, doubled after each probe that
finds acceptance still low (up to `max_backoff` times), so an acceptance that stays at 0 costs a few verify
steps per long stretch of plain, overlapped decode steps. For the per-sequence gate, `max_empty` proposals
in a row that came back empty pause it too (a drafter that never matches a sequence keeps the step loop from
overlapping for nothing; n-gram lookup often finds nothing for the first tokens and then matches, hence a run
of them); the batch gate judges verified drafts only (n-gram lookup that finds nothing for some sequences must
not turn speculation off for the others).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

log = logging.getLogger("lamina")


@dataclass
class GateSettings:
    min_acceptance_rate: float = 0.1  # 0 turns the gate off
    probe_interval: int = 64  # decode steps a paused sequence runs without drafts
    min_verifies: int = 4  # verify steps before the average may pause a sequence
    alpha: float = 0.3  # BatchGate: weight of the newest verify step in the average
    # AcceptanceGate: decay of a sequence's sums per verify step. Not an EWMA of each step's rate with weight
    # 0.3 (as before): one sequence's accepted count is mostly 0 or K (at acceptance 0.5 and K = 3, 0 half
    # the time), so three or four steps of 0 in a row took that average below 0.1 and paused a sequence
    # accepting 29% of its drafts within 64 verify steps 92% of the time (simulated; 1.4% now, and a sequence
    # accepting none pauses after 7 steps, was 4).
    seq_alpha: float = 0.1
    max_empty: int = 16  # proposals in a row that came back empty before a sequence pauses


@dataclass
class _SeqGate:
    accepted: float = 0.0  # decayed sums since the last probe
    proposed: float = 0.0
    verifies: int = 0
    paused_for: int = 0  # decode steps left without drafts
    empty: int = 0  # proposals in a row that came back empty


class AcceptanceGate:
    LOG_EVERY_S = 10.0  # pauses and probes are summed into one log line at most this often

    def __init__(self, settings: GateSettings) -> None:
        self.settings = settings
        self._seqs: dict[int, _SeqGate] = {}
        self.num_pauses = 0  # cumulative: times a sequence's drafting was paused
        self.num_probes = 0  # cumulative: paused sequences that drafted again
        self._logged = (0, 0, float("-inf"))  # (pauses, probes, when) of the last log line

    @property
    def enabled(self) -> bool:
        return self.settings.min_acceptance_rate > 0

    @property
    def num_paused(self) -> int:
        """Sequences whose drafting is paused now."""
        return sum(1 for g in self._seqs.values() if g.paused_for > 0)

    def allow(self, seq_ids: list[int], live: set[int]) -> list[bool]:
        """One decode step of the sequences `seq_ids` (about to decode): whether each may draft this step.
        live: ids of every running sequence (the others' averages are dropped)."""
        if not self.enabled:
            return [True] * len(seq_ids)
        for sid in [s for s in self._seqs if s not in live]:
            del self._seqs[sid]
        out = []
        for sid in seq_ids:
            g = self._seqs.get(sid)
            if g is None or g.paused_for == 0:
                out.append(True)
                continue
            g.paused_for -= 1
            if g.paused_for == 0:  # probe: draft again, judged by a fresh average
                g.accepted = g.proposed = 0.0
                g.verifies = 0
                self.num_probes += 1
            out.append(g.paused_for == 0)
        self.maybe_log()
        return out

    def record_empty(self, seq_id: int) -> None:
        """The proposer had nothing for the sequence this step; max_empty of those in a row pause it."""
        if not self.enabled:
            return
        g = self._seqs.setdefault(seq_id, _SeqGate())
        g.empty += 1
        if g.empty >= self.settings.max_empty:
            g.paused_for, g.empty = self.settings.probe_interval, 0
            self.num_pauses += 1

    def would_allow(self, seq_id: int) -> bool:
        """Whether the sequence's next allow() lets it draft (it does not move its count)."""
        g = self._seqs.get(seq_id)
        return not self.enabled or g is None or g.paused_for <= 1

    def record(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:
        """A verify step of the sequence: num_accepted of its num_drafts drafts stood."""
        if not self.enabled or num_drafts <= 0:
            return
        s = self.settings
        g = self._seqs.setdefault(seq_id, _SeqGate())
        g.empty = 0
        keep = 1.0 - s.seq_alpha
        g.accepted = g.accepted * keep + num_accepted
        g.proposed = g.proposed * keep + num_drafts
        g.verifies += 1
        # (with none accepted, K/2 / proposed drops below 0.1 at the 7th verify step, whatever K is)
        if g.verifies >= s.min_verifies and g.accepted + 0.5 * num_drafts < s.min_acceptance_rate * g.proposed:
            g.paused_for = s.probe_interval
            self.num_pauses += 1

    def maybe_log(self) -> None:
        pauses, probes, at = self._logged
        now = time.monotonic()
        if (self.num_pauses, self.num_probes) == (pauses, probes) or now - at < self.LOG_EVERY_S:
            return
        log.info("speculative decoding: paused drafting for %d sequence(s) with acceptance below %.2f and probed "
                 "%d again since the last report; %d paused now", self.num_pauses - pauses,
                 self.settings.min_acceptance_rate, self.num_probes - probes, self.num_paused)
        self._logged = (self.num_pauses, self.num_probes, now)


class BatchGate:
    """Speculation on or off for the whole batch, from the batch's acceptance (see the module docstring)."""

    def __init__(self, settings: GateSettings, max_backoff: int = 16) -> None:
        self.settings, self.max_backoff = settings, max_backoff
        self.ewma: float | None = None
        self.verifies = 0  # verify steps averaged since the last probe
        self.off_for = 0  # engine steps left with speculation off
        self.backoff = 1  # probe interval multiplier (doubles after a failed probe)
        self.num_pauses = 0  # cumulative: times speculation turned off batch-wide
        self.num_probes = 0  # cumulative: times it turned back on to probe
        self._probing = False

    @property
    def enabled(self) -> bool:
        return self.settings.min_acceptance_rate > 0

    @property
    def paused(self) -> bool:
        """Whether speculation is off batch-wide now."""
        return self.off_for > 0

    def tick(self) -> bool:
        """One engine step: whether its sequences may draft."""
        if self.off_for == 0:
            return True
        self.off_for -= 1
        if self.off_for == 0:  # probe: speculation back on, judged by a fresh average
            self.ewma, self.verifies, self._probing = None, 0, True
            self.num_probes += 1
            log.info("speculative decoding: probing the batch's acceptance again")
        return self.off_for == 0

    def would_allow(self) -> bool:
        """Whether the next tick() will let sequences draft (it does not move the count)."""
        return self.off_for <= 1

    def record(self, num_drafts: int, num_accepted: int) -> None:
        """One verify step's totals over its sequences."""
        if not self.enabled or num_drafts <= 0 or self.off_for:
            return
        s = self.settings
        rate = num_accepted / num_drafts
        self.ewma = rate if self.ewma is None else self.ewma + s.alpha * (rate - self.ewma)
        self.verifies += 1
        if self.verifies < s.min_verifies:
            return
        if self.ewma < s.min_acceptance_rate:
            self.backoff = min(self.max_backoff, self.backoff * 2) if self._probing else 1
            self.off_for = s.probe_interval * self.backoff
            self.num_pauses += 1
            self._probing = False
            log.info("speculative decoding: off batch-wide for %d steps (the batch's acceptance %.3f is below "
                     "%.2f)", self.off_for, self.ewma, s.min_acceptance_rate)
        elif self._probing:  # the probe found acceptance back: the next pause starts from the base interval
            self.backoff, self._probing = 1, False
