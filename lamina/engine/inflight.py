"""A launched step whose sampled tokens are still on the device."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lamina.engine.request import Sequence
from lamina.engine.sampler import SampleTensors
from lamina.engine.scheduler import ScheduledSeq

# Stands in token_ids for a sampled token not yet read back; never fed to the model (the runner copies the
# real token on the device) and never hashed (the prefix cache only registers known tokens).
PENDING = -1


@dataclass
class InFlight:
    scheduled: list[ScheduledSeq]
    sampled: list[tuple[Sequence, int]]  # (sequence, index of its PENDING slot in token_ids)
    draws: SampleTensors | None
    sync: bool  # must be read back before the next step is built
    copy: Any = None  # the started device-to-host copy of draws
