"""Limits on what one HTTP client can hold: how long it may take to send a request's head and body, how
large the body may be, and one framing per body.

uvicorn (h11 or httptools) keeps a connection that sent half a request line open forever and hands the app a body of any
size; these two pieces close the first and answer the second with a 413 (or a 408 when the body stalls, or a
400 for a request with both Content-Length and Transfer-Encoding), each closing the connection.
"""
from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class HeadDeadline:
    """The request-head deadline, mixed into one of uvicorn's HTTP protocols (before it in the bases): the
    timer is armed on connecting and whenever a request head is incomplete, disarmed once it is whole, and on
    expiry the connection is closed if _head_pending() (nothing of a response is under way)."""

    header_timeout: float = 10.0

    @classmethod
    def with_timeout(cls, seconds: float) -> type:
        return type(cls.__name__, (cls,), {"header_timeout": seconds})

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)  # type: ignore[misc]
        self._arm_head_timer()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_pending(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing() and self._head_pending():
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)  # type: ignore[misc]


class TimeoutH11Protocol(HeadDeadline, H11Protocol):
    """uvicorn's h11 protocol, plus a deadline for the request line and headers: a connection that has not
    sent a whole request head within `header_timeout` seconds of connecting (or of its previous response,
    once it starts sending the next request) is closed."""

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm_head_timer()  # a partial request head: it has header_timeout to complete
        else:
            self._disarm_head_timer()

    def _head_pending(self) -> bool:
        return self.conn.their_state is h11.IDLE and super()._head_pending()


def head_timeout_protocol(kind: str, seconds: float) -> type:
    """uvicorn's HTTP protocol class with the request-head deadline. kind "auto" takes httptools when it is
    installed (uvicorn[standard]): its C parser and framing cost a fraction of h11's pure-Python ones per
    streamed chunk, which matters at thousands of SSE chunks per second; else h11."""
    if kind == "auto":
        try:
            import httptools  # noqa: F401

            kind = "httptools"
        except ImportError:
            kind = "h11"
    if kind == "httptools":
        from lamina.server.limits_httptools import TimeoutHttpToolsProtocol

        return TimeoutHttpToolsProtocol.with_timeout(seconds)
    if kind == "h11":
        return TimeoutH11Protocol.with_timeout(seconds)
    raise ValueError(f"unknown HTTP protocol {kind!r} (auto, h11, httptools)")


def _error_response(status: int, message: str) -> tuple[dict, dict]:
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                 "code": None}}).encode()
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                         (b"connection", b"close")]}
    return start, {"type": "http.response.body", "body": body}


class BodyLimits:
    """Plain ASGI middleware: reads a request's body before the app sees it, refusing one larger than
    max_bytes (413), slower than timeout seconds (408) or framed twice (400), then replays it to the app
    (later receive() calls, e.g. a streaming response listening for a disconnect, go to the server). Each
    refusal closes the connection: the rest of the body is never read."""

    def __init__(self, app, max_bytes: int, timeout: float) -> None:
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        length = headers.get(b"content-length")
        if length is not None and b"transfer-encoding" in headers:
            # Two framings of one body: whichever we picked, a proxy in front may pick the other (smuggling).
            return await self._refuse(send, 400, "a request must not have both Content-Length and "
                                                 "Transfer-Encoding")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(send, 413, f"the request body is larger than {self.max_bytes} bytes")
        chunks: list[bytes] = []
        size = 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                return await self._refuse(send, 408, f"the request body did not arrive within {self.timeout:g} s")
            if message["type"] != "http.request":  # the client left: let the app see it as usual
                return await self.app(scope, _replay([message], receive), send)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(send, 413, f"the request body is larger than {self.max_bytes} bytes")
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)

    @staticmethod
    async def _refuse(send, status: int, message: str) -> None:
        start, body = _error_response(status, message)
        await send(start)
        await send(body)


def _replay(messages: list[dict], receive):
    pending = list(messages)

    async def replaying_receive() -> dict:
        if pending:
            return pending.pop(0)
        return await receive()

    return replaying_receive
