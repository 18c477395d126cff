"""Scanning JSON that may still be arriving: where a value ends (None: not yet), and the fields of a call
object `{"name": ..., "arguments": ...}` (or an array of them) read as far as the text goes."""
from __future__ import annotations

import json
from dataclasses import dataclass

from lamina.server.tools.base import PartialCall, Scan

_WS = " \t\r\n"
_DECODER = json.JSONDecoder()


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def value_end(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON value starting at text[i], or None while it is incomplete. Only the
    structure is followed (strings, escapes, brackets); json.loads validates later."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        j = i + 1
        while j < len(text):
            if text[j] == "\\":
                j += 2
                continue
            if text[j] == '"':
                return j + 1
            j += 1
        return None
    if c in "{[":
        depth, j, in_str = 0, i, False
        while j < len(text):
            ch = text[j]
            if in_str:
                if ch == "\\":
                    j += 1
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i  # number, true, false, null: ends at a delimiter (at the end of the text it may go on)
    while j < len(text) and text[j] not in _WS + ",}]":
        j += 1
    return j if j < len(text) else None


@dataclass
class CallScan:
    """A call object read from text[start:]: its name (None until complete), the raw text of its arguments
    value so far (a prefix of the final one), and where the object ends (None: incomplete)."""

    name: str | None
    arguments: str
    args_done: bool
    end: int | None
    ok: bool = True  # False: not shaped like a call object


def scan_call(text: str, start: int, arg_keys: tuple[str, ...] = ("arguments", "parameters")) -> CallScan:
    """Reads `{"name": "...", "arguments": {...}}` (keys in any order) from text[start] == "{"."""
    name, args, args_done = None, "", False
    i = skip_ws(text, start + 1)
    while i < len(text):
        if text[i] == "}":
            return CallScan(name, args, args_done, i + 1, ok=name is not None)
        if text[i] == ",":
            i = skip_ws(text, i + 1)
            continue
        if text[i] != '"':
            return CallScan(name, args, args_done, None, ok=False)
        kend = value_end(text, i)
        if kend is None:
            break
        key = json.loads(text[i:kend])
        i = skip_ws(text, kend)
        if i >= len(text):
            break
        if text[i] != ":":
            return CallScan(name, args, args_done, None, ok=False)
        i = skip_ws(text, i + 1)
        if i >= len(text):
            break
        vend = value_end(text, i)
        if key in arg_keys:
            args = text[i:vend] if vend is not None else text[i:]
            args_done = vend is not None
        elif key == "name" and vend is not None:
            try:
                name = json.loads(text[i:vend])
            except ValueError:
                return CallScan(None, args, args_done, None, ok=False)
            if not isinstance(name, str):
                return CallScan(None, args, args_done, None, ok=False)
        if vend is None:
            break
        i = skip_ws(text, vend)
    return CallScan(name, args, args_done, None)


def loads(text: str):
    """json.loads, or None when the text is not one JSON value."""
    try:
        return json.loads(text)
    except ValueError:
        return None


def scan_call_array(text: str, i: int, content: str, final: bool,
                    arg_keys: tuple[str, ...] = ("arguments", "parameters"), at_least_one: bool = False) -> Scan:
    """Reads a JSON array of call objects from text[i] == "[" (mistral's, tool_choice "required"'s): the calls
    so far, the last maybe partial. Not ok on anything else, nor (final) on an open array, an incomplete call
    or (at_least_one) an empty array."""
    calls: list[PartialCall] = []
    i = skip_ws(text, i + 1)
    while i < len(text) and text[i] != "]":
        if text[i] != "{":
            return Scan(content, calls, ok=False)
        c = scan_call(text, i, arg_keys)
        if not c.ok or (c.end is not None and (loads(text[i:c.end]) is None or not c.args_done)):
            return Scan(content, calls, ok=False)
        calls.append(PartialCall(c.name, c.arguments, c.end is not None))
        if c.end is None:
            break
        i = skip_ws(text, c.end)
        if i < len(text) and text[i] == ",":
            i = skip_ws(text, i + 1)
    ok = not final or (i < len(text) and text[i] == "]" and all(c.complete for c in calls)
                       and (bool(calls) or not at_least_one))
    return Scan(content, calls, ok=ok)
