"""The request-head deadline of limits.TimeoutH11Protocol for uvicorn's httptools protocol (same contract):
a connection that has not sent a whole request head within `header_timeout` seconds of connecting, or of
starting its next request on a kept-alive connection, is closed."""
from __future__ import annotations

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from lamina.server.limits import HeadDeadline


class TimeoutHttpToolsProtocol(HeadDeadline, HttpToolsProtocol):
    def connection_made(self, transport) -> None:  # type: ignore[override]
        self._parse_error = ""
        super().connection_made(transport)
        self.parser = _ReasonKeepingParser(self.parser, self)

    def send_400_response(self, msg: str) -> None:
        # The parser's reason (e.g. "Transfer-Encoding can't be present with Content-Length") in the reply.
        super().send_400_response(f"{msg} {self._parse_error}".strip())

    def on_message_begin(self) -> None:  # the first bytes of a request: its head has header_timeout
        super().on_message_begin()
        self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._disarm_head_timer()
        super().on_headers_complete()


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
