"""What a request's caller holds: its stream of outputs, and the errors that can end it."""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Protocol

from lamina.engine.engine import EngineStats
from lamina.engine.ipc import IterationStats
from lamina.outputs import RequestOutput
from lamina.sampling_params import SamplingParams


class EngineError(RuntimeError):
    """The engine failed this request (raised to the consumer of its stream; the server answers 500)."""


class EngineDeadError(EngineError):
    """The engine is not running or is shutting down (the server answers 503)."""


class EngineObserver(Protocol):
    """Called after every engine iteration (metrics), on the client's receiver thread."""

    def on_iteration(self, it: IterationStats, stats: EngineStats) -> None: ...


class RequestStream:
    """Outputs of one request, handed from the client's receiver thread to the event loop that asked."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.finished = False
        self.loop = loop
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put_nowait(self, item: RequestOutput | BaseException) -> None:
        """On the stream's event loop."""
        self._queue.put_nowait(item)

    def put(self, item: RequestOutput | BaseException) -> None:
        """From any thread."""
        deliver(self.loop, [(self, item)])

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


class StreamingClient:
    """generate() for a client that adds requests and aborts them: CoreClient, and DPClient (dp_client.py),
    which routes each to one of its CoreClients."""

    async def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams
                          ) -> RequestStream:
        raise NotImplementedError

    def abort(self, request_id: str) -> None:
        raise NotImplementedError

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


def _put_all(items: list[tuple[RequestStream, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream.put_nowait(item)


def deliver(loop: asyncio.AbstractEventLoop, items: list[tuple[RequestStream, RequestOutput | BaseException]]
            ) -> None:
    """Hands items to streams of one loop with a single wake-up of that loop (not one per stream)."""
    try:
        loop.call_soon_threadsafe(_put_all, items)
    except RuntimeError:  # the loop is closed: nobody is listening any more
        pass
