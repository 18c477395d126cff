"""POST /v1/chat/completions: the model's chat template turns the messages (and tools) into one prompt with
n samples; the output is read back as reasoning, content and tool calls (chat_tools.plan_chat)."""
from __future__ import annotations

import dataclasses
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from starlette.background import BackgroundTask

from lamina.llm import chat_prompt_ids
from lamina.outputs import CompletionOutput
from lamina.server.chat_tools import ChatPlan, plan_chat, stream_tool_calls, tool_call_dict
from lamina.server.errors import bad_request
from lamina.server.extensions import prompt_logprobs_json, truncate, usage
from lamina.server.output_parsing import ChoiceStreamer
from lamina.server.protocol import ChatCompletionRequest
from lamina.server.responses import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatMessageOut,
    ChatStreamChoice,
    Delta,
    chat_logprobs,
)
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

PROMPT_TAIL_TOKENS = 16  # enough of the prompt's end to see whether the template opened a think block


def chat_prompt(state: ServerState, messages: list[dict], add_generation_prompt: bool, tools=None,
                template_kwargs=None, continue_final_message: bool = False) -> list[int]:
    try:
        return chat_prompt_ids(state.need_tokenizer("messages"), messages, add_generation_prompt, tools,
                               template_kwargs, continue_final_message)
    except (ValueError, TypeError, KeyError, TemplateError) as e:  # templates raise on roles they reject
        raise bad_request(f"cannot apply the chat template: {e}", "messages") from None


def _finish(plan: ChatPlan, finish: str | None, num_calls: int) -> str | None:
    # OpenAI: "tool_calls" when the model chose to call (auto, required); a named choice stays "stop".
    if finish == "stop" and num_calls and plan.forced_name is None:
        return "tool_calls"
    return finish


async def create_chat_completion(req: ChatCompletionRequest, raw: Request, state: ServerState) -> Response:
    state.check_model(req.model)
    req.check_supported()
    check_num_seqs(1, req.n)
    plan = plan_chat(req, state.tool_call_parser, state.enable_auto_tool_choice, state.reasoning_parser)
    ids = truncate(chat_prompt(state, req.template_messages(), req.add_generation_prompt, plan.tools,
                               req.chat_template_kwargs, req.continue_final_message),
                   req.truncate_prompt_tokens, state.max_model_len)
    if plan.reasoning_parser:
        plan.set_prompt(state.tokenizer.decode(ids[-PROMPT_TAIL_TOKENS:]))
    state.check_max_tokens(len(ids), req.max_output_tokens)
    max_tokens = req.max_output_tokens  # unset: the model's default (shortened to fit) or all the room left
    if max_tokens is None:
        max_tokens = state.sampling_defaults.get("max_tokens")
    params = req.sampling_params(max_tokens, req.num_logprobs, state.sampling_defaults, state.vocab_size,
                                 plan.constraint)
    if plan.keep_special_tokens:  # the tool-call markers are special tokens: keep them for the parser
        params = dataclasses.replace(params, skip_special_tokens=False)
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    streams = await start_requests(state, raw, [ids], params, request_id, param="messages")
    if req.stream:
        return StreamingResponse(_stream(req, plan, state, streams, request_id, ids),
                                 media_type="text/event-stream", headers=SSE_HEADERS,
                                 background=BackgroundTask(abort_unfinished, state, streams))
    (out,) = await collect(raw, state, streams)
    choices = []
    echo = _echo(req)
    for comp in out.outputs:
        lp = None
        if req.logprobs and comp.logprobs is not None:
            lp = chat_logprobs(comp.token_ids, comp.logprobs, req.top_logprobs or 0, req.return_tokens_as_token_ids)
        message, finish = ChatMessageOut(content=echo + comp.text), comp.finish_reason
        if plan.parsing.active:
            p = plan.parsing.parse(comp.text)
            calls = [tool_call_dict(c.id, c.name, c.arguments) for c in p.tool_calls] or None
            content = echo + (p.content or "") if echo else p.content
            message = ChatMessageOut(content=content, reasoning=p.reasoning, reasoning_content=p.reasoning,
                                     tool_calls=calls)
            finish = _finish(plan, finish, len(p.tool_calls))
        choices.append(ChatChoice(index=comp.index, message=message, logprobs=lp, finish_reason=finish,
                                  stop_reason=comp.stop_reason,
                                  token_ids=list(comp.token_ids) if req.return_token_ids else None))
    u = usage(len(ids), sum(len(c.token_ids) for c in out.outputs), out.num_cached_tokens, state.prompt_tokens_details)
    body = ChatCompletionResponse(id=request_id, model=state.model_name, choices=choices, usage=u,
                                  prompt_logprobs=prompt_logprobs_json(ids, out.prompt_logprobs,
                                                                       req.return_tokens_as_token_ids)
                                  if req.prompt_logprobs is not None else None,
                                  prompt_token_ids=list(ids) if req.return_token_ids else None)
    return JSONResponse(body.model_dump())


