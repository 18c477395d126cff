"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} for every failure the server answers.

FastAPI answers validation failures with 422 and its own body; OpenAI clients expect 400 and this shape, so
the handlers below take over validation, HTTP and unexpected errors alike.
"""
from __future__ import annotations

import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("lamina.server")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 500: "internal_server_error",
          503: "service_unavailable_error"}


class APIError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.type = type or _TYPES.get(status, "invalid_request_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


class ClientDisconnected(Exception):
    """The client went away before its answer was ready (its requests are aborted): answered 499, which
    nobody reads, so that the handlers need not catch it."""


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(message, 400, param)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _loc_param(loc: tuple) -> str | None:
    """'messages.0.role' from pydantic's location, without the branch tags a union adds ('list[int]')."""
    parts = [str(p) for p in loc[1:] if isinstance(p, int) or (p.isidentifier() and p.islower()
                                                                and p not in _TYPE_TAGS)]
    return ".".join(parts) or None


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return APIError("the request body is not valid JSON", 400, code="json_invalid")
    param = _loc_param(tuple(first.get("loc", ())))
    parts = []
    for e in errors[:5]:  # a union field reports one error per branch; the first few say enough
        where = _loc_param(tuple(e.get("loc", ())))
        parts.append(f"{where}: {e.get('msg')}" if where else str(e.get("msg")))
    return bad_request("; ".join(parts), param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "error"
        message = exc.detail if isinstance(exc.detail, str) else phrase
        return APIError(message, exc.status_code).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return APIError(f"internal error: {type(exc).__name__}: {exc}", 500).response()
