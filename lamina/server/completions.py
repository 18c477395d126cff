"""POST /v1/completions: one engine request per prompt (each with n samples), streamed as SSE or not.

Choice i * n + j is sample j of prompt i, as in OpenAI's API.
"""
from __future__ import annotations

import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from lamina.outputs import CompletionOutput, RequestOutput
from lamina.server.extensions import (
    echo_logprobs,
    join_logprobs,
    prompt_logprobs_json,
    truncate,
    usage,
)
from lamina.server.protocol import CompletionRequest
from lamina.server.responses import CompletionChoice, CompletionLogprobs, CompletionResponse, completion_logprobs
from lamina.server.serving import (
    SSE_DONE,
    SSE_HEADERS,
    Sent,
    ServerState,
    abort_unfinished,
    check_num_seqs,
    collect,
    error_event,
    merge,
    sse,
    start_requests,
)
from lamina.server.stream_chunks import ChunkWriter


async def create_completion(req: CompletionRequest, raw: Request, state: ServerState) -> Response:
    state.check_model(req.model)
    req.check_supported()
    prompts = req.prompts()
    check_num_seqs(len(prompts), req.n)
    if req.echo:
        state.need_tokenizer("echo")
    prompt_ids = [truncate(state.encode(p), req.truncate_prompt_tokens, state.max_model_len) for p in prompts]
    for ids in prompt_ids:
        state.check_max_tokens(len(ids), req.max_tokens)
    # Unset: the model's default or OpenAI's 16, shortened by the engine to what fits.
    max_tokens = req.max_tokens if req.max_tokens is not None else state.sampling_defaults.get("max_tokens", 16)
    params = req.sampling_params(max_tokens, req.logprobs, state.sampling_defaults, state.vocab_size)
    if req.echo and req.logprobs is not None:  # the echoed prompt's logprobs come from the prompt pass
        params.prompt_logprobs = max(params.prompt_logprobs or 0, req.logprobs)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    # The engine checks the prompts (length, token ids): its ValueError is a 400 on "prompt".
    streams = await start_requests(state, raw, prompt_ids, params, request_id)
    echoes = [state.tokenizer.decode(ids) if req.echo else "" for ids in prompt_ids]
    if req.stream:
        return StreamingResponse(_stream(req, state, streams, request_id, prompt_ids, echoes),
                                 media_type="text/event-stream", headers=SSE_HEADERS,
                                 background=BackgroundTask(abort_unfinished, state, streams))
    finals = await collect(raw, state, streams)
    choices = []
    completion_tokens = 0
    for i, out in enumerate(finals):
        for comp in out.outputs:
            completion_tokens += len(comp.token_ids)
            lp = None
            if req.logprobs is not None and comp.logprobs is not None:
                lp = completion_logprobs(comp.token_ids, comp.logprobs, req.logprobs, len(echoes[i]),
                                         req.return_tokens_as_token_ids)
            if req.echo and req.logprobs is not None:
                lp = join_logprobs(_echo_lp(req, state, out), lp)
            choices.append(CompletionChoice(index=i * req.n + comp.index, text=echoes[i] + comp.text, logprobs=lp,
                                            finish_reason=comp.finish_reason, stop_reason=comp.stop_reason,
                                            **_extras(req, out, comp, first=True)))
    u = usage(sum(len(ids) for ids in prompt_ids), completion_tokens, sum(out.num_cached_tokens for out in finals),
              state.prompt_tokens_details)
    body = CompletionResponse(id=request_id, model=state.model_name, choices=choices, usage=u)
    return JSONResponse(body.model_dump())


def _echo_lp(req: CompletionRequest, state: ServerState, out: RequestOutput) -> CompletionLogprobs:
    ids = out.prompt_token_ids
    first = state.tokenizer.decode(ids[:1]) if ids else ""
    return echo_logprobs(ids, out.prompt_logprobs or [None] * len(ids), req.logprobs or 0, first,
                         req.return_tokens_as_token_ids)


