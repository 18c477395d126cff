"""What rank 0's two handles on its workers share: TPGroup (spawned processes, workers.py) and RayTPGroup
(Ray actors, ray_workers.py). Both broadcast each step (and a hybrid's state copies) after a liveness check,
and keep the first failure for good; they differ only in how a worker's end is seen."""
from __future__ import annotations

import abc
import contextlib
from typing import Any

import torch

from lamina.parallel.context import ParallelFailure
from lamina.parallel.step_message import send_step


class RankGroup(abc.ABC):
    """The step broadcast and the failure record; a subclass sets `ctx` (rank 0's ParallelContext) once the
    group is joined and says which worker has ended."""

    ctx: Any

    def __init__(self, world: int, device: torch.device) -> None:
        self.world = world
        self.device = device
        self.failure: str | None = None
        self.state_log = None  # a StateOpLog once rank 0's state pool reports to it (attach_state)

    @abc.abstractmethod
    def _ended_worker(self) -> str | None:
        """The failure message naming a worker that has ended, None while all are alive (does not wait)."""

    @abc.abstractmethod
    def _await_end(self, timeout: float) -> None:
        """Waits up to `timeout` s for a worker's end to become visible (after a failed collective)."""

    def check(self) -> None:
        """Raises ParallelFailure if a worker has exited (or an earlier step found one gone)."""
        if self.failure is None:
            self.failure = self._ended_worker()
        if self.failure is not None:
            raise ParallelFailure(self.failure)

    def attach_state(self, pool) -> None:
        """A model with a state pool: each step carries its state metadata and rank 0's copies since the last
        one (parallel/state_ops.py)."""
        from lamina.parallel.state_ops import StateOpLog, attach

        self.state_log = StateOpLog()
        attach(pool, self.state_log)

    def send_step(self, batch) -> None:
        self.check()
        send_step(self.ctx, batch)
        if self.state_log is not None:
            from lamina.parallel.state_ops import send_state

            send_state(self.ctx, batch, self.state_log)

    def fail(self, exc: BaseException) -> ParallelFailure:
        """A step failed with `exc` (a ParallelFailure): the group is broken for good. Returns the error to
        raise: it names the worker that exited when one did (a collective fails as soon as its peer's socket
        closes, maybe before the exit is seen), else it keeps exc's message."""
        if self.failure is None:
            self._await_end(2.0)
            with contextlib.suppress(ParallelFailure):
                self.check()
        if self.failure is None:
            self.failure = str(exc)
        return ParallelFailure(self.failure)
