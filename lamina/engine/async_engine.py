"""AsyncEngine: what the server talks to; an engine core client (core_client.py) with the core either in a
process of its own (`AsyncEngine.spawn(config)`, what `lamina serve` does) or, for tests and embedding, on a
thread of this process around an LLMEngine built here (`AsyncEngine(engine)`).

Both run the same core loop (core_proc.CoreLoop) over the same ZeroMQ channels; only where the loop runs
differs. The thread variant shares this process's interpreter lock with its callers, so it is for tests
(faults can be injected into the engine object) and small embeddings, not for serving throughput.
"""
from __future__ import annotations

import copy
import logging
import threading

import zmq

from lamina.config import EngineConfig
from lamina.engine.core import EngineCore
from lamina.engine.core_client import CoreClient
from lamina.engine.core_proc import CoreLoop, CoreProcess, connect, core_info
from lamina.engine.engine import EngineStats, LLMEngine
from lamina.engine.ipc import (
    Addresses,
    Codec,
    CoreFailed,
    FinishedRequest,
    IterationStats,
    Ready,
)
from lamina.engine.streams import (
    EngineDeadError,
    EngineError,
    EngineObserver,
    RequestStream,
)

__all__ = ["AsyncEngine", "EngineDeadError", "EngineError", "EngineObserver", "EngineStats", "FinishedRequest",
           "IterationStats", "RequestStream"]

log = logging.getLogger("lamina")


class ThreadCore:
    """Runs the core loop around an existing LLMEngine on a thread of this process."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self, addrs: Addresses) -> None:
        self._stop.clear()
        self.thread = threading.Thread(target=self._run, args=(addrs,), name="lamina-engine", daemon=True)
        self.thread.start()

    def _run(self, addrs: Addresses) -> None:
        import torch

        ctx = zmq.Context()
        inbox, outbox = connect(ctx, addrs)
        codec = Codec()
        try:
            outbox.send(codec.encode(Ready(core_info(self.engine, 0.0))))
            # Grad mode is per thread: the main thread's settings do not reach this one.
            with torch.inference_mode():
                CoreLoop(EngineCore(self.engine), inbox, outbox, lambda: not self._stop.is_set()).run()
        except BaseException as e:  # a bug here must not leave callers waiting forever on their streams
            log.exception("the engine loop died")
            EngineCore(self.engine).fail_all("the engine loop died")
            outbox.send(codec.encode(CoreFailed(f"the engine loop died: {type(e).__name__}: {e}")))
        finally:
            inbox.close(0)
            outbox.close()
            ctx.term()

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    @property
    def sentinel(self) -> int | None:
        return None

    def describe_exit(self) -> str:
        return "the engine thread ended"

    def stop(self, timeout: float, stopped: bool = False) -> None:
        if self.thread is None:
            return
        self.thread.join(timeout)
        if self.thread.is_alive():
            self._stop.set()  # not draining its input any more: make it leave at its next idle wake-up
            self.thread.join(2)

    def kill(self) -> None:
        self._stop.set()


class AsyncEngine(CoreClient):
    def __init__(self, engine: LLMEngine | None = None, observer: EngineObserver | None = None,
                 backend=None) -> None:
        # The thread core's engine tokenizes text prompts on its thread: the output side decodes with a copy.
        super().__init__(backend if backend is not None else ThreadCore(engine), observer,
                         copy.deepcopy(engine.tokenizer) if engine is not None else None)
        self.engine = engine  # the in-process engine (thread core), None behind a core process
        if engine is not None:
            self.last_stats = engine.stats()

    @classmethod
    def spawn(cls, config: EngineConfig, observer: EngineObserver | None = None, wait: bool = True,
              tokenizer=None) -> AsyncEngine:
        """Starts a core process that loads the model from `config`; with `wait`, returns once it is ready
        (else call wait_ready). Raises RuntimeError with the core's reason if loading fails. Outputs are
        decoded with `tokenizer` (a private copy is kept), or one given later to set_tokenizer."""
        client = cls(None, observer, backend=CoreProcess(config))
        if tokenizer is not None:
            client.set_tokenizer(tokenizer)
        client.start(wait=wait)
        return client

    @property
    def pid(self) -> int | None:
        """The core process's id (None for a thread core)."""
        return getattr(getattr(self.backend, "proc", None), "pid", None)
