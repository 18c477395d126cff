"""Response bodies of the OpenAI-compatible API, and the conversion of engine logprobs into their shapes."""
from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, model_serializer

from lamina.outputs import Logprob, PositionLogprobs


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
        # As in OpenAI's API: prompt tokens served from the prefix cache.
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens))


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's extensions: present (null unless asked for), as vLLM sends them
    prompt_logprobs: list[dict[str, dict] | None] | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobToken] | None = None


_OPTIONAL = ("tool_calls", "reasoning", "reasoning_content")


def _without_unset(data: dict[str, Any]) -> dict[str, Any]:
    # Optional parts appear only when present, as in OpenAI's bodies (content stays, even when null).
    for k in _OPTIONAL:
        if data.get(k) is None:
            data.pop(k, None)
    return data


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # Tool calls ({"id", "type": "function", "function": {"name", "arguments"}}) and the reasoning split off
    # by a reasoning parser, under vLLM's name and DeepSeek's.
    tool_calls: list[dict[str, Any]] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return _without_unset(handler(self))


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM: return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, dict] | None] | None = None  # vLLM's extensions
    prompt_token_ids: list[int] | None = None


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's streamed shape (chat_tools.stream_tool_calls)

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler):
        return _without_unset(handler(self))


class ChatStreamChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM: return_token_ids (this chunk's)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # vLLM: return_token_ids (first chunk)


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "lamina"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---- logprobs ------------------------------------------------------------------------------------
def _chosen(pos: PositionLogprobs, token_id: int) -> Logprob:
    return pos[token_id]


def _top(pos: PositionLogprobs, n: int) -> list[tuple[int, Logprob]]:
    """The n best entries of a position, best first (the chosen token is listed only if it is among them)."""
    ranked = [(tid, lp) for tid, lp in pos.items() if lp.rank is not None and lp.rank <= n]
    return sorted(ranked, key=lambda x: x[1].rank)


def _tok(lp: Logprob, token_id: int | None = None) -> str:
    """The token's text; with token_id (return_tokens_as_token_ids), vLLM's "token_id:N" instead."""
    if token_id is not None:
        return f"token_id:{token_id}"
    return lp.decoded_token if lp.decoded_token is not None else ""


def completion_logprobs(token_ids: list[int], positions: list[PositionLogprobs], num: int,
                        start_offset: int, as_ids: bool = False) -> CompletionLogprobs:
    """Legacy completions shape; text_offset counts from start_offset (the text already sent)."""
    out = CompletionLogprobs()
    offset = start_offset
    for tid, pos in zip(token_ids, positions):
        chosen = _chosen(pos, tid)
        token = _tok(chosen, tid if as_ids else None)
        out.tokens.append(token)
        out.token_logprobs.append(chosen.logprob)
        out.text_offset.append(offset)
        offset += len(token)
        top = {_tok(lp, t if as_ids else None): lp.logprob for t, lp in _top(pos, num)}
        top.setdefault(token, chosen.logprob)  # vLLM lists the sampled token too
        out.top_logprobs.append(top)
    return out


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], num: int,
                  as_ids: bool = False) -> ChatLogprobs:
    content = []
    for tid, pos in zip(token_ids, positions):
        chosen = _chosen(pos, tid)
        token = _tok(chosen, tid if as_ids else None)
        top = [TopLogprob(token=_tok(lp, t if as_ids else None), logprob=lp.logprob,
                          bytes=list(_tok(lp, t if as_ids else None).encode())) for t, lp in _top(pos, num)]
        content.append(ChatLogprobToken(token=token, logprob=chosen.logprob, bytes=list(token.encode()),
                                        top_logprobs=top))
    return ChatLogprobs(content=content)
