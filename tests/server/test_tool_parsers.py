"""Tool-call parsers on captured model outputs of each format: whole, streamed split at every position
(the deltas must add up to the whole result), several calls, and malformed output (plain content)."""
from __future__ import annotations

import json

import pytest

from lamina.server.tools import NamedToolParser, RequiredToolParser, get_parser

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}},
    {"type": "function", "function": {"name": "search", "parameters": {
        "type": "object", "properties": {"query": {"type": "string"}, "filters": {"type": "object"}}}}},
]

HERMES_ONE = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
              '</tool_call>')
HERMES_TWO = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"FR\\"", "days": 3}}\n</tool_call>\n'
              '<tool_call>\n{"arguments": {"query": "café {x}", "filters": {"a": [1, 2]}}, "name": "search"}\n'
              '</tool_call>')
QWEN3_CODER_TWO = ('I will call two tools.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n'
                   '</parameter>\n'
                   '<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=search>\n'
                   '<parameter=query>\nmulti\nline <b>text</b>\n</parameter>\n<parameter=filters>\n{"a": 1}\n'
                   '</parameter>\n</function>\n</tool_call>')
LLAMA_TWO = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
             '{"name": "search", "parameters": {"query": "x"}}')
MISTRAL_OLD = ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
               '{"name": "search", "arguments": {"query": "x"}}]')
MISTRAL_NEW = 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]search[ARGS]{"query": "x"}'

CASES = [
    ("hermes", HERMES_ONE, "Let me check.", [("get_weather", {"city": "Paris", "days": 3})]),
    ("hermes", HERMES_TWO, None, [("get_weather", {"city": 'Paris "FR"', "days": 3}),
                                  ("search", {"query": "café {x}", "filters": {"a": [1, 2]}})]),
    ("qwen3_coder", QWEN3_CODER_TWO, "I will call two tools.",
     [("get_weather", {"city": "Paris", "days": 3}), ("search", {"query": "multi\nline <b>text</b>",
                                                                 "filters": {"a": 1}})]),
    ("llama3_json", LLAMA_TWO, None, [("get_weather", {"city": "Paris", "days": 3}), ("search", {"query": "x"})]),
    ("mistral", MISTRAL_OLD, None, [("get_weather", {"city": "Paris", "days": 3}), ("search", {"query": "x"})]),
    ("mistral", MISTRAL_NEW, "Sure.", [("get_weather", {"city": "Paris", "days": 3}), ("search", {"query": "x"})]),
]

MALFORMED = [
    ("hermes", 'Hi <tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'),
    ("hermes", "<tool_call>\nnot json\n</tool_call>"),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis"),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"'),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}'),
]
PLAIN = [("hermes", "The weather is fine, no tools needed."), ("qwen3_coder", "a < b and c > d"),
         ("llama3_json", "Hello {there}"), ("mistral", "Plain [answer]")]


def _stream(parser, text: str, cuts: list[int]):
    """Feeds text cut at `cuts`, then the whole as final; returns (content, [(id, name, arguments)])."""
    st = parser.streamer()
    content, calls = "", {}
    pieces = [text[:c] for c in cuts] + [text]
    for k, piece in enumerate(pieces):
        c, deltas = st.feed(piece, final=k == len(pieces) - 1)
        content += c
        for d in deltas:
            if d.id is not None:
                assert d.index == len(calls) and d.name and d.arguments == ""  # id and name come first, once
                calls[d.index] = [d.id, d.name, ""]
            else:
                assert d.name is None and d.index in calls
                calls[d.index][2] += d.arguments
    return content, [tuple(v) for _, v in sorted(calls.items())]


@pytest.mark.parametrize("name,text,content,expected", CASES)
def test_whole_output(name, text, content, expected):
    out = get_parser(name)(TOOLS).parse(text)
    assert out.content == content
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == expected
    assert len({c.id for c in out.tool_calls}) == len(expected)


@pytest.mark.parametrize("name,text,content,expected", CASES)
def test_streamed_at_every_split_equals_whole(name, text, content, expected):
    parser = get_parser(name)(TOOLS)
    whole = parser.parse(text)
    for cut in range(len(text) + 1):
        got_content, calls = _stream(parser, text, [cut])
        assert (got_content or None) == whole.content, cut
        assert [(n, a) for _, n, a in calls] == [(c.name, c.arguments) for c in whole.tool_calls], cut
    # and one character at a time
    got_content, calls = _stream(parser, text, list(range(len(text))))
    assert [(n, json.loads(a)) for _, n, a in calls] == expected


@pytest.mark.parametrize("name,text", MALFORMED + PLAIN)
def test_malformed_or_plain_is_content(name, text):
    parser = get_parser(name)(TOOLS)
    out = parser.parse(text)
    assert out.tool_calls == [] and out.content == text
    content, _ = _stream(parser, text, list(range(len(text))))
    if (name, text) in PLAIN:
        assert content == text


def test_required_and_named_formats():
    text = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "search", "parameters": {}}]'
    out = RequiredToolParser(TOOLS).parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in out.tool_calls] == [("get_weather", {"city": "Oslo"}),
                                                                           ("search", {})]
    _, calls = _stream(RequiredToolParser(TOOLS), text, list(range(len(text))))
    assert [(n, a) for _, n, a in calls] == [(c.name, c.arguments) for c in out.tool_calls]
    named = NamedToolParser(TOOLS, "search")
    assert [(c.name, c.arguments) for c in named.parse(' {"query": "x"}').tool_calls] == [("search", '{"query": "x"}')]
    _, calls = _stream(named, '{"query": "x"}', list(range(14)))
    assert calls[0][1:] == ("search", '{"query": "x"}')


def test_call_arrays_open_empty_or_broken():
    """The JSON call arrays (tool_choice "required", mistral before v11): "required" needs a call, mistral's may
    be empty; an array still open or holding a non-object is not ok once final; while streaming, an open
    array is ok with its calls so far."""
    required, mistral = RequiredToolParser(TOOLS), get_parser("mistral")(TOOLS)
    assert not required.scan("[]", final=True).ok and mistral.scan("[TOOL_CALLS] []", final=True).ok
    head = '[{"name": "search", "parameters": {"query": "x"}}'
    assert not required.scan(head, final=True).ok
    partial = required.scan(head + ', {"name": "sea', final=False)
    assert partial.ok and [c.name for c in partial.calls] == ["search", None]  # a name counts once closed
    assert not required.scan("[1]", final=False).ok and not mistral.scan("[TOOL_CALLS] [1]", final=False).ok


def test_unknown_parser_names_the_choices():
    with pytest.raises(ValueError, match="hermes"):
        get_parser("nope")
