"""One request's reading of its outputs: reasoning split off first, tool calls parsed from the rest.

Shared by the front ends: OutputParsing.parse(text) for a whole output, OutputParsing.streamer() per
streamed choice (feed it the output so far; it returns the reasoning, content and tool-call deltas).
Either parser may be absent. The tool parser only reads content, never reasoning.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from lamina.server.reasoning import ReasoningParser, ReasoningStreamer
from lamina.server.tools import ToolCall, ToolCallDelta, ToolParser, ToolStreamer


@dataclass
class ParsedChoice:
    reasoning: str | None
    content: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass
class ChoiceDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


@dataclass
class OutputParsing:
    reasoning: ReasoningParser | None = None
    tools: ToolParser | None = None

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def parse(self, text: str) -> ParsedChoice:
        reasoning, content = (None, text) if self.reasoning is None else self.reasoning.parse(text)
        if self.tools is None:
            return ParsedChoice(reasoning, content or (None if self.reasoning is not None else content))
        out = self.tools.parse(content or "")
        return ParsedChoice(reasoning, out.content, out.tool_calls)

    def streamer(self) -> ChoiceStreamer:
        return ChoiceStreamer(self.reasoning.streamer() if self.reasoning else None,
                              self.tools.streamer() if self.tools else None)


class ChoiceStreamer:
    def __init__(self, reasoning: ReasoningStreamer | None, tools: ToolStreamer | None) -> None:
        self.reasoning = reasoning
        self.tools = tools

    @property
    def num_calls(self) -> int:
        return self.tools.num_calls if self.tools is not None else 0

    def feed(self, text: str, final: bool = False) -> ChoiceDelta:
        """The growth since the last call of the output so far (final: text is the whole output)."""
        out = ChoiceDelta()
        content_so_far = text
        if self.reasoning is not None:
            out.reasoning, out.content = self.reasoning.feed(text, final)
            content_so_far = self.reasoning.content
        if self.tools is not None:
            out.content, out.tool_calls = self.tools.feed(content_so_far, final)
        elif self.reasoning is None:
            raise ValueError("a ChoiceStreamer needs a reasoning or a tool parser")
        return out
