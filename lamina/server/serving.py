"""What the completions and chat endpoints share: server state, input checks, starting requests, merging
their streams, aborting them when the client goes away, and SSE framing."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request
from pydantic import BaseModel

from lamina.engine.async_engine import AsyncEngine, EngineDeadError, EngineError, RequestStream
from lamina.outputs import RequestOutput
from lamina.sampling_params import SamplingParams
from lamina.server.errors import APIError, bad_request
from lamina.server.metrics import ServerMetrics


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Any  # a private copy: HF fast tokenizers must not be shared with the engine thread
    model_names: list[str]
    model_root: str
    max_model_len: int
    vocab_size: int
    metrics: ServerMetrics
    api_key: str | None = None

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(f"The model `{name}` does not exist.", 404, "model", "model_not_found")

    def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids)
        if not all(0 <= t < self.vocab_size for t in prompt):
            raise bad_request(f"prompt token ids must be in [0, {self.vocab_size})", "prompt")
        return list(prompt)

    def check_length(self, num_prompt: int, max_tokens: int | None, param: str = "prompt") -> None:
        """Rejects what could not run to the requested length, before anything reaches the engine."""
        if num_prompt == 0:
            raise bad_request("the prompt is empty", param)
        room = self.max_model_len - num_prompt
        if room < 1:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                              f"your prompt has {num_prompt} tokens (prompt plus at least one generated token "
                              "must fit).", param)
        if max_tokens is not None and max_tokens > room:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                              f"you requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, "
                              f"{max_tokens} for the completion).", "max_tokens")


async def start_requests(state: ServerState, prompts: list[list[int]], params: SamplingParams,
                         prefix: str) -> list[RequestStream]:
    """Adds one engine request per prompt; all or nothing."""
    streams: list[RequestStream] = []
    ok = False
    try:
        for ids in prompts:
            rid = state.engine.new_request_id(prefix)
            streams.append(await state.engine.add_request(rid, {"prompt_token_ids": ids}, params))
        ok = True
    except EngineDeadError as e:
        raise APIError(str(e), 503) from None
    except ValueError as e:  # the engine's own validation, in case a check above missed something
        raise bad_request(str(e)) from None
    finally:
        if not ok:
            abort_unfinished(state, streams)
    return streams


def abort_unfinished(state: ServerState, streams: list[RequestStream]) -> None:
    for s in streams:
        if not s.finished:
            state.engine.abort(s.request_id)


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(stream index, output) as outputs arrive on any of the streams, until all have finished."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    pending = {asyncio.ensure_future(s.get()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                yield i, task.result()
                if not streams[i].finished:
                    pending[asyncio.ensure_future(streams[i].get())] = i
    finally:
        for task in pending:
            task.cancel()


async def _wait_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


@dataclass
class Sent:
    """What one streamed choice has sent so far (outputs are cumulative; each chunk carries the rest)."""

    text: int = 0
    tokens: int = 0
    done: bool = False


class ClientDisconnected(Exception):
    pass


async def collect(raw: Request, state: ServerState, streams: list[RequestStream]) -> list[RequestOutput]:
    """Final outputs of all streams. A non-streaming handler is not cancelled when its client leaves, so a
    watcher listens for the disconnect and aborts the requests at once (their blocks go back to the pool)."""
    finals: list[RequestOutput | None] = [None] * len(streams)

    async def consume() -> None:
        async for i, out in merge(streams):
            finals[i] = out

    task = asyncio.ensure_future(consume())
    watcher = asyncio.ensure_future(_wait_disconnect(raw))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            raise ClientDisconnected()
        try:
            task.result()
        except EngineDeadError as e:
            raise APIError(str(e), 503) from None
        except EngineError as e:
            raise APIError(f"the engine failed this request: {e}", 500) from None
        return [f for f in finals if f is not None]
    finally:
        task.cancel()
        watcher.cancel()
        abort_unfinished(state, streams)


def sse(obj: BaseModel | dict) -> str:
    data = obj.model_dump_json() if isinstance(obj, BaseModel) else json.dumps(obj)
    return f"data: {data}\n\n"


SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def error_event(exc: BaseException) -> str:
    """Once a stream has started the status code is sent; a failure is reported as an error event."""
    if isinstance(exc, APIError):
        return sse(exc.body())
    if isinstance(exc, EngineDeadError):
        return sse(APIError(str(exc), 503).body())
    return sse(APIError(f"the engine failed this request: {exc}", 500).body())
