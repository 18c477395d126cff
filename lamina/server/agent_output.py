"""Splits a sequence's generated text into reasoning, answer text and tool calls, incrementally.

The Anthropic Messages and OpenAI Responses endpoints stream typed blocks (thinking, text, tool_use /
reasoning, message, function_call), so the text the engine produces must be cut where the model switches
between them. `OutputSplitter` is fed the cumulative text of one sequence after every engine output and
returns the new pieces, holding back a tail that could still turn out to be the start of a marker.

The built-in formats are the common ones: `<think>...</think>` for reasoning (Qwen3, DeepSeek-R1 and their
descendants) and Hermes-style `<tool_call>{"name": ..., "arguments": ...}</tool_call>` for tool calls (Qwen2.5,
Qwen3, Hermes). A model family with other markers plugs in through the `Splitter` protocol: anything with
`feed` and `finish` of these signatures.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Literal, Protocol

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

PieceKind = Literal["reasoning", "text"]
Piece = tuple[PieceKind, str]


@dataclass
class ToolCall:
    """One parsed call: `arguments` is a JSON object serialized as a string (as both APIs send it)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])

    def input(self) -> dict:
        """The arguments as an object; {} when they do not parse (a call cut short by max_tokens)."""
        try:
            value = json.loads(self.arguments)
        except json.JSONDecodeError:
            return {}
        return value if isinstance(value, dict) else {}


class Splitter(Protocol):
    """feed(text so far) -> new text pieces; calls() -> the tool calls begun so far, in order (each one's
    arguments a prefix of its final text, the same objects finish returns), for streaming them as they
    grow; finish(whole text) -> the last pieces and every call."""

    def feed(self, text: str) -> list[Piece]: ...

    def calls(self) -> list[ToolCall]: ...

    def finish(self, text: str) -> tuple[list[Piece], list[ToolCall]]: ...


