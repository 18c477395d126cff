"""The output splitter (reasoning / text / tool calls, fed piece by piece) and the conversation rendering for
templates without tool support. Oracle: the whole text split at once, and hand-written expectations."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from lamina.server.agent_output import OutputSplitter, parse_hermes_calls
from lamina.server.conversation import _inline_tools

REPLY = ('<think>\nThe user wants the weather.\n</think>\n\nLet me look.<tool_call>\n'
         '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
         '{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}\n</tool_call>')


def _run(splitter: OutputSplitter, text: str, step: int):
    pieces = []
    for end in range(step, len(text), step):
        pieces += splitter.feed(text[:end])
    last, calls = splitter.finish(text)
    return pieces + last, calls


def _joined(pieces):
    out: dict[str, str] = {}
    for kind, text in pieces:
        out[kind] = out.get(kind, "") + text
    return out


@pytest.mark.parametrize("step", [1, 2, 3, 7, 10_000])
def test_split_is_the_same_whatever_the_pieces(step):
    pieces, calls = _run(OutputSplitter(reasoning=True, tools=True), REPLY, step)
    assert _joined(pieces) == {"reasoning": "\nThe user wants the weather.\n", "text": "Let me look."}
    assert [(c.name, c.input()) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    kinds = [k for k, _ in pieces]
    assert kinds == sorted(kinds)  # all reasoning before any text ("reasoning" < "text")
    assert not any("<" in t for _, t in pieces)  # no marker leaks into a piece


def test_markers_are_plain_text_when_not_asked_for():
    pieces, calls = _run(OutputSplitter(), REPLY, 5)
    assert calls == [] and _joined(pieces) == {"text": REPLY}


def test_prompt_opened_thinking_and_unfinished_thinking():
    pieces, _ = _run(OutputSplitter(reasoning=True, starts_in_reasoning=True), "plan\n</think>\nAnswer", 2)
    assert _joined(pieces) == {"reasoning": "plan\n", "text": "Answer"}
    pieces, _ = _run(OutputSplitter(reasoning=True), "<think>still going", 3)  # cut off by max_tokens
    assert _joined(pieces) == {"reasoning": "still going"}
    pieces, _ = _run(OutputSplitter(reasoning=True), "<thin", 1)  # not a marker after all
    assert _joined(pieces) == {"text": "<thin"}


def test_malformed_and_unclosed_calls():
    pieces, calls = _run(OutputSplitter(tools=True), 'Hi <tool_call>{"name": broken}</tool_call>', 4)
    assert calls == [] and _joined(pieces) == {"text": 'Hi <tool_call>{"name": broken}</tool_call>'}
    # Generation may stop right after the JSON, before the closing tag.
    calls, rest = parse_hermes_calls('<tool_call>\n{"name": "f", "arguments": {}}\n')
    assert [(c.name, c.arguments) for c in calls] == [("f", "{}")] and rest == ""
    _, calls = OutputSplitter(tools=True, prefix='<tool_call>\n{"name": "f", "arguments": ').finish('{"x": 1}}')
    assert [(c.name, c.input()) for c in calls] == [("f", {"x": 1})]


def test_inline_tools_for_a_template_without_tool_support():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
            {"role": "tool", "tool_call_id": "1", "content": "rain"}, {"role": "tool", "content": "cold"}]
    out = _inline_tools(msgs, tools)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    assert out[0]["content"].startswith("Be brief.") and '"name": "get_weather"' in out[0]["content"]
    calls, rest = parse_hermes_calls(out[2]["content"])  # what the parser reads back is what was written
    assert [(c.name, c.input()) for c in calls] == [("get_weather", {"city": "Oslo"})] and not rest.strip()
    assert out[3]["content"] == "<tool_response>\nrain\n</tool_response>\n<tool_response>\ncold\n</tool_response>"
    assert all(set(m) == {"role", "content"} for m in out)


@pytest.mark.parametrize("step", [1, 3, 10_000])
def test_forced_calls_stream_as_they_grow(step):
    """A forced call's constrained JSON (plan_agent's formats) read by the plan's splitter: calls() grows
    by prefixes, its objects are the ones finish returns, and the arguments are the tool's."""
    from lamina.server.agent_plan import plan_agent
    from lamina.server.conversation import Prompt, splitter_for

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
             {"type": "function", "function": {"name": "g"}}]
    cases = [("any", '[{"name": "g", "parameters": {"x": [1, 2]}}, {"name": "f", "parameters": {}}]',
              [("g", {"x": [1, 2]}), ("f", {})]),
             ("f", '{"y": "a,b"}', [("f", {"y": "a,b"})])]
    for forced, reply, want in cases:
        plan = plan_agent(tools, forced, True, None, "x")
        assert plan.forced and plan.constraint.json is not None
        s = splitter_for(SimpleNamespace(), Prompt([1], False, ""), tools, thinking=True, plan=plan)
        seen: dict[str, str] = {}
        for end in range(step, len(reply), step):
            assert s.feed(reply[:end]) == []
            for c in s.calls():
                assert c.arguments.startswith(seen.get(c.id, ""))
                seen[c.id] = c.arguments
        pieces, calls = s.finish(reply)
        assert pieces == [] and [(c.name, c.input()) for c in calls] == want
        assert all(c.arguments.startswith(seen.get(c.id, "")) for c in calls)
        assert all(c.id in {x.id for x in calls} for c in s.calls())


