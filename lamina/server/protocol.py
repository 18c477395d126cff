"""Request bodies of the OpenAI-compatible API (plus vLLM's sampling extras), and their SamplingParams.

Unknown fields are ignored, as vLLM and most OpenAI-compatible servers do; wrong types and out-of-range
values are rejected (400) by pydantic here or by SamplingParams.validate.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from lamina.sampling_params import MAX_LOGPROBS, SamplingParams
from lamina.server.errors import bad_request


class _Body(BaseModel):
    # NaN/inf would slip past range checks written as comparisons, so refuse them at parse time.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk (with include_usage)


class _Sampling(_Body):
    """Fields shared by /v1/completions and /v1/chat/completions."""
    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    return_token_ids: bool = False  # prompt and output token ids in the response
    return_tokens_as_token_ids: bool = False  # logprob tokens spelled "token_id:N"
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # keep the last N (-1: max_model_len)

    def check_supported(self) -> None:
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", "stream_options")
        if self.truncate_prompt_tokens == 0:
            raise bad_request("truncate_prompt_tokens must be -1 or >= 1", "truncate_prompt_tokens")

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, defaults: dict[str, Any] | None = None,
                        vocab_size: int | None = None) -> SamplingParams:
        """The request's settings; a field it leaves unset takes the model's default (generation config),
        else OpenAI's. Checked against the vocabulary when vocab_size is given (400 naming the field)."""
        d = defaults or {}

        def pick(value: Any, name: str, fallback: Any) -> Any:
            return value if value is not None else d.get(name, fallback)

        try:
            params = SamplingParams(
                n=self.n, temperature=pick(self.temperature, "temperature", 1.0),
                top_p=pick(self.top_p, "top_p", 1.0), top_k=pick(self.top_k, "top_k", 0),
                min_p=pick(self.min_p, "min_p", 0.0),
                repetition_penalty=pick(self.repetition_penalty, "repetition_penalty", 1.0),
                presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, seed=self.seed,
                stop=self.stop, stop_token_ids=self.stop_token_ids or [], max_tokens=max_tokens,
                min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, logprobs=logprobs,
                skip_special_tokens=self.skip_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output, prompt_logprobs=self.prompt_logprobs)
            params.validate(vocab_size)
        except (ValueError, TypeError) as e:
            raise bad_request(str(e), getattr(e, "param", None)) from None
        return params


Prompt = list[int] | list[list[int]] | str | list[str]


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: int | None = Field(None, ge=1)  # unset: the model's default, else 16 (OpenAI's)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of different from n is not supported", "best_of")

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of single prompts (text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            out: list[str | list[int]] = [p]
        elif not p:
            raise bad_request("prompt must not be empty", "prompt")
        elif isinstance(p[0], int):
            out = [p]  # one prompt given as token ids
        else:
            out = list(p)
        if any(len(x) == 0 for x in out):
            raise bad_request("prompt must not be empty", "prompt")
        return out


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: str  # any role: the chat template renders it or refuses it (a 400 naming the template's reason)
    content: str | list[TextPart | dict[str, Any]] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if not isinstance(part, TextPart):
                raise bad_request(f"unsupported content part {part.get('type')!r}: only text is supported",
                                  "messages")
            parts.append(part.text)
        return "\n".join(parts)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # the last (assistant) message is continued, not closed
    echo: bool = False  # the reply starts with the last message's content when that is the assistant's

    def check_supported(self) -> None:
        super().check_supported()
        check_continue(self.add_generation_prompt, self.continue_final_message, self.messages)
        if self.tools:
            raise bad_request("tools are not supported", "tools")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise bad_request("only response_format type 'text' is supported", "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, str]]:
        return [{"role": m.role, "content": m.text()} for m in self.messages]


def check_continue(add_generation_prompt: bool, continue_final_message: bool, messages: list[ChatMessage] | None
                   ) -> None:
    if not continue_final_message:
        return
    if add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true (set "
                          "add_generation_prompt to false)", "continue_final_message")
    if messages and messages[-1].role != "assistant":
        raise bad_request("continue_final_message needs the last message to be the assistant's",
                          "continue_final_message")


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
