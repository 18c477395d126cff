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
from lamina.server.errors import bad_request
from lamina.server.protocol import CompletionRequest
from lamina.server.responses import CompletionChoice, CompletionResponse, Usage, completion_logprobs
from lamina.server.serving import (
    SSE_DONE,
    SSE_HEADERS,
    ClientDisconnected,
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


async def create_completion(req: CompletionRequest, raw: Request, state: ServerState) -> Response:
    state.check_model(req.model)
    req.check_supported()
    if req.echo and req.logprobs is not None:
        raise bad_request("echo together with logprobs is not supported", "echo")
    prompts = req.prompts()
    check_num_seqs(len(prompts), req.n)
    if req.echo:
        state.need_tokenizer("echo")
    prompt_ids = [state.encode(p) for p in prompts]
    for ids in prompt_ids:
        state.check_max_tokens(len(ids), req.max_tokens)
    # Unset: the model's default or OpenAI's 16, shortened by the engine to what fits.
    max_tokens = req.max_tokens if req.max_tokens is not None else state.sampling_defaults.get("max_tokens", 16)
    params = req.sampling_params(max_tokens, req.logprobs, state.sampling_defaults, state.vocab_size)
    request_id = f"cmpl-{uuid.uuid4().hex}"
    try:  # the engine checks the prompts (length, token ids): its ValueError is a 400 on "prompt"
        streams = await start_requests(state, raw, prompt_ids, params, request_id)
    except ClientDisconnected:
        return Response(status_code=499)
    echoes = [state.tokenizer.decode(ids) if req.echo else "" for ids in prompt_ids]
    if req.stream:
        return StreamingResponse(_stream(req, state, streams, request_id, prompt_ids, echoes),
                                 media_type="text/event-stream", headers=SSE_HEADERS,
                                 background=BackgroundTask(abort_unfinished, state, streams))
    try:
        finals = await collect(raw, state, streams)
    except ClientDisconnected:
        return Response(status_code=499)
    choices = []
    completion_tokens = 0
    for i, out in enumerate(finals):
        for comp in out.outputs:
            completion_tokens += len(comp.token_ids)
            lp = None
            if req.logprobs is not None and comp.logprobs is not None:
                lp = completion_logprobs(comp.token_ids, comp.logprobs, req.logprobs, 0)
            choices.append(CompletionChoice(index=i * req.n + comp.index, text=echoes[i] + comp.text, logprobs=lp,
                                            finish_reason=comp.finish_reason, stop_reason=comp.stop_reason))
    usage = Usage.of(sum(len(ids) for ids in prompt_ids), completion_tokens,
                     sum(out.num_cached_tokens for out in finals))
    body = CompletionResponse(id=request_id, model=state.model_name, choices=choices, usage=usage)
    return JSONResponse(body.model_dump())


def _delta(req: CompletionRequest, index: int, comp: CompletionOutput, sent: Sent, prefix: str
           ) -> CompletionChoice | None:
    n_tok = len(comp.token_ids)
    text = prefix + comp.text[sent.text:]
    lp = None
    if req.logprobs is not None and comp.logprobs is not None and n_tok > sent.tokens:
        # Bound by the token count: the engine thread may already have appended the next position.
        lp = completion_logprobs(comp.token_ids[sent.tokens:], comp.logprobs[sent.tokens:n_tok], req.logprobs,
                                 sent.text)
    finish = comp.finish_reason
    if not text and lp is None and finish is None:
        return None
    sent.text, sent.tokens, sent.done = len(comp.text), n_tok, finish is not None
    return CompletionChoice(index=index, text=text, logprobs=lp, finish_reason=finish, stop_reason=comp.stop_reason)


async def _stream(req: CompletionRequest, state: ServerState, streams, request_id: str,
                  prompt_ids: list[list[int]], echoes: list[str]):
    created = int(time.time())
    sent: dict[int, Sent] = {}
    finals: dict[int, RequestOutput] = {}
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
                choice = _delta(req, index, comp, s, echoes[i] if first else "")
                if choice is not None:
                    choices.append(choice)
            if choices:
                yield sse(CompletionResponse(id=request_id, created=created, model=state.model_name,
                                             choices=choices))
        if req.include_usage:
            usage = Usage.of(sum(len(ids) for ids in prompt_ids),
                             sum(len(c.token_ids) for o in finals.values() for c in o.outputs),
                             sum(o.num_cached_tokens for o in finals.values()))
            yield sse(CompletionResponse(id=request_id, created=created, model=state.model_name, choices=[],
                                         usage=usage))
    except Exception as exc:  # headers are out: report in-band, then end the stream cleanly
        yield error_event(exc)
    finally:
        abort_unfinished(state, streams)
    yield SSE_DONE
