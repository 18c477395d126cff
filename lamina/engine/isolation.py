"""What the engine does when a step raises: the failing sequences are found by bisection and fail with their
requests (their KV and snapshots are never served from the cache), while every other sequence gets its step.
A mixin of LLMEngine (it uses the engine's groups, scheduler, allocators, `_launch` and `_resolve`)."""
from __future__ import annotations

import logging

from lamina.engine.request import RequestGroup, Sequence
from lamina.engine.scheduler import ScheduledSeq

log = logging.getLogger("lamina")


class StepIsolation:
    def _isolate(self, items: list[ScheduledSeq], exc: Exception, touched: dict[str, RequestGroup]) -> None:
        """A step over `items` raised `exc`: re-runs it in halves (each launched and read back at once), so
        the sequences that make it fail are found by bisection and fail with their requests, while every
        other sequence gets its step. Nothing is in flight meanwhile (the caller resolved it)."""
        items = [s for s in items if not s.seq.finished]
        if not items:
            return
        if len(items) == 1:
            self._fail([items[0].seq], exc, touched)
            return
        half = len(items) // 2
        for part in (items[:half], items[half:]):
            part = [s for s in part if not s.seq.finished]  # the first half may have failed a shared request
            if not part:
                continue
            try:
                flight = self._launch(part, touched)
            except Exception as sub:
                self._isolate(part, sub, touched)
            else:
                self._resolve(flight, touched)

    def _fail(self, seqs: list[Sequence], exc: Exception, touched: dict[str, RequestGroup]) -> None:
        log.error("engine step failed: %s", exc, exc_info=exc)
        for seq in seqs:
            group = self.groups.get(seq.request_id)
            if group is None:
                continue
            group.error = f"{type(exc).__name__}: {exc}"
            for s in group.seqs:
                self.allocator.forget(s.block_table)  # their KV may be garbage: never serve it from cache
                if self.window_group is not None:
                    self.window_group.allocator.forget(s.window_table)
                if self.snapshots is not None:
                    self.snapshots.forget(s.block_hashes)
                if not s.finished:
                    s.finish_reason = "error"
                    self.scheduler.finish(s)
            touched[group.request_id] = group
