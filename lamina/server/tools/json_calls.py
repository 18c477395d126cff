"""The formats of forced tool choices, whose output structured output constrains to JSON (so they hold
whatever the model's own format is): `tool_choice: "required"` makes the output a JSON array of
`{"name": ..., "parameters": {...}}`, a named choice makes it the arguments object itself."""
from __future__ import annotations

from typing import Any

from lamina.server.tools.base import PartialCall, Scan, ToolParser
from lamina.server.tools.jsonscan import loads, scan_call_array, skip_ws, value_end


class RequiredToolParser(ToolParser):
    name = "required"

    def scan(self, text: str, final: bool) -> Scan:
        i = skip_ws(text, 0)
        if i >= len(text):
            return Scan("", [], ok=not final)
        if text[i] != "[":
            return Scan("", [], ok=False)
        return scan_call_array(text, i, "", final, ("parameters", "arguments"), at_least_one=True)


class NamedToolParser(ToolParser):
    """The whole output is the named function's arguments."""

    name = "named"

    def __init__(self, tools: list[dict[str, Any]] | None, function: str) -> None:
        super().__init__(tools)
        self.function = function

    def scan(self, text: str, final: bool) -> Scan:
        i = skip_ws(text, 0)
        if final:
            end = value_end(text, i) if i < len(text) else None
            if end is None or not isinstance(loads(text[i:end]), dict) or text[end:].strip():
                return Scan("", [], ok=False)
            return Scan("", [PartialCall(self.function, text[i:end], True)])
        return Scan("", [PartialCall(self.function, text[i:])])


def required_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of a `required` choice: an array of one or more calls of the given tools."""
    options = []
    for t in tools:
        fn = t.get("function", t)
        params = fn.get("parameters") or {"type": "object"}
        options.append({"type": "object", "properties": {"name": {"const": fn["name"]}, "parameters": params},
                        "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def named_schema(tools: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    for t in tools:
        fn = t.get("function", t)
        if fn.get("name") == name:
            return fn.get("parameters") or {"type": "object"}
    return None
