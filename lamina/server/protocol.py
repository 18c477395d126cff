"""Request bodies of the OpenAI-compatible API (plus vLLM's sampling extras), and their SamplingParams.

Unknown fields are ignored, as vLLM and most OpenAI-compatible servers do; wrong types and out-of-range
values are rejected (400) by pydantic here or by SamplingParams.validate.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from lamina.sampling_params import MAX_LOGPROBS, SamplingParams
from lamina.server.errors import bad_request
from lamina.server.request_common import Body, checked_params, model_defaults
from lamina.structured.params import StructuredOutputsError, StructuredOutputsParams

# vLLM's older per-kind fields (before `structured_outputs`), still sent by many clients.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk (with include_usage)


def check_constraint(spec: StructuredOutputsParams | None, param: str) -> None:
    """A 400 naming `param` for a schema, regex or grammar xgrammar cannot read (checked here too, not only
    in the engine core, so the error names the field and the request never travels)."""
    if spec is None:
        return
    from lamina.structured.compiler import build_grammar

    try:
        build_grammar(spec)
    except StructuredOutputsError as e:
        raise bad_request(str(e), param) from None


class _Sampling(Body):
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
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    response_format: dict[str, Any] | None = None

    def output_constraint(self) -> StructuredOutputsParams | None:
        """The request's structured-output constraint: response_format, `structured_outputs` or the older
        guided_* fields (at most one of them); 400 if malformed. Chat's forced tool choices come on top."""
        guided = {kind: getattr(self, f) for f, kind in _GUIDED.items() if getattr(self, f) is not None}
        if self.structured_outputs is not None and guided:
            raise bad_request("give either structured_outputs or the guided_* fields, not both", "structured_outputs")
        value = self.structured_outputs if self.structured_outputs is not None else (guided or None)
        try:
            spec = StructuredOutputsParams.from_value(value)
        except StructuredOutputsError as e:
            raise bad_request(str(e), "structured_outputs") from None
        response = self.response_constraint()
        if spec is not None and response is not None:
            raise bad_request("give either response_format or structured_outputs, not both", "response_format")
        check_constraint(spec, "structured_outputs")
        check_constraint(response, "response_format")
        return spec or response

    def response_constraint(self) -> StructuredOutputsParams | None:
        """response_format as a constraint: json_object, or json_schema (its `strict` decides whether
        properties the schema does not name may appear)."""
        rf = self.response_format
        if not rf or rf.get("type", "text") == "text":
            return None
        kind = rf.get("type")
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind == "json_schema":
            spec = rf.get("json_schema")
            if not isinstance(spec, dict):
                raise bad_request("response_format json_schema needs a json_schema object", "response_format")
            schema = spec.get("schema", spec.get("json_schema"))
            if not isinstance(schema, dict):
                raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                                  "response_format")
            return StructuredOutputsParams(json=schema, strict=bool(spec.get("strict", True)))
        raise bad_request(f"unsupported response_format type {kind!r}: use text, json_object or json_schema",
                          "response_format")

    def check_supported(self) -> None:
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
                        vocab_size: int | None = None,
                        constraint: StructuredOutputsParams | None = None) -> SamplingParams:
        """The request's settings; a field it leaves unset takes the model's default (generation config),
        else OpenAI's. Checked against the vocabulary when vocab_size is given (400 naming the field).
        constraint: the structured-output constraint (default: output_constraint())."""
        if constraint is None:
            constraint = self.output_constraint()
        return checked_params(
            vocab_size, n=self.n,
            **model_defaults(defaults, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                             min_p=self.min_p, repetition_penalty=self.repetition_penalty),
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty, seed=self.seed,
            stop=self.stop, stop_token_ids=self.stop_token_ids or [], max_tokens=max_tokens,
            min_tokens=self.min_tokens, ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words, structured_outputs=constraint,
            prompt_logprobs=self.prompt_logprobs)


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


class TextPart(Body):
    type: Literal["text"]
    text: str


class ChatMessage(Body):
    role: str  # any role: the chat template renders it or refuses it (a 400 naming the template's reason)
    content: str | list[TextPart | dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    reasoning: str | None = None  # an assistant turn's reasoning (vLLM's name)
    reasoning_content: str | None = None  # the same, by DeepSeek's name

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it: arguments of calls as objects (HF templates render
        them with tojson), the call id on tool turns."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:
            out["reasoning_content"] = out["reasoning"] = reasoning
        return out

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


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    fn = dict(call.get("function") or {})
    if not isinstance(fn.get("name"), str):
        raise bad_request("each tool call needs function.name", "messages")
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args) if args.strip() else {}
        except ValueError:
            raise bad_request(f"tool call arguments are not JSON: {args[:80]!r}", "messages") from None
    return {**call, "type": call.get("type", "function"), "function": fn}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False  # the last (assistant) message is continued, not closed
    echo: bool = False  # the reply starts with the last message's content when that is the assistant's

    def check_supported(self) -> None:
        super().check_supported()
        check_continue(self.add_generation_prompt, self.continue_final_message, self.messages)
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs to be true", "top_logprobs")

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        return [m.template_dict() for m in self.messages]


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


class TokenizeRequest(Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(Body):
    model: str | None = None
    tokens: list[int]
