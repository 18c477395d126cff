"""Anthropic's Messages API: POST /v1/messages (streaming or not) and POST /v1/messages/count_tokens.

The conversation goes through the model's chat template (conversation.py); the reply is cut into thinking,
text and tool_use blocks by an output splitter (agent_output.py). Streams follow Anthropic's event
sequence: message_start, ping, then per block content_block_start / content_block_delta (text_delta,
thinking_delta, input_json_delta) / content_block_stop, then message_delta (stop_reason, usage) and
message_stop. Errors, on these routes only, take Anthropic's shape: {"type": "error", "error": {"type",
"message"}}.

Usage follows Anthropic's accounting: `input_tokens` are the prompt tokens computed for this request and
`cache_read_input_tokens` those served from the prefix cache (their sum is the prompt length).
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from starlette.background import BackgroundTask

from lamina.outputs import CompletionOutput, RequestOutput
from lamina.server.agent_output import Piece, Splitter, ToolCall
from lamina.server.agent_plan import AgentPlan, plan_agent
from lamina.server.anthropic_protocol import CountTokensRequest, MessagesRequest
from lamina.server.conversation import Prompt, keeps_special_tokens, render_prompt, splitter_for
from lamina.server.errors import APIError, validation_error
from lamina.server.serving import (
    SSE_HEADERS,
    ServerState,
    abort_unfinished,
    collect,
    merge,
    start_requests,
)

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 408: "timeout_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error"}


def error_body(status: int, message: str) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


class AnthropicRoute(APIRoute):
    """A route whose errors (validation, API key, handler) are answered in Anthropic's error shape."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except RequestValidationError as e:
                err = validation_error(e)
                return JSONResponse(error_body(err.status, err.message), status_code=err.status)
            except APIError as e:
                message = f"{e.param}: {e.message}" if e.param and e.param not in e.message else e.message
                return JSONResponse(error_body(e.status, message), status_code=e.status)

        return route


def _prompt(req: CountTokensRequest, state: ServerState) -> tuple[Prompt, AgentPlan]:
    """The prompt and the plan of a request (forced tool calls and output_config.format are constraints)."""
    req.check_supported()
    choice = req.tool_choice
    plan = plan_agent(req.openai_tools(), req.forced_tool(), choice is None or not choice.disable_parallel_tool_use,
                      req.output_constraint(), "output_config.format")
    return render_prompt(state, req.conversation(), plan.tools, req.template_kwargs()), plan


async def count_tokens(req: CountTokensRequest, state: ServerState) -> JSONResponse:
    state.check_model(req.model)
    prompt, _ = _prompt(req, state)
    return JSONResponse({"input_tokens": len(prompt.ids)})


