"""Speculative drafts in a step: how many of a sequence's drafts the token budget, the KV blocks and the
candidate state slots admit, and why a hybrid step holding a prompt chunk verifies none. A mixin of
Scheduler (it uses the scheduler's budget helpers, state slots, `free_candidates` and `trim`)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from lamina.engine.request import Sequence

if TYPE_CHECKING:
    from lamina.engine.scheduler import ScheduledSeq


class DraftScheduling:
    def _no_drafts_next_to_prefill(self, scheduled: list[ScheduledSeq]) -> None:
        """Hybrid models: a step holding a prompt chunk (more known tokens than one) verifies no drafts. The
        verify kernels and graphs take decode and verify rows only; a step mixing drafts with a prompt chunk
        ran the per-token torch reference of the recurrent layers on the GPU (H200, Qwen3-Next-80B shape, 64
        sequences, 2,048-token chunks: inferred ~7 s over the few admission steps, hence 88-191 ms a step on
        average against an 18-31 ms forward). Its verify sequences decode plainly this step instead (lossless:
        drafts are only guesses); the blocks grown for the drafts go back."""
        if not any(s.num_tokens != max(s.num_sampled, 1) for s in scheduled):
            return
        for item in scheduled:
            if item.num_drafts:
                seq = item.seq
                self.free_candidates(seq)
                seq.draft_token_ids = []
                item.num_tokens = item.num_sampled = 1
                self.trim(seq, 1)

    def _drafts(self, seq: Sequence, n: int, budget: int) -> int:
        """Draft tokens to verify after the sequence's last known token this step: those a proposer left in
        seq.draft_token_ids, capped so the step's output (drafts + 1) stays within max_tokens and the budget.
        Drafts not scheduled are dropped (they were proposed for this step only)."""
        if not seq.draft_token_ids:
            return 0
        # Not for a sequence whose chunk does not reach its last known token.
        if seq.num_computed_tokens + n != seq.num_tokens:
            seq.draft_token_ids = []
            return 0
        # Recurrent layers keep candidate j's state after the chunk's token j: the chunk must be the last known
        # token plus the drafts (a preempted sequence recomputing its history keeps drafts it was given).
        if self.state_slots is not None and n != 1:
            seq.draft_token_ids = []
            return 0
        k = min(len(seq.draft_token_ids), seq.max_tokens - seq.num_output_tokens - 1, budget - n)
        if self.state_slots is not None and k > 0:
            # Recurrent state rolls back through candidate slots, one per draft (the state after the chunk's
            # token j goes to candidate j; after the last, to the sequence's own slot), leased for this step.
            k = min(k, self.state_slots.num_free)
            self.free_candidates(seq)
            seq.candidate_slots = [self.state_slots.allocate() for _ in range(k)]
        del seq.draft_token_ids[max(k, 0):]
        return max(k, 0)