def _echo(req: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the reply starts with the last message's content when that is the assistant's."""
    last = req.messages[-1]
    return last.text() if req.echo and last.role == "assistant" else ""


def _delta(req: ChatCompletionRequest, plan: ChatPlan, comp: CompletionOutput, sent: Sent,
           streamer: ChoiceStreamer | None) -> ChatStreamChoice | None:
    n_tok = len(comp.token_ids)
    lp = None
    if req.logprobs and comp.logprobs is not None and n_tok > sent.tokens:
        # Bound by the token count: the engine thread may already have appended the next position.
        lp = chat_logprobs(comp.token_ids[sent.tokens:], comp.logprobs[sent.tokens:n_tok], req.top_logprobs or 0,
                           req.return_tokens_as_token_ids)
    finish = comp.finish_reason
    if streamer is None:
        text = comp.text[sent.text:]
        delta, news = Delta(content=text or None), bool(text)
    else:
        d = streamer.feed(comp.text, final=finish is not None)
        delta = Delta(content=d.content or None, reasoning=d.reasoning or None, reasoning_content=d.reasoning or None,
                      tool_calls=stream_tool_calls(d.tool_calls))
        finish, news = _finish(plan, finish, streamer.num_calls), bool(d)
    if not news and lp is None and finish is None:
        return None
    new_ids = list(comp.token_ids[sent.tokens:n_tok])
    sent.text, sent.tokens, sent.done = len(comp.text), n_tok, finish is not None
    return ChatStreamChoice(index=comp.index, delta=delta, logprobs=lp, finish_reason=finish,
                            stop_reason=comp.stop_reason, token_ids=new_ids if req.return_token_ids else None)


async def _stream(req: ChatCompletionRequest, plan: ChatPlan, state: ServerState, streams, request_id: str,
                  prompt_ids: list[int]):
    num_prompt = len(prompt_ids)
    created = int(time.time())

    def chunk(choices: list[ChatStreamChoice], u=None, prompt_ids: list[int] | None = None) -> str:
        return sse(ChatCompletionChunk(id=request_id, created=created, model=state.model_name, choices=choices,
                                       usage=u, prompt_token_ids=prompt_ids))

    def usage_of(out) -> object:
        return usage(num_prompt, sum(len(c.token_ids) for c in out.outputs) if out is not None else 0,
                     out.num_cached_tokens if out is not None else 0, state.prompt_tokens_details)

    sent = {i: Sent() for i in range(req.n)}
    streamers = {i: plan.parsing.streamer() if plan.parsing.active else None for i in range(req.n)}
    final = None
    echo = _echo(req)
    plain = (not plan.parsing.active and not req.logprobs and not req.return_token_ids and not req.continuous_usage)
    writer = ChunkWriter("chat.completion.chunk", request_id, created, state.model_name) if plain else None
    try:
        # OpenAI opens every choice with the role before any content; one choice per chunk, as OpenAI and
        # vLLM send them.
        for i in range(req.n):
            yield chunk([ChatStreamChoice(index=i, delta=Delta(role="assistant", content=echo))],
                        usage_of(None) if req.continuous_usage else None,
                        prompt_ids if req.return_token_ids and i == 0 else None)
        async for _, out in merge(streams):
            final = out
            if writer is not None:  # plain content deltas: the pydantic-free chunk writer (stream_chunks.py)
                for comp in out.outputs:
                    s = sent[comp.index]
                    text, finish = comp.text[s.text:], comp.finish_reason
                    if not s.done and (text or finish is not None):
                        s.text, s.tokens, s.done = len(comp.text), len(comp.token_ids), finish is not None
                        yield writer.chat_content(comp.index, text or None, finish, comp.stop_reason)
                continue
            choices = [c for c in (_delta(req, plan, comp, sent[comp.index], streamers[comp.index])
                                   for comp in out.outputs if not sent[comp.index].done) if c is not None]
            for c in choices:
                yield chunk([c], usage_of(out) if req.continuous_usage else None)
        if req.include_usage and final is not None:
            yield chunk([], usage_of(final))
    except Exception as exc:  # headers are out: report in-band, then end the stream cleanly
        yield error_event(exc)
    finally:
        abort_unfinished(state, streams)
    yield SSE_DONE