def _partial_marker(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of the markers (to hold back)."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), 0, -1):
            if text.endswith(m[:k]):
                best = max(best, k)
                break
    return best


class OutputSplitter:
    """Reasoning first (when `reasoning`), then answer text, then tool calls (when `tools`).

    starts_in_reasoning: the prompt already opened the thinking block (templates that end the generation
    prompt with `<think>`), so the output is reasoning until `</think>`. `prefix` is text the server placed
    at the start of the reply (a forced tool-call opening) and is parsed as if generated.
    """

    def __init__(self, reasoning: bool = False, tools: bool = False, starts_in_reasoning: bool = False,
                 prefix: str = "") -> None:
        self.reasoning, self.tools, self.prefix = reasoning, tools, prefix
        self._mode: Literal["start", "reasoning", "after_think", "text", "calls"] = "reasoning" if (
            reasoning and starts_in_reasoning) else "start"
        self._pos = 0  # characters of the (prefixed) text consumed into pieces or the call buffer
        self._calls_from = -1

    def feed(self, text: str) -> list[Piece]:
        return self._advance(self.prefix + text, final=False)

    def calls(self) -> list[ToolCall]:
        return []  # Hermes calls are read whole, at the end

    def finish(self, text: str) -> tuple[list[Piece], list[ToolCall]]:
        full = self.prefix + text
        pieces = self._advance(full, final=True)
        if self._mode != "calls":
            return pieces, []
        calls, rest = parse_hermes_calls(full[self._calls_from:])
        if not calls:  # nothing parsed: what looked like a call is text after all
            rest = full[self._calls_from:]
        if rest.strip():
            pieces.append(("text", rest))
        return pieces, calls

    def _advance(self, text: str, final: bool) -> list[Piece]:
        out: list[Piece] = []
        while True:
            rest = text[self._pos:]
            if self._mode == "calls" or not rest:
                return out
            if self._mode == "start":
                stripped = rest.lstrip()
                if not self.reasoning or stripped.startswith(THINK_OPEN):
                    if self.reasoning:
                        self._pos += len(rest) - len(stripped) + len(THINK_OPEN)
                    self._mode = "reasoning" if self.reasoning else "text"
                    continue
                if not final and THINK_OPEN.startswith(stripped):
                    return out  # could still become "<think>"
                self._mode = "text"
                continue
            if self._mode == "after_think":
                # The blank lines the model writes after its thinking belong to neither block.
                stripped = rest.lstrip()
                self._pos += len(rest) - len(stripped)
                if not stripped and not final:
                    return out
                self._mode = "text"
                continue
            close = THINK_CLOSE if self._mode == "reasoning" else CALL_OPEN
            markers = (THINK_CLOSE,) if self._mode == "reasoning" else ((CALL_OPEN,) if self.tools else ())
            at = rest.find(close) if markers else -1
            if at >= 0:
                if at:
                    out.append((self._kind(), rest[:at]))
                self._pos += at
                if self._mode == "reasoning":
                    self._pos += len(THINK_CLOSE)
                    self._mode = "after_think"
                else:
                    self._mode, self._calls_from = "calls", self._pos
                continue
            hold = 0 if final else _partial_marker(rest, markers)
            if len(rest) > hold:
                out.append((self._kind(), rest[:len(rest) - hold]))
                self._pos += len(rest) - hold
            return out

    def _kind(self) -> PieceKind:
        return "reasoning" if self._mode == "reasoning" else "text"


def parse_hermes_calls(text: str) -> tuple[list[ToolCall], str]:
    """The `<tool_call>{json}</tool_call>` blocks of `text` (an unclosed last one is accepted: generation may
    stop right after the JSON) and the text outside them. A block that does not parse is left in the text."""
    calls: list[ToolCall] = []
    rest: list[str] = []
    pos = 0
    while (start := text.find(CALL_OPEN, pos)) >= 0:
        rest.append(text[pos:start])
        end = text.find(CALL_CLOSE, start)
        body = text[start + len(CALL_OPEN):end if end >= 0 else len(text)]
        call = _parse_call(body)
        if call is None:
            rest.append(text[start:end + len(CALL_CLOSE) if end >= 0 else len(text)])
        else:
            calls.append(call)
        pos = end + len(CALL_CLOSE) if end >= 0 else len(text)
    rest.append(text[pos:])
    return calls, "".join(rest)


def _parse_call(body: str) -> ToolCall | None:
    try:
        obj = json.loads(body.strip())
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models serialize the arguments twice
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(name=obj["name"], arguments=json.dumps(args, ensure_ascii=False))


class ParsedSplitter:
    """A Splitter over the server's configured parsers (--reasoning-parser, --tool-call-parser): `reasoning`
    has split(text, final) -> an object with .reasoning and .content (prefixes of the final parts);
    `tool_parser` has streamer() whose feed(content, final) returns (content delta, call deltas with
    index / name / arguments). Either may be None: that part is not split."""

    def __init__(self, reasoning=None, tool_parser=None, prefix: str = "") -> None:
        self.reasoning, self.prefix = reasoning, prefix
        self.tools = tool_parser.streamer() if tool_parser is not None else None
        self._sent_reasoning = self._sent_content = 0
        self._calls: dict[int, ToolCall] = {}  # index -> the call, its arguments so far

    def _step(self, text: str, final: bool) -> list[Piece]:
        text = self.prefix + text
        if self.reasoning is not None:
            s = self.reasoning.split(text, final)
            reasoning, content = s.reasoning, s.content
        else:
            reasoning, content = "", text
        out: list[Piece] = []
        if len(reasoning) > self._sent_reasoning:
            out.append(("reasoning", reasoning[self._sent_reasoning:]))
            self._sent_reasoning = len(reasoning)
        if self.tools is None:
            if len(content) > self._sent_content:
                out.append(("text", content[self._sent_content:]))
                self._sent_content = len(content)
            return out
        delta, calls = self.tools.feed(content, final)
        if delta:
            out.append(("text", delta))
        for d in calls:
            call = self._calls.setdefault(d.index, ToolCall(name="", arguments=""))
            call.name = d.name or call.name
            call.arguments += d.arguments
        return out

    def feed(self, text: str) -> list[Piece]:
        return self._step(text, final=False)

    def calls(self) -> list[ToolCall]:
        return [c for _, c in sorted(self._calls.items())]

    def finish(self, text: str) -> tuple[list[Piece], list[ToolCall]]:
        pieces = self._step(text, final=True)
        calls = self.calls()
        for c in calls:
            c.arguments = c.arguments or "{}"
        return pieces, calls


def make_splitter(reasoning_parser=None, tool_parser=None, *, reasoning: bool, tools: list[dict] | None,
                  prompt_tail: str, starts_in_reasoning: bool, prefix: str = "") -> Splitter:
    """The configured parsers when the server has them (classes: reasoning_parser(prompt_text),
    tool_parser(tools)), else the built-in `<think>` / Hermes splitter. Reasoning is split when the request
    asks for thinking or a reasoning parser is configured; tool calls only when the request has tools."""
    if reasoning_parser is not None or (tool_parser is not None and tools):
        return ParsedSplitter(reasoning_parser(prompt_tail) if reasoning_parser is not None else None,
                              tool_parser(tools) if tool_parser is not None and tools else None, prefix)
    return OutputSplitter(reasoning=reasoning, tools=bool(tools), starts_in_reasoning=starts_in_reasoning,
                          prefix=prefix)


class OneCall:
    """A splitter that keeps only the first tool call (parallel calls switched off by the request)."""

    def __init__(self, inner: Splitter) -> None:
        self.inner = inner

    def feed(self, text: str) -> list[Piece]:
        return self.inner.feed(text)

    def calls(self) -> list[ToolCall]:
        return self.inner.calls()[:1]

    def finish(self, text: str) -> tuple[list[Piece], list[ToolCall]]:
        pieces, calls = self.inner.finish(text)
        return pieces, calls[:1]
