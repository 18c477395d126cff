"""A launched step whose sampled tokens are still on the device."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lamina.engine.request import Sequence
from lamina.engine.runner import PENDING, PendingTokens
from lamina.engine.sampler import SampleTensors
from lamina.engine.scheduler import ScheduledSeq

__all__ = ["PENDING", "InFlight"]


@dataclass
class InFlight:
    scheduled: list[ScheduledSeq]
    # Per sampled sequence, in row order: (sequence, index in token_ids of its first sampled token, number of
    # sampled rows). The first token is a PENDING placeholder; rows past it verify the sequence's drafts.
    sampled: list[tuple[Sequence, int, int]]
    draws: SampleTensors | None
    sync: bool  # must be read back before the next step is built
    copy: Any = None  # the started device-to-host copy of draws
    # Verify steps: drafts accepted per sampled sequence (same order as `sampled`), counted on the device.
    num_accepted: Any = None
    # A decode-only step under the goodput gate (spec/goodput.py): (drafting on, decoding sequences).
    gate_sample: tuple[bool, int] | None = None

    def ready(self) -> bool:
        """Its tokens can be read back without waiting for the device (its copy to the host is done)."""
        return self.copy is None or self.copy[1].query()

    def pending(self) -> PendingTokens | None:
        """Where the next step finds the tokens this one samples (they are still on the device)."""
        if self.draws is None:
            return None
        first, row = {}, 0
        for seq, idx, n in self.sampled:
            first[seq.seq_id] = (idx, row)
            row += n
        return PendingTokens(first, self.draws.token_ids)
