"""The tool-call parser interface, shared by every API front end (chat completions, Messages, Responses).

A parser reads the model's output text in its own format and splits it into plain content and tool calls.
One method does both the complete and the streaming case: scan(text, final) reads the text produced so far
and returns what is certain about it (content that is safe to show, each call's name once known and a
prefix of its arguments text). Everything it returns for a prefix of the output is a prefix of what it
returns for the whole output, so a streamer only has to send the growth (ToolStreamer), and streamed
deltas concatenate to exactly the non-streamed result.
"""
from __future__ import annotations

import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object, as OpenAI's function.arguments
    id: str = field(default_factory=new_call_id)


@dataclass
class ParsedOutput:
    content: str | None  # None when there is no text besides the calls
    tool_calls: list[ToolCall]


@dataclass
class PartialCall:
    name: str | None  # None until the whole name has arrived
    arguments: str  # a prefix of the final arguments text
    complete: bool = False


@dataclass
class Scan:
    content: str  # a prefix of the final content (held back: anything that may still open a call)
    calls: list[PartialCall]
    ok: bool = True  # False (final only): the calls are malformed; the whole output is content


@dataclass
class ToolCallDelta:
    """One streamed piece of one call: the first piece has id and name (arguments ""), later ones arguments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class ToolParser(ABC):
    """One tool-call format. Subclasses set `name` (as vLLM's --tool-call-parser names it) and scan()."""

    name: ClassVar[str]
    # Whether the format's markers are special tokens, so the output must keep them when detokenized.
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []

    @abstractmethod
    def scan(self, text: str, final: bool) -> Scan:
        """What text (the output so far; the whole output when final) certainly holds; see the module doc."""

    def parse(self, text: str) -> ParsedOutput:
        """The complete output as content plus calls (malformed calls: all of it is content)."""
        s = self.scan(text, final=True)
        if not s.ok:
            return ParsedOutput(text or None, [])
        calls = [ToolCall(c.name, c.arguments) for c in s.calls if c.name is not None]
        return ParsedOutput(s.content or None, calls)

    def streamer(self) -> ToolStreamer:
        return ToolStreamer(self)

    def parameters(self, name: str) -> dict[str, Any] | None:
        """The JSON schema of a tool's parameters (None: unknown tool or no schema)."""
        for t in self.tools:
            fn = t.get("function", t)
            if fn.get("name") == name:
                return fn.get("parameters")
        return None


def hold_back(text: str, markers: tuple[str, ...]) -> int:
    """Length of text that is safe to show: text minus a suffix that could begin one of the markers."""
    for k in range(min(len(text), max(len(m) for m in markers)), 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) for m in markers):
            return len(text) - k
    return len(text)


class ToolStreamer:
    """Turns the growing output into content deltas and OpenAI-style tool-call deltas (one per choice)."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.sent_content = 0
        self.ids: list[str] = []  # ids of the calls announced so far
        self.sent_args: list[int] = []

    @property
    def num_calls(self) -> int:
        return len(self.ids)

    def feed(self, text: str, final: bool = False) -> tuple[str, list[ToolCallDelta]]:
        """(content delta, call deltas) for the output so far; final: text is the whole output."""
        s = self.parser.scan(text, final)
        if final and not s.ok:  # malformed: whatever was not shown yet is content
            s = Scan(text, [], True)
        content = s.content[self.sent_content:] if len(s.content) > self.sent_content else ""
        self.sent_content = max(self.sent_content, len(s.content))
        deltas = []
        for i, call in enumerate(s.calls):
            if call.name is None:
                break  # calls are announced in order, each once its name is whole
            if i == len(self.ids):
                self.ids.append(new_call_id())
                self.sent_args.append(0)
                deltas.append(ToolCallDelta(i, self.ids[i], call.name, ""))
            if len(call.arguments) > self.sent_args[i]:
                deltas.append(ToolCallDelta(i, arguments=call.arguments[self.sent_args[i]:]))
                self.sent_args[i] = len(call.arguments)
        return content, deltas
