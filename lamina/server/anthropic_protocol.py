"""Request bodies of Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) and their
conversion into the OpenAI-style conversation (conversation.py) and SamplingParams.

Content blocks are read by hand rather than through a pydantic union, so that an unsupported block gets an
error naming it (an image: this server serves text-only models) instead of one line per union branch.
Unknown fields are ignored (cache_control, service_tier, ...), as Anthropic-compatible servers do.
"""
from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field

from lamina.sampling_params import SamplingParams
from lamina.server.agent_plan import schema_constraint
from lamina.server.errors import bad_request
from lamina.server.request_common import Body, checked_params, model_defaults
from lamina.structured.params import StructuredOutputsParams


class AnthropicMessage(Body):
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]


class AnthropicTool(Body):
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    type: str | None = None  # "custom" or absent; Anthropic's server tools (web_search, ...) are refused


class ToolChoice(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(Body):
    type: Literal["enabled", "adaptive", "between_tools", "disabled"]
    budget_tokens: int | None = Field(None, ge=1)  # not enforced: the model ends its thinking itself
    display: Literal["summarized", "omitted"] | None = None

    @property
    def on(self) -> bool:
        return self.type != "disabled"


class OutputConfig(Body):
    effort: str | None = None  # no effect here
    format: dict[str, Any] | None = None


class Metadata(Body):
    user_id: str | None = None


class CountTokensRequest(Body):
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    output_format: dict[str, Any] | None = None  # the structured-outputs beta's place for output_config.format

    def conversation(self) -> list[dict]:
        """OpenAI-style messages: the system turn, then each message (tool results become `tool` turns)."""
        out: list[dict] = []
        if self.system:
            out.append({"role": "system", "content": _system_text(self.system)})
        for i, m in enumerate(self.messages):
            out += _convert(m, f"messages.{i}.content")
        return out

    def openai_tools(self) -> list[dict] | None:
        """Function tools in the shape chat templates take; None when tool_choice is "none" (the model is
        not told about tools it may not use)."""
        if not self.tools or (self.tool_choice is not None and self.tool_choice.type == "none"):
            return None
        for i, t in enumerate(self.tools):
            if t.type not in (None, "custom"):
                raise bad_request(f"tool type {t.type!r} is not supported: only custom (client) tools are",
                                  f"tools.{i}.type")
        names = [t.name for t in self.tools]
        if self.tool_choice is not None and self.tool_choice.type == "tool" and self.tool_choice.name not in names:
            raise bad_request(f"tool_choice names {self.tool_choice.name!r}, which is not among the tools",
                              "tool_choice.name")
        return [{"type": "function", "function": {"name": t.name, "description": t.description or "",
                                                  "parameters": t.input_schema}} for t in self.tools]

    def forced_tool(self) -> str | None:
        """"any", a tool's name, or None (the model decides)."""
        c = self.tool_choice
        if c is None or c.type in ("auto", "none") or not self.tools:
            return None
        return "any" if c.type == "any" else c.name

    def template_kwargs(self) -> dict[str, Any]:
        # Reasoning templates (Qwen3 and others) switch their thinking block on this variable.
        return {} if self.thinking is None else {"enable_thinking": self.thinking.on}

    def check_supported(self) -> None:
        if self.forced_tool() is not None and self.thinking is not None and self.thinking.on:
            # As Anthropic's API: a forced tool call leaves no room for thinking first.
            raise bad_request("thinking may not be enabled when tool_choice forces tool use (use tool_choice "
                              "auto or none)", "tool_choice")

    def output_constraint(self) -> StructuredOutputsParams | None:
        """output_config.format (or the beta's output_format) as a JSON-schema constraint; 400 when malformed
        or when the schema cannot be compiled."""
        fmt, param = self.output_format, "output_format"
        if self.output_config is not None and self.output_config.format is not None:
            if fmt is not None:
                raise bad_request("give output_config.format or output_format, not both", "output_format")
            fmt, param = self.output_config.format, "output_config.format"
        if fmt is None:
            return None
        if fmt.get("type") != "json_schema":
            raise bad_request(f"{param}.type must be 'json_schema', got {fmt.get('type')!r}", f"{param}.type")
        return schema_constraint(fmt.get("schema"), True, f"{param}.schema")


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1)
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    stream: bool = False
    metadata: Metadata | None = None

    def sampling_params(self, defaults: dict[str, Any], vocab_size: int,
                        constraint: StructuredOutputsParams | None = None) -> SamplingParams:
        return checked_params(vocab_size, {"stop": "stop_sequences"},
                              **model_defaults(defaults, temperature=self.temperature, top_p=self.top_p,
                                               top_k=self.top_k),
                              stop=list(self.stop_sequences or []), max_tokens=self.max_tokens,
                              structured_outputs=constraint)


def _system_text(system: str | list[dict[str, Any]]) -> str:
    if isinstance(system, str):
        return system
    return "\n".join(_text_of(b, f"system.{i}") for i, b in enumerate(system))


def _text_of(block: dict[str, Any], where: str) -> str:
    kind = block.get("type")
    if kind != "text" or not isinstance(block.get("text"), str):
        raise bad_request(f"{where}: expected a text block, got {_what(block)}", where)
    return block["text"]


def _what(block: Any) -> str:
    if not isinstance(block, dict):
        return type(block).__name__
    kind = block.get("type")
    if kind in ("image", "document"):
        return f"an {kind} block (this model takes text only)" if kind == "image" else \
            "a document block (this model takes text only)"
    return f"a block of type {kind!r}"


def _convert(m: AnthropicMessage, where: str) -> list[dict]:
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    texts: list[str] = []
    reasoning: list[str] = []
    calls: list[dict] = []
    results: list[dict] = []
    for j, b in enumerate(m.content):
        at = f"{where}.{j}"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            texts.append(_text_of(b, at))
        elif kind == "tool_use" and m.role == "assistant":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                raise bad_request(f"{at}: a tool_use block needs a name and an input object", at)
            calls.append({"id": str(b.get("id", "")), "type": "function",
                          "function": {"name": b["name"], "arguments": b.get("input", {})}})
        elif kind == "tool_result" and m.role == "user":
            results.append({"role": "tool", "tool_call_id": str(b.get("tool_use_id", "")),
                            "content": _result_text(b, at)})
        elif kind == "thinking" and m.role == "assistant":
            reasoning.append(str(b.get("thinking", "")))
        elif kind == "redacted_thinking" and m.role == "assistant":
            continue  # opaque to this server: nothing to render
        else:
            raise bad_request(f"{at}: {_what(b)} is not supported in a {m.role} message", at)
    out = list(results)
    if texts or calls or reasoning or not results:
        msg: dict[str, Any] = {"role": m.role, "content": "\n".join(texts)}
        if calls:
            msg["tool_calls"] = calls
        if reasoning:
            msg["reasoning_content"] = "\n".join(reasoning)
        out.append(msg)
    return out


def _result_text(block: dict[str, Any], where: str) -> str:
    content = block.get("content", "")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        text = "\n".join(_text_of(b, f"{where}.content.{k}") for k, b in enumerate(content))
    else:
        text = json.dumps(content)
    return f"Error: {text}" if block.get("is_error") else text
