"""CoreClient: the API server's side of an engine core, for asyncio callers.

The client binds both channels (ipc.py), then starts its core (a spawned process, or a thread of this
process for tests and embedding) which connects. Callers on any event loop add requests (awaiting the core's
verdict: a ValueError for bad input), abort them (idempotent; the stream ends with finish_reason 'abort')
and iterate their RequestStream. One receiver thread reads the core's messages, rebuilds cumulative outputs
from the deltas, makes their text (output_processor.py: detokenization, stop strings, which it reports back
to the core as StopSamples so the stopped samples' blocks are freed at once), hands them to the streams (one
loop wake-up per message), feeds the observer (metrics) and keeps `last_stats`. The assembler and the
output processor belong to that thread alone (requests join them when their verdict arrives), so the
text work holds no lock a caller waits on.

If the core dies (its process exits, it reports CoreFailed, or its thread ends) every request in flight fails
at once with EngineError (a 500), waiting adds with EngineDeadError, and `is_running` turns false (/health
503); nothing waits on a dead core.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import dataclasses
import itertools
import logging
import threading
import time
from collections import defaultdict
from typing import Any, Protocol

import msgspec
import zmq

from lamina.engine.deltas import OutputAssembler
from lamina.engine.engine import EngineStats
from lamina.engine.ipc import (
    Abort,
    Add,
    Addresses,
    Codec,
    CoreFailed,
    CoreInfo,
    Ready,
    SampleStop,
    Shutdown,
    StepOutputs,
    Stopped,
    StopSamples,
    Verdicts,
)
from lamina.engine.output_processor import OutputProcessor
from lamina.engine.streams import (
    EngineDeadError,
    EngineError,
    EngineObserver,
    RequestStream,
    StreamingClient,
    deliver,
)
from lamina.sampling_params import SamplingParams

log = logging.getLogger("lamina")

_POLL_MS = 500  # how often the receiver checks a core that has no exit sentinel (a thread)
_SEND_TIMEOUT_MS = 5000  # a core that stops reading for this long is treated as gone


class CoreBackend(Protocol):
    """Where the core runs: CoreProcess (core_proc.py) or a thread (async_engine.py)."""

    def start(self, addrs: Addresses) -> None: ...
    def alive(self) -> bool: ...
    @property
    def sentinel(self) -> int | None: ...
    def describe_exit(self) -> str: ...
    def stop(self, timeout: float, stopped: bool = False) -> None: ...
    def kill(self) -> None: ...


class CoreClient(StreamingClient):
    def __init__(self, backend: CoreBackend, observer: EngineObserver | None = None, tokenizer=None) -> None:
        self.backend = backend
        self.observer = observer
        self.info: CoreInfo | None = None
        self.last_stats: EngineStats | None = None
        self.num_step_failures = 0
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._streams: dict[str, RequestStream] = {}
        # request id -> (its verdict's future, what the output side needs once it is queued)
        self._pending: dict[str, tuple[concurrent.futures.Future, SamplingParams, str | None]] = {}
        self._assembler = OutputAssembler()
        self._processor = OutputProcessor(tokenizer)
        self._ready = threading.Event()
        self._stopped = threading.Event()  # the core answered Shutdown with Stopped
        self._dead: str | None = None  # why the core is gone
        self._closing = False
        self._started = False
        self._ctx: zmq.Context | None = None
        self._receiver: threading.Thread | None = None

    def set_tokenizer(self, tokenizer) -> None:
        """The tokenizer outputs are decoded with (a private copy: HF fast tokenizers must not be shared
        across threads). Before the first request; None: token ids only (outputs have empty text)."""
        self._processor = OutputProcessor(copy.deepcopy(tokenizer))

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self, timeout: float | None = None, wait: bool = True) -> None:
        """Starts the core and (with `wait`) waits until it is ready: see wait_ready."""
        if self._started:
            if wait:
                self.wait_ready(timeout)
            return
        self._started = True
        self._addrs = Addresses.fresh()
        self._ctx = zmq.Context()
        self._out = self._ctx.socket(zmq.PUSH)
        self._out.setsockopt(zmq.LINGER, 0)
        self._out.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
        self._out.bind(self._addrs.to_core)
        self._in = self._ctx.socket(zmq.PULL)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.bind(self._addrs.from_core)
        self.backend.start(self._addrs)
        self._receiver = threading.Thread(target=self._receive, name="lamina-core-client", daemon=True)
        self._receiver.start()
        if wait:
            self.wait_ready(timeout)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Blocks until the core has loaded its model; raises RuntimeError (and stops) if it failed."""
        if not self._ready.wait(timeout) or self._dead is not None:
            reason = self._dead or "the engine core did not start in time"
            self.shutdown(timeout=5)
            raise RuntimeError(reason)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ends every stream (EngineDeadError), stops the core (it returns every lease first), closes up."""
        if not self._started or self._ctx is None:
            return
        with self._lock:
            self._closing = True
            dead = EngineDeadError("the engine is shutting down")
            self._fail_local(dead, dead)
            loading = not self._ready.is_set()
            sent = False
            if self._dead is None and not loading:
                try:
                    self._send_locked(Shutdown())
                    sent = True
                except EngineDeadError:  # not reading: stop() below kills it after the timeout
                    pass
        if loading:  # still loading the model: it reads no messages yet, and nothing it holds is in use
            self.backend.kill()
        elif sent:  # wait for its Stopped (leases returned, last outputs sent): then only its exit is left
            deadline = time.monotonic() + timeout
            while not self._stopped.wait(0.05) and self.backend.alive() and time.monotonic() < deadline:
                pass
        self.backend.stop(timeout, self._stopped.is_set())
        if self._receiver is not None:
            self._receiver.join(timeout)
        self._in.close(0)
        self._out.close(0)
        self._ctx.term()
        self._ctx = None
        self._addrs.cleanup()

    @property
    def is_running(self) -> bool:
        return self._started and self._ready.is_set() and self._dead is None and not self._closing

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def holds(self, request_id: str) -> bool:
        """Whether the request is in flight here (added and not finished)."""
        return request_id in self._streams

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    # ---- caller side (any thread with a running event loop) ------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams
                          ) -> RequestStream:
        """Queues a request; raises the engine's ValueError for bad input before anything streams, and
        EngineDeadError when the core is not running."""
        prompt = _normalize_prompt(prompt)
        stream = RequestStream(request_id, asyncio.get_running_loop())
        fut: concurrent.futures.Future = concurrent.futures.Future()
        try:
            data = msgspec.msgpack.encode(Add(request_id, prompt, dataclasses.asdict(params)))
        except (TypeError, OverflowError) as e:  # e.g. a token id past 64 bits
            raise ValueError(f"the prompt cannot be sent to the engine: {e}") from None
        with self._lock:
            if not self.is_running:
                raise EngineDeadError(self._dead or "the engine is not running")
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
            self._pending[request_id] = (fut, params, prompt if isinstance(prompt, str) else None)
            try:
                self._send_locked(data)
            except EngineDeadError:
                self._streams.pop(request_id, None)
                self._pending.pop(request_id, None)
                raise
        try:
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            self.abort(request_id)  # the add may have gone through: messages run in order, so this undoes it
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Thread-safe and idempotent; the request's stream ends with finish_reason 'abort'."""
        self._send_abort([request_id])

    def abort_all(self) -> int:
        """Aborts every request of this client (a clean end for each stream); returns how many."""
        ids = list(self._streams)
        if ids:
            self._send_abort(ids)
        return len(ids)

    def _send_abort(self, ids: list[str]) -> None:
        with self._lock:
            if self._dead is None and not self._closing and self._ctx is not None:
                try:
                    self._send_locked(Abort(ids))
                except EngineDeadError:
                    pass  # the receiver fails the streams when it sees the core gone

    def _send_locked(self, msg: Any) -> None:
        """Under _lock (ZeroMQ sockets are not thread-safe)."""
        data = msg if isinstance(msg, bytes) else msgspec.msgpack.encode(msg)
        try:
            self._out.send(data)
        except zmq.Again:
            raise EngineDeadError("the engine core is not reading its input") from None


    # ---- receiver thread ------------------------------------------------------------------------
    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self._in, zmq.POLLIN)
        sentinel = self.backend.sentinel
        if sentinel is not None:
            poller.register(sentinel, zmq.POLLIN)
        decode = Codec().from_core.decode
        try:
            while not self._closing or self.backend.alive():
                events = dict(poller.poll(_POLL_MS))
                if self._in in events:
                    while True:
                        try:
                            frame = self._in.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._handle(decode(frame))
                    continue  # drain before looking at the sentinel: the last outputs come before the exit
                if self._dead is not None:
                    return
                if not self.backend.alive():
                    if not self._closing:
                        self._die(self.backend.describe_exit())
                    return
        except Exception as e:  # a bug here must not leave callers waiting forever on their streams
            log.exception("the engine core client's receiver died")
            self._die(f"the engine client failed: {type(e).__name__}: {e}")

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, StepOutputs):
            self._on_step(msg)
        elif isinstance(msg, Verdicts):
            with self._lock:
                for v in msg.items:
                    pending = self._pending.pop(v.request_id, None)
                    if v.error is not None:
                        self._streams.pop(v.request_id, None)
                    if pending is None:
                        continue
                    fut, params, prompt = pending
                    if v.error is None:  # queued in the core, even if its caller gave up meanwhile (it aborts)
                        self._assembler.start(v.request_id, prompt)
                        self._processor.add(v.request_id, params)
                    if not fut.set_running_or_notify_cancel():
                        continue
                    if v.error is None:
                        fut.set_result(None)
                    else:
                        fut.set_exception(ValueError(v.error) if v.bad_input else EngineError(v.error))
        elif isinstance(msg, Ready):
            self.info = msg.info
            self.last_stats = EngineStats(0, 0, msg.info.num_total_blocks, msg.info.num_total_blocks)
            self._ready.set()
        elif isinstance(msg, Stopped):
            self._stopped.set()
        elif isinstance(msg, CoreFailed):
            self._die(msg.message)

    def _on_step(self, msg: StepOutputs) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        if self._closing:
            return
        results = []
        stops: list[SampleStop] = []
        emitted = self._processor.num_emitted
        for d in msg.outputs:  # outside the lock: decoding must not hold up callers adding requests
            raw = self._assembler.apply(d)
            out, cut = self._processor.process(raw) if raw is not None else (None, [])
            if out is None:
                continue
            stops += cut
            if out.finished:
                self._assembler.forget(d.request_id)  # finished here first (a stop string): ignore the rest
            results.append(out)
        with self._lock:
            if self._closing:
                return
            if stops and self._dead is None:
                try:
                    self._send_locked(StopSamples(stops))
                except EngineDeadError:
                    pass  # the receiver fails the streams when it sees the core gone
            for out in results:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue
                if out.finished:
                    del self._streams[out.request_id]
                by_loop[stream.loop].append((stream, out))
        for loop, items in by_loop.items():
            deliver(loop, items)
        # Only what reached the consumers: tokens the core made past a stop string (before its StopSamples
        # arrived) are dropped above, and the core's own count would include them.
        msg.iteration.num_generation_tokens = self._processor.num_emitted - emitted
        self.last_stats = msg.stats
        if msg.iteration.step_failed:
            self.num_step_failures += 1
        if self.observer is not None:
            try:
                self.observer.on_iteration(msg.iteration, msg.stats)
            except Exception:  # metrics must never take the engine down
                log.exception("engine observer failed")

    def _die(self, reason: str) -> None:
        with self._lock:
            if self._dead is not None:
                return
            self._dead = reason
            if not self._closing and self._ready.is_set():  # (a start-up failure is raised by wait_ready)
                log.error("%s: failing %d request(s) in flight; /health now answers 503", reason, len(self._streams))
            self._fail_local(EngineError(reason), EngineDeadError(reason))
        self._ready.set()  # a start() still waiting must not wait on

    def _fail_local(self, in_flight: BaseException, waiting: BaseException) -> None:
        """Under _lock: fails every stream with `in_flight` and every add still awaiting its verdict with
        `waiting`, without the core's help."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = defaultdict(list)
        for rid, stream in self._streams.items():
            pending = self._pending.pop(rid, None)
            if pending is not None:
                fut = pending[0]
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(waiting)
                continue
            by_loop[stream.loop].append((stream, in_flight))
        self._streams.clear()
        self._pending.clear()
        for loop, items in by_loop.items():
            deliver(loop, items)


def _normalize_prompt(prompt: Any) -> Any:
    """A prompt dict becomes its string or ids (what the channel carries); the core validates the rest."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError("a prompt dict needs 'prompt' or 'prompt_token_ids'")
    if isinstance(prompt, tuple):
        return list(prompt)
    return prompt
