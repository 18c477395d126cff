"""Start-up phases logged with their times (weights, profiling, KV planning, graph capture, server ready)."""
from __future__ import annotations

import logging
import time

log = logging.getLogger("lamina")


class StartupTimer:
    """Logs, at INFO, how long each phase took since the previous one (and the total so far)."""

    def __init__(self) -> None:
        self.start = self.last = time.monotonic()

    def phase(self, name: str) -> float:
        now = time.monotonic()
        took, self.last = now - self.last, now
        log.info("start-up: %s took %.2f s (%.2f s in all)", name, took, now - self.start)
        return took
