"""llama3_json: Llama 3.x JSON tool calls, the whole output being `{"name": ..., "parameters": {...}}`
objects (optionally after `<|python_tag|>`), several separated by `;`. Output that does not start with
one is plain content."""
from __future__ import annotations

from lamina.server.tools.base import PartialCall, Scan, ToolParser
from lamina.server.tools.jsonscan import loads, scan_call, skip_ws

TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def scan(self, text: str, final: bool) -> Scan:
        i = skip_ws(text, 0)
        if text.startswith(TAG, i):
            i = skip_ws(text, i + len(TAG))
        elif not final and TAG.startswith(text[i:]):
            return Scan("", [])  # may still become the tag
        if i >= len(text):
            return Scan(text if final else "", [])
        if text[i] != "{":
            return Scan(text, [])
        calls: list[PartialCall] = []
        while i < len(text):
            c = scan_call(text, i)
            if not c.ok:
                return Scan("", calls, ok=False) if final else Scan("", calls)
            if c.end is None:
                calls.append(PartialCall(c.name, c.arguments))
                if final:
                    return Scan("", calls, ok=False)
                break
            if loads(text[i:c.end]) is None or not c.args_done:
                return Scan("", calls, ok=False)
            calls.append(PartialCall(c.name, c.arguments, True))
            i = skip_ws(text, c.end)
            if i < len(text) and text[i] == ";":
                i = skip_ws(text, i + 1)
            elif i < len(text):
                return Scan("", calls, ok=False)
        return Scan("", calls)
