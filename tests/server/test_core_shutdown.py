"""Stopping an engine core: once it has answered Shutdown with Stopped (leases back, last outputs sent), the
client waits only a short grace for its process to exit (a GPU driver's context teardown can be slow) and
kills it past that, instead of waiting out the whole timeout and warning."""
from __future__ import annotations

import multiprocessing
import threading
import time

import zmq

from lamina.engine.core_client import CoreClient
from lamina.engine.core_proc import EXIT_GRACE, CoreProcess, connect
from lamina.engine.ipc import Codec, CoreInfo, Ready, Shutdown, Stopped


class SlowExitCore:
    """Speaks the core's side of the channels: Ready, then Stopped on Shutdown, then lingers until stopped
    (as a process would that is stuck in its exit)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.stop_calls: list[tuple[float, bool]] = []
        self.thread: threading.Thread | None = None

    def start(self, addrs) -> None:
        self.thread = threading.Thread(target=self._run, args=(addrs,), daemon=True)
        self.thread.start()

    def _run(self, addrs) -> None:
        ctx = zmq.Context()
        inbox, outbox = connect(ctx, addrs)
        codec = Codec()
        outbox.send(codec.encode(Ready(CoreInfo("fake", 64, 100, 8, 0, 0.0))))
        while not self.done.is_set():
            if inbox.poll(50) and isinstance(codec.to_core.decode(inbox.recv()), Shutdown):
                outbox.send(codec.encode(Stopped()))
        inbox.close(0)
        outbox.close(0)
        ctx.term()

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    @property
    def sentinel(self):
        return None

    def describe_exit(self) -> str:
        return "the fake core ended"

    def stop(self, timeout: float, stopped: bool = False) -> None:
        self.stop_calls.append((timeout, stopped))
        self.done.set()
        self.thread.join(5)

    def kill(self) -> None:
        self.done.set()


def test_client_passes_on_that_the_core_stopped():
    core = SlowExitCore()
    client = CoreClient(core)
    client.start(timeout=10)
    t0 = time.monotonic()
    client.shutdown(timeout=10)
    assert time.monotonic() - t0 < 3
    assert core.stop_calls == [(10, True)]


def _sleep_forever() -> None:
    time.sleep(120)


def test_a_stopped_core_process_that_does_not_exit_is_killed_after_the_grace(caplog):
    proc = CoreProcess(config=None)
    proc.proc = multiprocessing.get_context("spawn").Process(target=_sleep_forever, daemon=True)
    proc.proc.start()
    t0 = time.monotonic()
    with caplog.at_level("INFO", logger="lamina"):
        proc.stop(timeout=30, stopped=True)
    took = time.monotonic() - t0
    assert not proc.alive() and EXIT_GRACE <= took < EXIT_GRACE + 10
    assert "did not stop" not in caplog.text and "had not exited" in caplog.text
