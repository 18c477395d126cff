"""Request body of OpenAI's Responses API (POST /v1/responses) and its conversion into the OpenAI-style
conversation that conversation.py renders.

Input items are read by hand (not a pydantic union) so that an unsupported item names itself in the error.
Unknown fields are ignored, as elsewhere in this server.
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

_TEXT_PARTS = ("input_text", "output_text", "text")


class Reasoning(Body):
    effort: str | None = None
    summary: str | None = None

    @property
    def on(self) -> bool:
        return self.effort != "none"


class ResponsesRequest(Body):
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True  # as OpenAI's default; kept only when the server has a response store
    previous_response_id: str | None = None
    reasoning: Reasoning | None = None
    metadata: dict[str, str] | None = None
    text: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: str | None = None

    def check_supported(self) -> None:
        if self.text is not None and not isinstance(self.text.get("format") or {}, dict):
            raise bad_request("text.format must be an object", "text.format")

    def output_constraint(self) -> StructuredOutputsParams | None:
        """text.format as a constraint: json_object, or json_schema (its `strict`, on unless false, decides
        whether properties the schema does not name may appear); 400 when malformed or uncompilable."""
        fmt = (self.text or {}).get("format") or {}
        kind = fmt.get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind == "json_schema":
            if not isinstance(fmt.get("name"), str) or not fmt["name"]:
                raise bad_request("text.format.name is required for a json_schema format", "text.format.name")
            return schema_constraint(fmt.get("schema"), fmt.get("strict") is not False, "text.format.schema")
        raise bad_request(f"unsupported text.format type {kind!r}: use text, json_object or json_schema",
                          "text.format.type")

    def conversation(self) -> list[dict]:
        """This request's input as OpenAI chat messages (without the instructions, which do not carry over
        to a follow-up response)."""
        items = [{"role": "user", "content": self.input}] if isinstance(self.input, str) else self.input
        return convert_items(items)

    def openai_tools(self) -> list[dict] | None:
        """Function tools in the chat-template shape; None with tool_choice "none"."""
        if not self.tools or self.tool_choice == "none":
            return None
        out = []
        for i, t in enumerate(self.tools):
            if t.get("type") != "function" or not isinstance(t.get("name"), str):
                raise bad_request(f"tool type {t.get('type')!r} is not supported: only function tools are",
                                  f"tools.{i}.type")
            out.append({"type": "function", "function": {
                "name": t["name"], "description": t.get("description") or "",
                "parameters": t.get("parameters") or {"type": "object", "properties": {}}}})
        forced = self.forced_tool()
        if forced not in (None, "any") and forced not in [t["function"]["name"] for t in out]:
            raise bad_request(f"tool_choice names {forced!r}, which is not among the tools", "tool_choice")
        return out

    def forced_tool(self) -> str | None:
        """"any" (tool_choice "required"), a function's name, or None (the model decides)."""
        c = self.tool_choice
        if not self.tools or c in (None, "auto", "none"):
            return None
        if c == "required":
            return "any"
        if isinstance(c, dict) and c.get("type") == "function" and isinstance(c.get("name"), str):
            return c["name"]
        raise bad_request(f"unsupported tool_choice {c!r}", "tool_choice")

    def template_kwargs(self) -> dict[str, Any]:
        return {} if self.reasoning is None else {"enable_thinking": self.reasoning.on}

    def sampling_params(self, max_tokens: int | None, defaults: dict[str, Any], vocab_size: int,
                        constraint: StructuredOutputsParams | None = None) -> SamplingParams:
        return checked_params(vocab_size, {"max_tokens": "max_output_tokens"},
                              **model_defaults(defaults, temperature=self.temperature, top_p=self.top_p, top_k=None),
                              max_tokens=max_tokens, structured_outputs=constraint)


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where}: content must be a string or a list of parts", where)
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            what = "this model takes text only" if kind in ("input_image", "input_file", "input_audio") else \
                "only text parts are supported"
            raise bad_request(f"{where}.{k}: a part of type {kind!r} is not supported ({what})", f"{where}.{k}")
        texts.append(part["text"])
    return "\n".join(texts)


def convert_items(items: list[dict[str, Any]]) -> list[dict]:
    """Messages, function calls and their outputs, and reasoning items as chat messages. Consecutive
    function calls join the assistant turn before them; a reasoning item goes with the next assistant turn."""
    out: list[dict] = []
    reasoning: list[str] = []
    for i, item in enumerate(items):
        where = f"input.{i}"
        if not isinstance(item, dict):
            raise bad_request(f"{where}: an input item must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request(f"{where}.role: unsupported role {role!r}", f"{where}.role")
            msg: dict[str, Any] = {"role": "system" if role == "developer" else role,
                                   "content": _text(item.get("content", ""), f"{where}.content")}
            if role == "assistant" and reasoning:
                msg["reasoning_content"] = "\n".join(reasoning)
                reasoning = []
            out.append(msg)
        elif kind == "function_call":
            try:
                args = json.loads(item.get("arguments") or "{}")
            except (TypeError, json.JSONDecodeError):
                raise bad_request(f"{where}.arguments: not valid JSON", f"{where}.arguments") from None
            call = {"id": str(item.get("call_id", "")), "type": "function",
                    "function": {"name": str(item.get("name", "")), "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            if reasoning:
                out[-1]["reasoning_content"] = "\n".join(reasoning)
                reasoning = []
        elif kind == "function_call_output":
            output = item.get("output", "")
            out.append({"role": "tool", "tool_call_id": str(item.get("call_id", "")),
                        "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
        elif kind == "reasoning":
            parts = item.get("content") or item.get("summary") or []
            reasoning += [p.get("text", "") for p in parts if isinstance(p, dict)]
        else:
            raise bad_request(f"{where}: input items of type {kind!r} are not supported", f"{where}.type")
    return out
