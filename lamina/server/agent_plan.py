"""What a Messages or Responses request's tools, tool choice and output format mean for its generation: the
structured-output constraint and the parser that reads a forced call back.

Forced calls take the formats of chat completions' forced choices (chat_tools.plan_chat), whatever the
model's own tool format: a call of some tool (Anthropic's {"type": "any"}, OpenAI's "required") is a JSON
array of {"name", "parameters"} objects, a named tool's call is its arguments object. Structured output
constrains the reply to that JSON from its first token, so the arguments always parse and match the tool's
input schema. A JSON output format (Responses' text.format, Messages' output_config.format) is the same
kind of constraint on the text; a request has at most one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lamina.server.errors import bad_request
from lamina.server.protocol import check_constraint
from lamina.server.tools import NamedToolParser, RequiredToolParser, ToolParser, named_schema, required_schema
from lamina.structured.params import StructuredOutputsParams


@dataclass
class AgentPlan:
    tools: list[dict[str, Any]] | None  # OpenAI-style function tools, as the chat template renders them
    constraint: StructuredOutputsParams | None  # the output constraint (forced call or output format)
    forced_parser: ToolParser | None = None  # reads a forced call's constrained JSON

    @property
    def forced(self) -> bool:
        return self.forced_parser is not None


def schema_constraint(schema: Any, strict: bool, param: str) -> StructuredOutputsParams:
    """A JSON-schema constraint; 400 on `param` when the schema is not an object or xgrammar cannot read it."""
    if not isinstance(schema, dict):
        raise bad_request("the output format's schema must be a JSON schema object", param)
    spec = StructuredOutputsParams(json=schema, strict=strict)
    check_constraint(spec, param)
    return spec


def plan_agent(tools: list[dict[str, Any]] | None, forced: str | None, parallel: bool,
               output_format: StructuredOutputsParams | None, format_param: str) -> AgentPlan:
    """forced: None (the model decides), "any" (some tool must be called) or the name of the tool to call
    (checked to be among the tools by the caller). parallel: whether "any" may call several tools."""
    constraint = parser = None
    if forced is not None and tools:
        if forced == "any":
            constraint = StructuredOutputsParams(json=required_schema(tools, parallel))
            parser = RequiredToolParser(tools)
        else:
            schema = named_schema(tools, forced)
            if schema is None:
                raise bad_request(f"tool_choice names {forced!r}, which is not among the tools", "tool_choice")
            constraint = StructuredOutputsParams(json=schema)
            parser = NamedToolParser(tools, forced)
        check_constraint(constraint, "tools")  # a tool's input schema xgrammar cannot read
    if output_format is not None:
        if constraint is not None:
            raise bad_request("a request may have one output constraint: a forced tool_choice or an output format",
                              format_param)
        constraint = output_format
    return AgentPlan(tools, constraint, parser)
