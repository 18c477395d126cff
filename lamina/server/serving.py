"""What the completions and chat endpoints share: server state, input checks, starting requests, merging
their streams, aborting them when the client goes away, and SSE framing."""
from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from pydantic import BaseModel

from lamina.engine.async_engine import AsyncEngine, EngineDeadError, EngineError, RequestStream
from lamina.outputs import RequestOutput
from lamina.sampling_params import SamplingParams
from lamina.server.errors import APIError, ClientDisconnected, bad_request
from lamina.server.metrics import ServerMetrics

# Most sequences (prompts x n) one request may start: a bound on what one client takes from the others.
MAX_SEQS_PER_REQUEST = 256


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Any  # a private copy: HF fast tokenizers must not be shared with the engine thread; None for
    # models without one (random: presets), which take token ids only
    model_names: list[str]
    model_root: str
    max_model_len: int
    vocab_size: int
    metrics: ServerMetrics
    api_key: str | None = None
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # the model's generation config
    # Output parsing (vLLM's --tool-call-parser, --enable-auto-tool-choice, --reasoning-parser)
    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: str | None = None
    prompt_tokens_details: bool = False  # usage.prompt_tokens_details (--enable-prompt-tokens-details)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.model_names:
            raise APIError(f"The model `{name}` does not exist.", 404, "model", "model_not_found")

    def need_tokenizer(self, param: str | None = None) -> Any:
        """The tokenizer, or a 400 saying to send token ids (a model without one)."""
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer: send prompts as token ids (text, chat messages, echo, "
                              "/tokenize and /detokenize need one)", param)
        return self.tokenizer

    def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """Token ids of a prompt; token-id prompts pass as they are (the engine checks them)."""
        if isinstance(prompt, str):
            return list(self.need_tokenizer("prompt")(prompt, add_special_tokens=add_special_tokens).input_ids)
        return list(prompt)

    def check_max_tokens(self, num_prompt: int, max_tokens: int | None) -> None:
        """Refuses a max_tokens that cannot fit after the prompt (the engine would shorten it; the API says
        so instead). Prompt length itself is the engine's check."""
        room = self.max_model_len - num_prompt
        if max_tokens is not None and 0 < room < max_tokens:
            raise bad_request(f"This model's maximum context length is {self.max_model_len} tokens. However, "
                              f"you requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, "
                              f"{max_tokens} for the completion).", "max_tokens")


def check_num_seqs(num_prompts: int, n: int) -> None:
    if num_prompts * n > MAX_SEQS_PER_REQUEST:
        raise bad_request(f"this request asks for {num_prompts} prompts x n={n} = {num_prompts * n} sequences; at "
                          f"most {MAX_SEQS_PER_REQUEST} are allowed per request", "n")


async def start_requests(state: ServerState, raw: Request | None, prompts: list[list[int]], params: SamplingParams,
                         prefix: str, param: str = "prompt") -> list[RequestStream]:
    """Adds one engine request per prompt; all or nothing. The engine validates each (ValueError -> 400 on
    `param`, or on the field a SamplingParams check names); a client that disconnects meanwhile has what was
    added aborted at once (ClientDisconnected)."""
    streams: list[RequestStream] = []
    ok = False

    async def add_all() -> None:
        # Queued together (in order), so the engine takes them in one pass instead of one per step.
        adds = [state.engine.add_request(state.engine.new_request_id(prefix), {"prompt_token_ids": ids}, params)
                for ids in prompts]
        results = await asyncio.gather(*adds, return_exceptions=True)
        streams.extend(r for r in results if isinstance(r, RequestStream))
        for r in results:
            if isinstance(r, BaseException):
                raise r

    adding = asyncio.ensure_future(add_all())
    watcher = asyncio.ensure_future(_wait_disconnect(raw)) if raw is not None and len(prompts) > 1 else None
    try:
        if watcher is not None:
            done, _ = await asyncio.wait({adding, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if adding not in done:
                adding.cancel()
                raise ClientDisconnected()
        await adding
        ok = True
        state.metrics.on_request(params.n, params.max_tokens)  # accepted requests, once whatever their prompts
    except EngineDeadError as e:
        raise APIError(str(e), 503) from None
    except ValueError as e:  # the engine's validation of the prompt and the parameters
        raise bad_request(str(e), getattr(e, "param", None) or param) from None
    finally:
        if watcher is not None:
            watcher.cancel()
        if not ok:
            adding.cancel()
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
