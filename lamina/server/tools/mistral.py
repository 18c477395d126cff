"""mistral: `[TOOL_CALLS]` then either a JSON array `[{"name": ..., "arguments": {...}}, ...]` (tokenizer
versions before v11) or `name[ARGS]{...}` per call (v11 and later, each call after its own [TOOL_CALLS]).
The markers are special tokens, kept in the text for this parser. Content is the text before the first."""
from __future__ import annotations

from lamina.server.tools.base import PartialCall, Scan, ToolParser, hold_back
from lamina.server.tools.jsonscan import loads, scan_call_array, skip_ws, value_end

CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    needs_special_tokens = True

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(CALLS)
        if first < 0:
            return Scan(text if final else text[:hold_back(text, (CALLS,))].rstrip(), [])
        content = text[:first].rstrip()
        i = skip_ws(text, first + len(CALLS))
        if i >= len(text):
            return Scan(content, [], ok=not final)
        if text[i] == "[":
            return scan_call_array(text, i, content, final)
        return self._named(text, first, content, final)

    def _named(self, text: str, pos: int, content: str, final: bool) -> Scan:
        calls: list[PartialCall] = []
        while pos >= 0:
            start = pos + len(CALLS)
            a = text.find(ARGS, start)
            if a < 0:
                if final:
                    return Scan(content, calls, ok=False)
                break
            name = text[start:a].strip()
            if not name or any(ch in name for ch in "{}[]\"\n"):
                return Scan(content, calls, ok=False)
            j = skip_ws(text, a + len(ARGS))
            end = value_end(text, j) if j < len(text) else None
            if end is None:
                calls.append(PartialCall(name, text[j:]))
                if final:
                    return Scan(content, calls, ok=False)
                break
            if not isinstance(loads(text[j:end]), dict):
                return Scan(content, calls, ok=False)
            calls.append(PartialCall(name, text[j:end], True))
            pos = text.find(CALLS, end)
            if pos < 0 and text[end:].strip() and final:
                return Scan(content, calls, ok=False)
        return Scan(content, calls)