def _usage(num_prompt: int, out: RequestOutput | None, output_tokens: int) -> dict[str, int]:
    cached = out.num_cached_tokens if out is not None else 0
    return {"input_tokens": num_prompt - cached, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _stop(comp: CompletionOutput, calls: list[ToolCall]) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence)."""
    if comp.finish_reason == "error":
        raise APIError("the engine failed this request", 500)
    if comp.finish_reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if isinstance(comp.stop_reason, str):
        return "stop_sequence", comp.stop_reason
    return "end_turn", None


def _tool_use(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": f"toolu_{call.id}", "name": call.name, "input": call.input()}


def _blocks(pieces: list[Piece], calls: list[ToolCall]) -> list[dict]:
    blocks: list[dict] = []
    for kind, text in pieces:
        key = "thinking" if kind == "reasoning" else "text"
        if blocks and blocks[-1]["type"] == key:
            blocks[-1][key] += text
        else:
            blocks.append({"type": key, key: text, **({"signature": ""} if key == "thinking" else {})})
    return blocks + [_tool_use(c) for c in calls]


async def create_message(req: MessagesRequest, raw: Request, state: ServerState) -> Response:
    state.check_model(req.model)
    prompt, plan = _prompt(req, state)
    tools = plan.tools
    state.check_max_tokens(len(prompt.ids), req.max_tokens)
    params = req.sampling_params(state.sampling_defaults, state.vocab_size, plan.constraint)
    params.skip_special_tokens = not keeps_special_tokens(state, tools, plan)
    message_id = f"msg_{uuid.uuid4().hex[:24]}"
    streams = await start_requests(state, raw, [prompt.ids], params, message_id, param="messages")
    splitter = splitter_for(state, prompt, tools, req.thinking is not None and req.thinking.on,
                            parallel_calls=req.tool_choice is None or not req.tool_choice.disable_parallel_tool_use,
                            plan=plan)
    model = req.model or state.model_name
    if req.stream:
        return StreamingResponse(_stream(state, streams, message_id, model, len(prompt.ids), splitter),
                                 media_type="text/event-stream", headers=SSE_HEADERS,
                                 background=BackgroundTask(abort_unfinished, state, streams))
    (out,) = await collect(raw, state, streams)
    comp = out.outputs[0]
    pieces, calls = splitter.finish(comp.text)
    stop_reason, stop_sequence = _stop(comp, calls)
    return JSONResponse({"id": message_id, "type": "message", "role": "assistant", "model": model,
                         "content": _blocks(pieces, calls), "stop_reason": stop_reason,
                         "stop_sequence": stop_sequence,
                         "usage": _usage(len(prompt.ids), out, len(comp.token_ids))})


def _event(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


class _Blocks:
    """The open content block of a stream: a new kind of piece closes it and opens the next. A tool_use
    block opens once its call's name is known and takes its arguments as input_json_delta fragments."""

    def __init__(self) -> None:
        self.index, self.kind = -1, None
        self.sent: dict[str, tuple[int, int]] = {}  # call id -> (block index, argument characters sent)

    def pieces(self, pieces: list[Piece]) -> list[str]:
        out = []
        for kind, text in pieces:
            if kind != self.kind:
                out += self.close()
                self.index, self.kind = self.index + 1, kind
                start = {"type": "thinking", "thinking": "", "signature": ""} if kind == "reasoning" else \
                    {"type": "text", "text": ""}
                out.append(_event("content_block_start", {"index": self.index, "content_block": start}))
            delta = {"type": "thinking_delta", "thinking": text} if kind == "reasoning" else \
                {"type": "text_delta", "text": text}
            out.append(_event("content_block_delta", {"index": self.index, "delta": delta}))
        return out

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [_event("content_block_stop", {"index": self.index})]

    def calls(self, calls: list[ToolCall]) -> list[str]:
        """Events for the calls' growth since the last time (a new call opens its block)."""
        out = []
        for call in calls:
            if call.id not in self.sent:
                out += self.close()
                self.index, self.kind = self.index + 1, ("tool", call.id)
                self.sent[call.id] = (self.index, 0)
                out.append(_event("content_block_start", {"index": self.index,
                                                          "content_block": {**_tool_use(call), "input": {}}}))
            index, done = self.sent[call.id]
            if len(call.arguments) > done:
                out.append(_event("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": call.arguments[done:]}}))
                self.sent[call.id] = (index, len(call.arguments))
        return out


async def _stream(state: ServerState, streams, message_id: str, model: str, num_prompt: int,
                  splitter: Splitter):
    blocks = _Blocks()
    started = False
    try:
        async for _, out in merge(streams):
            comp = out.outputs[0]
            if not started:  # sent with the first output, when the prefix-cache hit count is known
                started = True
                yield _event("message_start", {"message": {
                    "id": message_id, "type": "message", "role": "assistant", "model": model, "content": [],
                    "stop_reason": None, "stop_sequence": None, "usage": _usage(num_prompt, out, 0)}})
                yield _event("ping", {})
            if comp.finish_reason is None:
                for e in blocks.pieces(splitter.feed(comp.text)) + blocks.calls(splitter.calls()):
                    yield e
                continue
            pieces, calls = splitter.finish(comp.text)
            stop_reason, stop_sequence = _stop(comp, calls)
            for e in blocks.pieces(pieces) + blocks.calls(calls) + blocks.close():
                yield e
            yield _event("message_delta", {"delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                           "usage": _usage(num_prompt, out, len(comp.token_ids))})
            yield _event("message_stop", {})
    except Exception as exc:  # headers are out: report in-band
        yield _error_event(exc)
    finally:
        abort_unfinished(state, streams)


def _error_event(exc: BaseException) -> str:
    from lamina.engine.async_engine import EngineDeadError

    if isinstance(exc, APIError):
        body = error_body(exc.status, exc.message)
    elif isinstance(exc, EngineDeadError):
        body = error_body(503, str(exc))
    else:
        body = error_body(500, f"the engine failed this request: {exc}")
    return f"event: error\ndata: {json.dumps(body)}\n\n"