def test_one_output_constraint_per_request():
    from lamina.server.agent_plan import plan_agent, schema_constraint
    from lamina.server.errors import APIError

    tools = [{"type": "function", "function": {"name": "f"}}]
    fmt = schema_constraint({"type": "object"}, True, "text.format.schema")
    with pytest.raises(APIError, match="one output constraint"):
        plan_agent(tools, "any", True, fmt, "text.format")
    with pytest.raises(APIError, match="missing"):
        plan_agent(tools, "missing", True, None, "text.format")
    with pytest.raises(APIError) as e:
        schema_constraint({"type": "object", "properties": {"a": {"type": "nope"}}}, True, "text.format.schema")
    assert e.value.param == "text.format.schema"
    plan = plan_agent(tools, None, True, fmt, "text.format")
    assert plan.constraint is fmt and not plan.forced


class _Split:
    """A stand-in for a configured reasoning parser (prefix-consistent, as the interface promises)."""

    def __init__(self, prompt_text=None):
        self.prompt_text = prompt_text

    def split(self, text, final):
        head, sep, tail = text.partition("</think>")
        if not sep:
            return SimpleNamespace(reasoning="", content=text if final else "")
        return SimpleNamespace(reasoning=head.removeprefix("<think>"), content=tail.lstrip())


class _Calls:
    """A stand-in for a configured tool parser: `CALL name {json}` after the content, read at the end."""

    def __init__(self, tools):
        self.tools = tools

    def streamer(self):
        class S:
            def feed(self, content, final):
                if not final:
                    return "", []
                text, _, call = content.partition("CALL ")
                name, _, args = call.partition(" ")
                return text, [SimpleNamespace(index=0, name=name, arguments=""),
                              SimpleNamespace(index=0, name=None, arguments=args)]

        return S()


def test_configured_parsers_plug_in():
    from lamina.server.agent_output import ParsedSplitter, make_splitter

    s = make_splitter(_Split, _Calls, reasoning=False, tools=[{"type": "function"}], prompt_tail="x",
                      starts_in_reasoning=False)
    assert isinstance(s, ParsedSplitter) and s.reasoning.prompt_text == "x"
    reply = '<think>hm</think>\nOk CALL f {"a": 1}'
    pieces = []
    for end in range(1, len(reply)):
        pieces += s.feed(reply[:end])
    last, calls = s.finish(reply)
    assert _joined(pieces + last) == {"reasoning": "hm", "text": "Ok "}
    assert [(c.name, c.input()) for c in calls] == [("f", {"a": 1})]
    assert isinstance(make_splitter(None, _Calls, reasoning=True, tools=None, prompt_tail="",
                                    starts_in_reasoning=False), OutputSplitter)  # no tools: nothing to parse


def test_parsers_named_at_start_up_are_used(monkeypatch):
    """ServerState names the parsers (vLLM's flags); the registries resolve them (stand-ins here)."""
    import sys
    import types

    from lamina.server.agent_output import ParsedSplitter
    from lamina.server.conversation import Prompt, keeps_special_tokens, splitter_for

    monkeypatch.setattr(_Calls, "needs_special_tokens", True, raising=False)
    reasoning_mod = types.ModuleType("lamina.server.reasoning")
    reasoning_mod.get_reasoning_parser = {"qwen3": _Split}.__getitem__
    tools_mod = types.ModuleType("lamina.server.tools")
    tools_mod.get_parser = {"hermes": _Calls}.__getitem__
    monkeypatch.setitem(sys.modules, "lamina.server.reasoning", reasoning_mod)
    monkeypatch.setitem(sys.modules, "lamina.server.tools", tools_mod)
    state = SimpleNamespace(reasoning_parser="qwen3", tool_call_parser="hermes")
    tools = [{"type": "function", "function": {"name": "f"}}]
    s = splitter_for(state, Prompt([1], False, "", "tail"), tools, thinking=False)
    assert isinstance(s, ParsedSplitter) and s.reasoning.prompt_text == "tail" and s.tools is not None
    assert keeps_special_tokens(state, tools) and not keeps_special_tokens(state, None)


def test_parallel_calls_off_keeps_the_first():
    from lamina.server.conversation import Prompt, splitter_for

    s = splitter_for(SimpleNamespace(), Prompt([1], False, ""), [{"type": "function"}], thinking=True,
                     parallel_calls=False)
    _, calls = _run(s, REPLY, 4)
    assert [c.name for c in calls] == ["get_weather"]
