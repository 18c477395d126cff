"""hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks (Hermes, Qwen2.5, Qwen3).
Content is the text before the first block."""
from __future__ import annotations

from lamina.server.tools.base import PartialCall, Scan, ToolParser, hold_back
from lamina.server.tools.jsonscan import loads, scan_call, skip_ws

OPEN, CLOSE = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(OPEN)
        if first < 0:
            return Scan(text if final else text[:hold_back(text, (OPEN,))].rstrip(), [])
        content = text[:first].rstrip()
        calls: list[PartialCall] = []
        pos = first
        while pos >= 0:
            body = skip_ws(text, pos + len(OPEN))
            close = text.find(CLOSE, body)
            if body >= len(text):
                break
            if text[body] != "{":
                return Scan(content, calls, ok=False)
            c = scan_call(text, body)
            if not c.ok:
                return Scan(content, calls, ok=False)
            complete = c.end is not None and (close >= 0 or final)
            if c.end is not None and (loads(text[body:c.end]) is None or not c.args_done):
                return Scan(content, calls, ok=False)
            if c.end is not None and close >= 0 and text[c.end:close].strip():
                return Scan(content, calls, ok=False)  # something other than the call inside the block
            calls.append(PartialCall(c.name, c.arguments, complete))
            if close < 0:
                if final and not complete:
                    return Scan(content, calls, ok=False)
                break
            pos = text.find(OPEN, close + len(CLOSE))
        return Scan(content, calls)
