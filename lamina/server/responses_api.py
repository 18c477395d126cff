"""OpenAI's Responses API: POST /v1/responses (streaming or not), GET and DELETE /v1/responses/{id}.

The input items become a chat conversation (responses_protocol.py) rendered by the model's template
(conversation.py); the reply is cut into reasoning, message and function_call output items by the output
splitter (agent_output.py). Streams send the typed events in OpenAI's order, each with its sequence_number:
response.created, response.in_progress, then per item output_item.added, content_part.added, the deltas
(output_text / reasoning_text / function_call_arguments), their .done events, output_item.done, and finally
response.completed (or response.incomplete when max_output_tokens cut the reply).

Stateless unless the server was started with a response store (`--responses-store-size`): then responses
with `store` (OpenAI's default) are kept in the app's bounded LRU, for `previous_response_id` and GET.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from lamina.outputs import RequestOutput
from lamina.server.agent_output import Piece, Splitter, ToolCall
from lamina.server.agent_plan import plan_agent
from lamina.server.conversation import keeps_special_tokens, render_prompt, splitter_for
from lamina.server.errors import APIError
from lamina.server.response_store import ResponseStore, StoredResponse
from lamina.server.responses_protocol import ResponsesRequest
from lamina.server.serving import (
    SSE_HEADERS,
    ServerState,
    abort_unfinished,
    collect,
    merge,
    start_requests,
)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class _Output:
    """The output items of one response, built from the splitter's pieces; `events` is what a stream sends
    for each step (the non-streaming path builds the same items and drops the events)."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self.open: dict | None = None  # the reasoning, message or function_call item receiving deltas
        self._calls: dict[str, dict] = {}  # splitter call id -> its function_call item
        self.seq = 0

    def event(self, kind: str, **data: Any) -> str:
        body = {"type": kind, "sequence_number": self.seq, **data}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _where(self) -> dict:
        return {"item_id": self.open["id"], "output_index": self.items.index(self.open)}

    def pieces(self, pieces: list[Piece]) -> list[str]:
        out: list[str] = []
        for kind, text in pieces:
            want = "reasoning" if kind == "reasoning" else "message"
            if self.open is None or self.open["type"] != want:
                out += self.close()
                out += self._start(want)
            part = self.open["content"][0]
            part["text"] += text
            if want == "reasoning":
                out.append(self.event("response.reasoning_text.delta", **self._where(), content_index=0, delta=text))
            else:
                out.append(self.event("response.output_text.delta", **self._where(), content_index=0, delta=text,
                                      logprobs=[]))
        return out

    def _start(self, kind: str) -> list[str]:
        if kind == "reasoning":
            item = {"type": "reasoning", "id": _id("rs"), "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": "message", "id": _id("msg"), "role": "assistant", "status": "in_progress",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.items.append(item)
        self.open = item
        out = [self.event("response.output_item.added", output_index=len(self.items) - 1, item=dict(item))]
        item["content"] = [part]
        out.append(self.event("response.content_part.added", **self._where(), content_index=0, part=dict(part)))
        return out

    def close(self) -> list[str]:
        item = self.open
        if item is None:
            return []
        self.open = None
        where = {"item_id": item["id"], "output_index": self.items.index(item)}
        if item["type"] == "function_call":
            item["status"] = "completed"
            return [self.event("response.function_call_arguments.done", **where, name=item["name"],
                               arguments=item["arguments"]),
                    self.event("response.output_item.done", output_index=where["output_index"], item=item)]
        part = item["content"][0]
        kind = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
        extra = {} if item["type"] == "reasoning" else {"logprobs": []}
        out = [self.event(kind, **where, content_index=0, text=part["text"], **extra),
               self.event("response.content_part.done", **where, content_index=0, part=part)]
        item["status"] = "completed"
        out.append(self.event("response.output_item.done", output_index=where["output_index"], item=item))
        return out

    def calls(self, calls: list[ToolCall]) -> list[str]:
        """Events for the calls' growth since the last time: a new call opens its function_call item, then its
        arguments arrive as function_call_arguments deltas."""
        out: list[str] = []
        for call in calls:
            item = self._calls.get(call.id)
            if item is None:
                out += self.close()
                item = {"type": "function_call", "id": _id("fc"), "call_id": f"call_{call.id}", "name": call.name,
                        "arguments": "", "status": "in_progress"}
                self.items.append(item)
                self._calls[call.id] = self.open = item
                out.append(self.event("response.output_item.added", output_index=len(self.items) - 1,
                                      item=dict(item)))
            if len(call.arguments) > len(item["arguments"]):
                delta = call.arguments[len(item["arguments"]):]
                item["arguments"] = call.arguments
                out.append(self.event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self.items.index(item), delta=delta))
        return out

    def finish(self, pieces: list[Piece], calls: list[ToolCall]) -> list[str]:
        return self.pieces(pieces) + self.calls(calls) + self.close()

    def assistant_message(self) -> dict:
        """This output as the chat message a follow-up request's history holds."""
        texts, reasoning, calls = [], [], []
        for item in self.items:
            if item["type"] == "message":
                texts.append(item["content"][0]["text"])
            elif item["type"] == "reasoning":
                reasoning.append(item["content"][0]["text"])
            else:
                calls.append({"id": item["call_id"], "type": "function",
                              "function": {"name": item["name"], "arguments": _arguments(item["arguments"])}})
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
        return msg


