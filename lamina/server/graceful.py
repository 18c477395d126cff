"""uvicorn with lamina's shutdown: on SIGTERM or SIGINT stop accepting, let the requests in flight finish for
up to a timeout, then abort the rest (each stream still ends cleanly: a final chunk with finish_reason
'abort' and [DONE]), stop the engine core and return; a second signal exits at once.

uvicorn's own handling waits forever on a long stream (no graceful timeout by default), cancels handlers
mid-response when given one, and re-raises the signal after shutting down (a SIGTERM exit status, and a
KeyboardInterrupt traceback for SIGINT); this class replaces those three behaviours.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import uvicorn

from lamina.engine.core_client import CoreClient

log = logging.getLogger("lamina.server")

# After the timeout's aborts the streams need a moment to send their last chunk; past this uvicorn cancels.
_AFTER_ABORT_GRACE = 10.0


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, engine: CoreClient, shutdown_timeout: float,
                 on_ready: Callable[[], None] | None = None) -> None:
        config.timeout_graceful_shutdown = shutdown_timeout + _AFTER_ABORT_GRACE
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self.on_ready = on_ready

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        sigs = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self._on_signal) for sig in sigs}
        try:
            yield
        finally:  # the signal was handled by shutting down: it is not raised again
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def _on_signal(self, sig: int, frame) -> None:
        name = signal.Signals(sig).name
        if self.should_exit:
            os.write(2, f"lamina: {name} again: exiting now\n".encode())
            self.engine.backend.kill()
            os._exit(1)
        self.should_exit = True
        n = self.engine.num_in_flight
        log.warning("%s: shutting down (%d request(s) in flight, up to %.0f s to finish; %s again to quit now)",
                    name, n, self.shutdown_timeout, name)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.on_ready is not None:
            self.on_ready()  # only now is the port bound

    async def shutdown(self, sockets=None) -> None:
        deadline = asyncio.ensure_future(self._abort_after(self.shutdown_timeout))
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    async def _abort_after(self, seconds: float) -> None:
        t0 = time.monotonic()
        await asyncio.sleep(seconds)
        n = self.engine.abort_all()
        if n:
            log.warning("shutdown: %d request(s) still running after %.0f s; aborted", n, time.monotonic() - t0)
