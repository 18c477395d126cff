"""AsyncEngine: the synchronous LLMEngine driven by one background thread, for asyncio callers (the server).

LLMEngine is not thread-safe, so every call into it (add, abort, step) happens on the engine thread. Callers
send commands through a queue; an add returns its verdict (or the engine's ValueError) through a future, and
each request streams its outputs through its own asyncio queue, fed with loop.call_soon_threadsafe. When
there is no work the thread blocks on the command queue instead of spinning.

A failure inside engine.step() fails the requests in flight (their blocks are returned) and the loop goes
on serving new requests.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Protocol

import torch

from lamina.engine.engine import EngineStats, LLMEngine
from lamina.outputs import RequestOutput
from lamina.sampling_params import SamplingParams

log = logging.getLogger("lamina")


class EngineError(RuntimeError):
    """The engine failed this request (raised to the consumer of its stream)."""


class EngineDeadError(EngineError):
    """The engine thread is not running."""


@dataclass
class FinishedRequest:
    finish_reason: str  # of the first sample: "stop", "length" or "error" (aborts are not counted)
    e2e_latency: float
    num_prompt_tokens: int
    num_generation_tokens: int


@dataclass
class IterationStats:
    """What one engine iteration did, in the units Prometheus wants."""
    num_prompt_tokens: int = 0  # prompts that got their first token this iteration
    num_cached_prompt_tokens: int = 0  # of those, tokens served from the prefix cache
    num_generation_tokens: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)
    step_failed: bool = False  # engine.step() raised and the requests in flight were failed


class EngineObserver(Protocol):
    """Gets called on the engine thread after every iteration (metrics)."""

    def on_iteration(self, it: IterationStats, stats: EngineStats) -> None: ...


class RequestStream:
    """Outputs of one request, handed from the engine thread to the event loop that asked for them."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.finished = False
        self._loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Engine thread side."""
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    async def get(self) -> RequestOutput:
        """The latest output. Outputs are cumulative, so when the consumer falls behind the backlog is
        collapsed into the newest one instead of being replayed step by step."""
        item = await self._queue.get()
        while not self._queue.empty() and not isinstance(item, BaseException):
            item = self._queue.get_nowait()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        if item.error is not None:
            raise EngineError(item.error)
        return item

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            yield await self.get()


@dataclass
class _Add:
    request_id: str
    prompt: Any
    params: SamplingParams
    stream: RequestStream
    future: concurrent.futures.Future


@dataclass
class _Abort:
    request_id: str


@dataclass
class _Tracker:
    """Per-request timing kept on the engine thread for the latency metrics."""
    arrival: float
    first_token: bool = False
    num_tokens: dict[int, int] = field(default_factory=dict)  # sample index -> tokens seen
    last_token_time: dict[int, float] = field(default_factory=dict)


_STOP = object()


class AsyncEngine:
    def __init__(self, engine: LLMEngine, observer: EngineObserver | None = None) -> None:
        self.engine = engine
        if hasattr(engine, "stream_outputs"):
            engine.stream_outputs = True  # every step's progress, not just finished requests
        self.observer = observer
        self._cmds: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._trackers: dict[str, _Tracker] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.last_stats: EngineStats = engine.stats()  # a snapshot other threads may read
        self.num_step_failures = 0

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="lamina-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self._thread is None:
            return
        self._cmds.put(_STOP)
        self._thread.join(timeout)
        self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    # ---- caller side (any thread with a running event loop) ------------------------------------
    async def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams
                          ) -> RequestStream:
        """Queues a request; raises the engine's ValueError for bad input before anything streams."""
        if not self.is_running:
            raise EngineDeadError("the engine is not running")
        stream = RequestStream(request_id, asyncio.get_running_loop())
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put(_Add(request_id, prompt, params, stream, fut))
        try:
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            self.abort(request_id)  # the add may have gone through: commands run in order, so this undoes it
            raise
        return stream

    def abort(self, request_id: str) -> None:
        """Thread-safe and idempotent; the request's stream ends with finish_reason 'abort'."""
        self._cmds.put(_Abort(request_id))

    async def generate(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams
                       ) -> AsyncIterator[RequestOutput]:
        """add_request + iterate; aborts the request when the consumer stops early."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(request_id)

    # ---- engine thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            # Grad mode is per thread: the main thread's settings do not reach this one.
            with torch.inference_mode():
                self._serve()
        except BaseException:  # a bug here must not leave callers waiting forever on their streams
            log.exception("the engine loop died")
            self._fail_all("the engine loop died", EngineDeadError)
            self._reject_queued("the engine loop died")
            raise

    def _serve(self) -> None:
        self._publish(IterationStats())  # gauges have values before the first request
        while True:
            # Block when idle: a waiting thread costs nothing, a polling one steals a core from the model.
            cmds = [] if self.engine.has_unfinished_requests() else [self._cmds.get()]
            while True:
                try:
                    cmds.append(self._cmds.get_nowait())
                except queue.Empty:
                    break
            for cmd in cmds:
                if cmd is _STOP:
                    self._fail_all("the engine is shutting down", EngineDeadError)
                    self._reject_queued("the engine is shutting down")
                    return
                try:
                    self._handle(cmd)
                except Exception:  # a command must never kill the loop that serves everyone else
                    log.exception("engine command %r failed", cmd)
            it = IterationStats()
            if self.engine.has_unfinished_requests():
                self._step(it)
            self._publish(it)

    def _handle(self, cmd: _Add | _Abort) -> None:
        if isinstance(cmd, _Add):
            if not cmd.future.set_running_or_notify_cancel():
                return  # the caller gave up before the add ran
            try:
                self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params)
            except Exception as exc:  # bad input: nothing was queued; the caller gets the exception
                cmd.future.set_exception(exc)
                return
            self._streams[cmd.request_id] = cmd.stream
            self._trackers[cmd.request_id] = _Tracker(time.monotonic())
            cmd.future.set_result(None)
        else:
            out = self.engine.abort_request(cmd.request_id)
            stream = self._streams.pop(cmd.request_id, None)
            self._trackers.pop(cmd.request_id, None)
            if stream is not None and out is not None:
                stream.put(out)

    def _step(self, it: IterationStats) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # engine.step() already contains model failures; this is the rest
            log.exception("engine step failed; failing the requests in flight")
            self.num_step_failures += 1
            it.step_failed = True
            self._fail_all(f"{type(exc).__name__}: {exc}", EngineError)
            return
        now = time.monotonic()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            self._track(out, now, it)
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]
                self._trackers.pop(out.request_id, None)

    def _track(self, out: RequestOutput, now: float, it: IterationStats) -> None:
        tr = self._trackers.get(out.request_id)
        if tr is None:
            return
        for comp in out.outputs:
            n = len(comp.token_ids)
            prev = tr.num_tokens.get(comp.index, 0)
            if n > prev:
                it.num_generation_tokens += n - prev
                if not tr.first_token:
                    tr.first_token = True
                    it.num_prompt_tokens += len(out.prompt_token_ids)
                    it.num_cached_prompt_tokens += out.num_cached_tokens
                    it.time_to_first_tokens.append(now - tr.arrival)
                elif comp.index in tr.last_token_time:
                    gap = (now - tr.last_token_time[comp.index]) / (n - prev)
                    it.inter_token_latencies += [gap] * (n - prev)
                tr.num_tokens[comp.index] = n
                tr.last_token_time[comp.index] = now
        if out.finished:
            it.finished.append(FinishedRequest(out.outputs[0].finish_reason or "stop", now - tr.arrival,
                                               len(out.prompt_token_ids),
                                               sum(len(c.token_ids) for c in out.outputs)))

    def _fail_all(self, message: str, kind: type[EngineError]) -> None:
        """Fails every request in flight and returns their blocks, so the engine starts over clean."""
        for rid in set(self._streams) | set(self.engine.request_ids()):
            try:
                self.engine.abort_request(rid)
            except Exception:
                log.exception("abort of %s failed", rid)
            stream = self._streams.pop(rid, None)
            if stream is not None:
                stream.put(kind(message))
        self._trackers.clear()

    def _reject_queued(self, message: str) -> None:
        """Adds still queued when the loop ends would otherwise wait forever for their verdict."""
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(EngineDeadError(message))

    def _publish(self, it: IterationStats) -> None:
        self.last_stats = self.engine.stats()
        if self.observer is not None:
            try:
                self.observer.on_iteration(it, self.last_stats)
            except Exception:  # metrics must never take the engine down
                log.exception("engine observer failed")