def _extras(req: CompletionRequest, out: RequestOutput, comp: CompletionOutput, first: bool,
            token_ids: list[int] | None = None) -> dict:
    """vLLM's per-choice extensions; the prompt's parts go with a choice's first chunk only."""
    extra: dict = {}
    if first and req.prompt_logprobs is not None:
        extra["prompt_logprobs"] = prompt_logprobs_json(out.prompt_token_ids, out.prompt_logprobs,
                                                        req.return_tokens_as_token_ids)
    if req.return_token_ids:
        if first:
            extra["prompt_token_ids"] = list(out.prompt_token_ids)
        extra["token_ids"] = list(comp.token_ids) if token_ids is None else token_ids
    return extra


def _delta(req: CompletionRequest, index: int, out: RequestOutput, comp: CompletionOutput, sent: Sent,
           prefix: str, echo_offset: int, echo_lp: CompletionLogprobs | None) -> CompletionChoice | None:
    n_tok = len(comp.token_ids)
    first = prefix != "" or (sent.text == 0 and sent.tokens == 0)
    text = prefix + comp.text[sent.text:]
    lp = None
    if req.logprobs is not None and comp.logprobs is not None and n_tok > sent.tokens:
        # Bound by the token count: the engine thread may already have appended the next position.
        lp = completion_logprobs(comp.token_ids[sent.tokens:], comp.logprobs[sent.tokens:n_tok], req.logprobs,
                                 echo_offset + sent.text, req.return_tokens_as_token_ids)
    if echo_lp is not None:
        lp = join_logprobs(echo_lp, lp)
    finish = comp.finish_reason
    if not text and lp is None and finish is None:
        return None
    new_ids = list(comp.token_ids[sent.tokens:n_tok])
    sent.text, sent.tokens, sent.done = len(comp.text), n_tok, finish is not None
    return CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=finish, stop_reason=comp.stop_reason,
                            **_extras(req, out, comp, first, new_ids))


async def _stream(req: CompletionRequest, state: ServerState, streams, request_id: str,
                  prompt_ids: list[list[int]], echoes: list[str]):
    created = int(time.time())
    sent: dict[int, Sent] = {}
    finals: dict[int, RequestOutput] = {}
    # Plain requests take the pydantic-free chunk writer (stream_chunks.py); the rest build the models.
    plain = (req.logprobs is None and req.prompt_logprobs is None and not req.return_token_ids
             and not req.continuous_usage and not req.echo)
    writer = ChunkWriter("text_completion", request_id, created, state.model_name) if plain else None
    try:
        async for i, out in merge(streams):
            finals[i] = out
            choices = []
            for comp in out.outputs:
                index = i * req.n + comp.index
                first = index not in sent
                s = sent.setdefault(index, Sent())
                if s.done:
                    continue
                if writer is not None:
                    text, finish = comp.text[s.text:], comp.finish_reason
                    if text or finish is not None:
                        s.text, s.tokens, s.done = len(comp.text), len(comp.token_ids), finish is not None
                        yield writer.completion(index, text, finish, comp.stop_reason)
                    continue
                echo_lp = _echo_lp(req, state, out) if first and req.echo and req.logprobs is not None else None
                choice = _delta(req, index, out, comp, s, echoes[i] if first else "", len(echoes[i]), echo_lp)
                if choice is not None:
                    choices.append(choice)
            for choice in choices:  # one choice per chunk, as OpenAI and vLLM send them
                yield sse(CompletionResponse(id=request_id, created=created, model=state.model_name,
                                             choices=[choice], usage=_usage_so_far(req, state, prompt_ids, finals)
                                             if req.continuous_usage else None))
        if req.include_usage:
            yield sse(CompletionResponse(id=request_id, created=created, model=state.model_name, choices=[],
                                         usage=_usage_so_far(req, state, prompt_ids, finals)))
    except Exception as exc:  # headers are out: report in-band, then end the stream cleanly
        yield error_event(exc)
    finally:
        abort_unfinished(state, streams)
    yield SSE_DONE


def _usage_so_far(req: CompletionRequest, state: ServerState, prompt_ids: list[list[int]],
                  finals: dict[int, RequestOutput]):
    return usage(sum(len(ids) for ids in prompt_ids), sum(len(c.token_ids) for o in finals.values() for c in o.outputs),
                 sum(o.num_cached_tokens for o in finals.values()), state.prompt_tokens_details)
