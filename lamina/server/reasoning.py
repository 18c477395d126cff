"""Reasoning parsers (vLLM's --reasoning-parser names): split `<think>...</think>` out of the output.

Like the tool parsers, split(text, final) reads the output so far and returns prefixes of the final
(reasoning, content), so a ReasoningStreamer only sends their growth. Front ends put the reasoning in
`reasoning` (vLLM's field since 0.11) and `reasoning_content` (DeepSeek's, which most clients read).

- deepseek_r1: the chat template already opened `<think>` in the prompt, so the output starts inside the
  reasoning; everything up to `</think>` is reasoning (all of it if the tag never comes).
- qwen3: the output is reasoning only if it closes a think block (`</think>`, with or without its own
  `<think>`); otherwise (thinking switched off by enable_thinking=false) it is all content.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

START, END = "<think>", "</think>"


def _safe(text: str, marker: str) -> int:
    """Length of text that cannot be the start of marker."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return len(text)


@dataclass
class Split:
    reasoning: str  # a prefix of the final reasoning
    content: str  # a prefix of the final content
    done: bool  # the reasoning has ended (content from here on; a tool parser may read it)


class ReasoningParser(ABC):
    name: ClassVar[str]

    def __init__(self, prompt_text: str | None = None) -> None:
        """prompt_text: the rendered prompt (or its tail). A prompt whose last think tag is an open `<think>`
        (templates that start the model thinking) makes the output start inside the reasoning."""
        tail = (prompt_text or "").rstrip()
        self.opened_in_prompt = tail.rfind(START) > tail.rfind(END)

    @abstractmethod
    def split(self, text: str, final: bool) -> Split:
        """(reasoning, content) of the output so far (the whole output when final)."""

    def parse(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of the whole output; None for an empty part."""
        s = self.split(text, final=True)
        return s.reasoning or None, s.content or None

    def streamer(self) -> ReasoningStreamer:
        return ReasoningStreamer(self)


def _in_reasoning(text: str, final: bool) -> Split:
    """The output starts inside a think block (its own `<think>` optional): reasoning up to `</think>`."""
    body = text.lstrip()
    if body.startswith(START):
        body = body[len(START):]
    elif not final and body and START.startswith(body):
        return Split("", "", False)  # the opening tag may still be arriving
    else:
        body = text
    end = body.find(END)
    if end >= 0:
        return Split(body[:end], body[end + len(END):].lstrip("\n"), True)
    return Split(body if final else body[:_safe(body, END)], "", final)


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek_r1"

    def split(self, text: str, final: bool) -> Split:
        return _in_reasoning(text, final)


class Qwen3ReasoningParser(ReasoningParser):
    """Reasoning only when the output opens a think block or the prompt did; else (enable_thinking=false
    renders an empty block in the prompt) all content. An unclosed block is reasoning cut short."""

    name = "qwen3"

    def split(self, text: str, final: bool) -> Split:
        if self.opened_in_prompt:
            return _in_reasoning(text, final)
        stripped = text.lstrip()
        if stripped.startswith(START):
            return _in_reasoning(text, final)
        if not final and START.startswith(stripped):
            return Split("", "", False)
        return Split("", text, True)


PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose from {', '.join(sorted(PARSERS))}") from None


class ReasoningStreamer:
    """The growth of (reasoning, content) as the output grows (one per choice)."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.sent_reasoning = 0
        self.sent_content = 0
        self.done = False

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning delta, content delta). Also keeps the whole content so far in self.content."""
        s = self.parser.split(text, final)
        r = s.reasoning[self.sent_reasoning:]
        c = s.content[self.sent_content:]
        self.sent_reasoning = max(self.sent_reasoning, len(s.reasoning))
        self.sent_content = max(self.sent_content, len(s.content))
        self.done = s.done
        self.content = s.content
        return r, c
