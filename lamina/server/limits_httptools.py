"""The request-head deadline of limits.TimeoutH11Protocol for uvicorn's httptools protocol (same contract):
a connection that has not sent a whole request head within `header_timeout` seconds of connecting, or of
starting its next request on a kept-alive connection, is closed."""
from __future__ import annotations

import asyncio

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class TimeoutHttpToolsProtocol(HttpToolsProtocol):
    header_timeout: float = 10.0

    @classmethod
    def with_timeout(cls, seconds: float) -> type[TimeoutHttpToolsProtocol]:
        return type(cls.__name__, (cls,), {"header_timeout": seconds})

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        self._parse_error = ""
        super().connection_made(transport)
        self.parser = _ReasonKeepingParser(self.parser, self)
        self._arm_head_timer()

    def send_400_response(self, msg: str) -> None:
        # The parser's reason (e.g. "Transfer-Encoding can't be present with Content-Length") in the reply.
        super().send_400_response(f"{msg} {self._parse_error}".strip())

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def on_message_begin(self) -> None:  # the first bytes of a request: its head has header_timeout
        super().on_message_begin()
        self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._disarm_head_timer()
        super().on_headers_complete()

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)


class _ReasonKeepingParser:
    """The httptools parser, noting why it refused a request (uvicorn's 400 otherwise says only "invalid")."""

    def __init__(self, parser, owner: TimeoutHttpToolsProtocol) -> None:
        self._parser, self._owner = parser, owner

    def feed_data(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._owner._parse_error = str(e)
            raise

    def __getattr__(self, name: str):
        return getattr(self._parser, name)
