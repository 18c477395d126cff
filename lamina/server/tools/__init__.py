"""Tool-call parsers by name (vLLM's --tool-call-parser names), and the forced-choice formats.

Front ends use: `get_parser(name)(tools)` -> a ToolParser; parser.parse(text) for a whole output,
parser.streamer().feed(text_so_far) for streamed deltas; `required_schema` / `named_schema` for the
structured-output constraint of tool_choice "required" / a named function, with RequiredToolParser /
NamedToolParser reading the constrained output.
"""
from __future__ import annotations

from lamina.server.tools.base import (
    ParsedOutput,
    PartialCall,
    Scan,
    ToolCall,
    ToolCallDelta,
    ToolParser,
    ToolStreamer,
    new_call_id,
)
from lamina.server.tools.hermes import HermesToolParser
from lamina.server.tools.json_calls import NamedToolParser, RequiredToolParser, named_schema, required_schema
from lamina.server.tools.llama3_json import Llama3JsonToolParser
from lamina.server.tools.mistral import MistralToolParser
from lamina.server.tools.qwen3_coder import Qwen3CoderToolParser

PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Qwen3CoderToolParser, Llama3JsonToolParser, MistralToolParser)
}


def get_parser(name: str) -> type[ToolParser]:
    """The parser class registered under name; ValueError listing the choices otherwise."""
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose from {', '.join(sorted(PARSERS))}") from None


__all__ = ["PARSERS", "NamedToolParser", "ParsedOutput", "PartialCall", "RequiredToolParser", "Scan", "ToolCall",
           "ToolCallDelta", "ToolParser", "ToolStreamer", "get_parser", "named_schema", "new_call_id",
           "required_schema"]