def _arguments(text: str) -> dict:
    """A call's arguments for the history; {} for ones max_output_tokens cut short."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class _Run:
    """One response being produced: its request, prompt, fixed fields and the store it may go into."""

    def __init__(self, req: ResponsesRequest, state: ServerState, store: ResponseStore, history: list[dict],
                 num_prompt: int) -> None:
        self.req, self.state, self.store, self.num_prompt = req, state, store, num_prompt
        self.id, self.created = _id("resp"), int(time.time())
        self.history = history  # the conversation up to this response's input, for storing
        self.stored = store.enabled and req.store
        self.output = _Output()

    def body(self, status: str, out: RequestOutput | None = None) -> dict:
        r = self.req
        usage = None
        if out is not None:
            n_out = len(out.outputs[0].token_ids)
            reasoning = "".join(i["content"][0]["text"] for i in self.output.items if i["type"] == "reasoning")
            n_reasoning = len(self.state.tokenizer(reasoning, add_special_tokens=False).input_ids) if reasoning else 0
            usage = {"input_tokens": self.num_prompt, "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                     "output_tokens": n_out, "output_tokens_details": {"reasoning_tokens": min(n_reasoning, n_out)},
                     "total_tokens": self.num_prompt + n_out}
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "model": r.model or self.state.model_name, "output": self.output.items if out is not None else [],
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "error": None, "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
                "temperature": r.temperature, "top_p": r.top_p, "tools": r.tools or [],
                "tool_choice": r.tool_choice or "auto", "parallel_tool_calls": r.parallel_tool_calls,
                "previous_response_id": r.previous_response_id, "store": self.stored,
                "reasoning": r.reasoning.model_dump() if r.reasoning else None, "metadata": r.metadata or {},
                "text": {"format": (r.text or {}).get("format") or {"type": "text"}},
                "truncation": r.truncation or "disabled", "background": False,
                "usage": usage, "user": r.user}

    def done(self, out: RequestOutput) -> dict:
        """The final body; kept in the store when asked for."""
        comp = out.outputs[0]
        if comp.finish_reason == "error":
            raise APIError("the engine failed this request", 500)
        body = self.body("incomplete" if comp.finish_reason == "length" else "completed", out)
        if self.stored:
            self.store.put(self.id, StoredResponse(body, self.history + [self.output.assistant_message()]))
        return body


async def create_response(req: ResponsesRequest, raw: Request, state: ServerState, store: ResponseStore) -> Response:
    state.check_model(req.model)
    req.check_supported()
    history: list[dict] = []
    if req.previous_response_id is not None:
        prev = store.get(req.previous_response_id)
        if prev is None:
            raise APIError(f"Previous response with id '{req.previous_response_id}' not found.", 404,
                           "previous_response_id")
        history = list(prev.conversation)
    history += req.conversation()
    messages = history
    if req.instructions:  # one system turn, first: templates may insist
        if history and history[0]["role"] == "system":
            messages = [{"role": "system", "content": req.instructions + "\n\n" + history[0]["content"]},
                        *history[1:]]
        else:
            messages = [{"role": "system", "content": req.instructions}, *history]
    plan = plan_agent(req.openai_tools(), req.forced_tool(), req.parallel_tool_calls, req.output_constraint(),
                      "text.format")
    tools = plan.tools
    prompt = render_prompt(state, messages, tools, req.template_kwargs())
    state.check_max_tokens(len(prompt.ids), req.max_output_tokens)
    max_tokens = req.max_output_tokens or state.sampling_defaults.get("max_tokens")
    params = req.sampling_params(max_tokens, state.sampling_defaults, state.vocab_size, plan.constraint)
    params.skip_special_tokens = not keeps_special_tokens(state, tools, plan)
    run = _Run(req, state, store, history, len(prompt.ids))
    streams = await start_requests(state, raw, [prompt.ids], params, run.id, param="input")
    splitter = splitter_for(state, prompt, tools, req.reasoning is not None and req.reasoning.on,
                            parallel_calls=req.parallel_tool_calls, plan=plan)
    if req.stream:
        return StreamingResponse(_stream(run, streams, splitter), media_type="text/event-stream", headers=SSE_HEADERS,
                                 background=BackgroundTask(abort_unfinished, state, streams))
    (out,) = await collect(raw, state, streams)
    run.output.finish(*splitter.finish(out.outputs[0].text))
    return JSONResponse(run.done(out))


async def _stream(run: _Run, streams, splitter: Splitter):
    o = run.output
    try:
        yield o.event("response.created", response=run.body("in_progress"))
        yield o.event("response.in_progress", response=run.body("in_progress"))
        async for _, out in merge(streams):
            comp = out.outputs[0]
            if comp.finish_reason is None:
                for e in o.pieces(splitter.feed(comp.text)) + o.calls(splitter.calls()):
                    yield e
                continue
            for e in o.finish(*splitter.finish(comp.text)):
                yield e
            body = run.done(out)
            kind = "response.incomplete" if body["status"] == "incomplete" else "response.completed"
            yield o.event(kind, response=body)
    except Exception as exc:  # headers are out: report in-band
        err = exc if isinstance(exc, APIError) else APIError(f"the engine failed this request: {exc}", 500)
        yield o.event("error", code=err.code or err.type, message=err.message, param=err.param)
    finally:
        abort_unfinished(run.state, streams)


def get_response(store: ResponseStore, response_id: str) -> JSONResponse:
    item = store.get(response_id)
    if item is None:
        raise APIError(f"Response with id '{response_id}' not found.", 404, "response_id")
    return JSONResponse(item.body)


def delete_response(store: ResponseStore, response_id: str) -> JSONResponse:
    if not store.delete(response_id):
        raise APIError(f"Response with id '{response_id}' not found.", 404, "response_id")
    return JSONResponse({"id": response_id, "object": "response", "deleted": True})
