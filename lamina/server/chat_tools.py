"""What a chat request's tools, tool_choice, response_format and reasoning settings mean for its prompt,
its output constraint and how its output is read (OutputParsing)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lamina.server.errors import bad_request
from lamina.server.output_parsing import OutputParsing
from lamina.server.protocol import ChatCompletionRequest, check_constraint
from lamina.server.reasoning import get_reasoning_parser
from lamina.server.tools import (
    NamedToolParser,
    RequiredToolParser,
    ToolParser,
    get_parser,
    named_schema,
    required_schema,
)
from lamina.structured.params import StructuredOutputsParams


@dataclass
class ChatPlan:
    tools: list[dict[str, Any]] | None  # what the template renders
    constraint: StructuredOutputsParams | None
    parsing: OutputParsing
    forced_name: str | None = None  # tool_choice named a function: finish_reason stays "stop" (as OpenAI)
    keep_special_tokens: bool = False
    reasoning_parser: str | None = None

    def set_prompt(self, prompt_tail: str) -> None:
        """Builds the reasoning parser for the rendered prompt (whether its template opened a think block)."""
        if self.reasoning_parser:
            self.parsing.reasoning = get_reasoning_parser(self.reasoning_parser)(prompt_tail)


def _check_tools(tools: list[dict[str, Any]]) -> None:
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request("each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}", "tools")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tool {fn['name']!r}: parameters must be a JSON schema object", "tools")


def _tool_parsing(req: ChatCompletionRequest, tool_call_parser: str | None, auto_enabled: bool
                  ) -> tuple[ToolParser | None, StructuredOutputsParams | None, str | None]:
    tools, choice = req.tools or None, req.tool_choice
    if tools is None:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None, None, None
    _check_tools(tools)
    choice = "auto" if choice is None else choice
    if choice == "none":
        return None, None, None
    if choice == "auto":
        if not (auto_enabled and tool_call_parser):
            raise bad_request('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                              "set", "tool_choice")
        return get_parser(tool_call_parser)(tools), None, None
    if choice == "required":
        schema = required_schema(tools, req.parallel_tool_calls)
        return RequiredToolParser(tools), StructuredOutputsParams(json=schema), None
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        schema = named_schema(tools, name)
        if schema is None:
            raise bad_request(f"tool_choice names function {name!r}, which is not among the tools", "tool_choice")
        return NamedToolParser(tools, name), StructuredOutputsParams(json=schema), name
    raise bad_request("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": "
                      "{\"name\": ...}}", "tool_choice")


def plan_chat(req: ChatCompletionRequest, tool_call_parser: str | None, auto_enabled: bool,
              reasoning_parser: str | None) -> ChatPlan:
    """The plan of one chat request; 400 for contradictory or malformed settings. Call set_prompt() with
    the rendered prompt's end once it is known."""
    parser, tool_constraint, forced = _tool_parsing(req, tool_call_parser, auto_enabled)
    check_constraint(tool_constraint, "tools")  # a tool's parameters schema xgrammar cannot read
    constraints = [c for c in (tool_constraint, req.output_constraint()) if c is not None]
    if len(constraints) > 1:
        raise bad_request("a request may have one output constraint: a forced tool_choice, response_format or "
                          "structured_outputs", "response_format")
    return ChatPlan(req.tools or None, constraints[0] if constraints else None, OutputParsing(None, parser),
                    forced, bool(parser is not None and parser.needs_special_tokens), reasoning_parser)


def tool_call_dict(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def stream_tool_calls(deltas) -> list[dict[str, Any]] | None:
    """OpenAI's streamed tool-call shape: index, id, type and name first (empty arguments), then only index
    and argument fragments."""
    out = []
    for d in deltas:
        if d.id is not None:
            out.append({"index": d.index, "id": d.id, "type": "function",
                        "function": {"name": d.name, "arguments": d.arguments}})
        else:
            out.append({"index": d.index, "function": {"arguments": d.arguments}})
    return out or None
