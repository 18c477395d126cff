"""qwen3_coder: Qwen3-Coder's XML calls,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Parameter values are text; each is converted by the tool's parameter schema (string stays text, other
types are read as JSON when they parse). The arguments object is streamed one whole parameter at a time."""
from __future__ import annotations

import json
import re
from typing import Any

from lamina.server.tools.base import PartialCall, Scan, ToolParser, hold_back

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_FUNC = re.compile(r"<function=([^>\n]+)>")
_PARAM = re.compile(r"<parameter=([^>\n]+)>")
END_PARAM, END_FUNC = "</parameter>", "</function>"


def _strip_newline(v: str) -> str:
    # The format puts each value on its own lines: one newline after the tag and before the closing tag.
    if v.startswith("\n"):
        v = v[1:]
    if v.endswith("\n"):
        v = v[:-1]
    return v


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"

    def _convert(self, fn: str, param: str, raw: str) -> Any:
        schema = (self.parameters(fn) or {}).get("properties", {}).get(param, {})
        kind = schema.get("type")
        if kind == "string" or (kind is None and not schema):
            if kind is None:  # unknown parameter: read JSON-looking values as JSON, else text
                try:
                    return json.loads(raw)
                except ValueError:
                    return raw
            return raw
        try:
            return json.loads(raw)
        except ValueError:
            low = raw.strip().lower()
            if kind == "boolean" and low in ("true", "false"):
                return low == "true"
            return raw

    def _call(self, text: str, start: int, final: bool) -> tuple[PartialCall | None, int | None, bool]:
        """(call, end of </function> or None, ok) for the function tag at or after start."""
        rest = text[start:].lstrip()
        m = _FUNC.match(rest)
        if m is None:
            # Still arriving (a prefix of the tag, or the tag without its ">"), or not this format at all.
            waiting = not final and ("<function=".startswith(rest) or
                                     (rest.startswith("<function=") and ">" not in rest and "\n" not in rest))
            return None, None, waiting
        m = _FUNC.match(text, len(text) - len(rest))
        name = m.group(1).strip()
        parts: list[str] = []
        i = m.end()
        while True:
            p = _PARAM.search(text, i)
            f = text.find(END_FUNC, i)
            if p is not None and (f < 0 or p.start() < f):
                close = text.find(END_PARAM, p.end())
                nxt = _PARAM.search(text, p.end())
                fend = text.find(END_FUNC, p.end())
                # A missing </parameter> is tolerated when the next tag arrives (the model sometimes skips it).
                ends = [x for x in (close, nxt.start() if nxt else -1, fend) if x >= 0]
                if not ends:
                    return PartialCall(name, self._args(parts, False)), None, True
                stop = min(ends)
                value = _strip_newline(text[p.end():stop])
                parts.append(json.dumps(p.group(1).strip()) + ": " +
                             json.dumps(self._convert(name, p.group(1).strip(), value), ensure_ascii=False))
                i = stop + (len(END_PARAM) if stop == close else 0)
                continue
            if f >= 0:
                return PartialCall(name, self._args(parts, True), True), f + len(END_FUNC), True
            return PartialCall(name, self._args(parts, False)), None, True

    @staticmethod
    def _args(parts: list[str], done: bool) -> str:
        text = "{" + ", ".join(parts)
        return text + "}" if done else text

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(OPEN)
        if first < 0:
            return Scan(text if final else text[:hold_back(text, (OPEN,))].rstrip(), [])
        content = text[:first].rstrip()
        calls: list[PartialCall] = []
        pos = first
        while pos >= 0:
            call, end, ok = self._call(text, pos + len(OPEN), final)
            if not ok:
                return Scan(content, calls, ok=False)
            if call is None:
                break
            calls.append(call)
            if end is None:
                if final:
                    return Scan(content, calls, ok=False)
                break
            close = text.find(CLOSE, end)
            if close < 0 or text[end:close].strip():
                if final and (close < 0 and text[end:].strip() or close >= 0):
                    return Scan(content, calls, ok=False)
                break
            pos = text.find(OPEN, close + len(CLOSE))
        return Scan(content, calls)
