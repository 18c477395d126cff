"""Anthropic's Messages API through the official `anthropic` SDK against a real `lamina serve` process.

Oracles: the OpenAI chat endpoint of the same server (same template, same greedy tokens), the raw SSE event
sequence as Anthropic documents it, and the KV pool counted idle after every scenario. Sampling fields go in
extra_body: the 2026 SDK no longer lists them (the API still takes them).
"""
from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import pytest
from server_helpers import MODEL, serve_in_thread, wait_idle

from lamina.outputs import CompletionOutput, RequestOutput
from lamina.server.agent_output import OutputSplitter
from lamina.server.anthropic import _stream

USER = [{"role": "user", "content": "Name three colors."}]
GREEDY = {"temperature": 0}
WEATHER = {"name": "get_weather", "description": "The weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def _events(server, body: dict) -> list[tuple[str, dict]]:
    with httpx.stream("POST", server.base_url + "/v1/messages", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text = "".join(r.iter_text())
    out = []
    for frame in text.strip().split("\n\n"):
        kind, data = frame.split("\n", 1)
        assert kind.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data[len("data: "):])
        assert payload["type"] == kind[len("event: "):]
        out.append((payload["type"], payload))
    return out


def test_reply_matches_the_chat_endpoint(claude, client, server):
    msg = claude.messages.create(model=MODEL, max_tokens=16, system="Be brief.", messages=USER, extra_body=GREEDY)
    chat = client.chat.completions.create(model=MODEL, max_tokens=16, temperature=0,
                                          messages=[{"role": "system", "content": "Be brief."}, *USER])
    assert msg.type == "message" and msg.role == "assistant" and msg.id.startswith("msg_")
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text == chat.choices[0].message.content
    assert msg.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[chat.choices[0].finish_reason]
    u = msg.usage
    assert u.input_tokens + u.cache_read_input_tokens == chat.usage.prompt_tokens
    assert u.output_tokens == chat.usage.completion_tokens and u.cache_creation_input_tokens == 0
    counted = claude.messages.count_tokens(model=MODEL, system="Be brief.", messages=USER)
    assert counted.input_tokens == chat.usage.prompt_tokens
    wait_idle(server.base_url)


def test_stream_event_sequence(claude, server):
    body = {"model": MODEL, "max_tokens": 12, "messages": USER, **GREEDY}
    events = _events(server, body)
    kinds = [k for k, _ in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[3:-3]) == {"content_block_delta"}
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["usage"]["output_tokens"] == 0
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    text = "".join(e["delta"]["text"] for k, e in events if k == "content_block_delta")
    assert all(e["delta"]["type"] == "text_delta" and e["index"] == 0 for k, e in events if k == "content_block_delta")
    full = claude.messages.create(extra_body=GREEDY, **{k: v for k, v in body.items() if k != "temperature"})
    assert text == full.content[0].text
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": full.stop_reason, "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == full.usage.output_tokens
    # The SDK's own accumulation of the same stream.
    with claude.messages.stream(model=MODEL, max_tokens=12, messages=USER, extra_body=GREEDY) as s:
        final = s.get_final_message()
    assert final.content[0].text == text and final.usage.output_tokens == full.usage.output_tokens
    wait_idle(server.base_url)


def test_stop_sequences_and_max_tokens(claude):
    base = claude.messages.create(model=MODEL, max_tokens=12, messages=USER, extra_body=GREEDY).content[0].text
    stop = base[len(base) // 2:len(base) // 2 + 2]
    assert stop.strip(), f"degenerate greedy text {base!r}"
    r = claude.messages.create(model=MODEL, max_tokens=12, messages=USER, stop_sequences=[stop, "zzzz"],
                               extra_body=GREEDY)
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == stop
    assert r.content[0].text == base[:base.index(stop)]
    r = claude.messages.create(model=MODEL, max_tokens=2, messages=USER, extra_body=GREEDY)
    assert r.stop_reason == "max_tokens" and r.usage.output_tokens == 2


def test_cache_read_tokens_on_a_repeated_prefix(claude):
    system = "You are a careful assistant. " * 12  # a few full KV blocks
    first = claude.messages.create(model=MODEL, max_tokens=2, system=system, messages=USER, extra_body=GREEDY)
    again = claude.messages.create(model=MODEL, max_tokens=2, system=[{"type": "text", "text": system}],
                                   messages=USER, extra_body=GREEDY)
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == total
    assert again.usage.cache_read_input_tokens >= 16 and again.usage.input_tokens < total


def test_tools_and_a_tool_round_trip_in_the_history(claude, server):
    plain = claude.messages.count_tokens(model=MODEL, messages=USER).input_tokens
    with_tool = claude.messages.count_tokens(model=MODEL, messages=USER, tools=[WEATHER]).input_tokens
    assert with_tool > plain + 20  # the tool's definition is in the prompt
    assert claude.messages.count_tokens(model=MODEL, messages=USER, tools=[WEATHER],
                                        tool_choice={"type": "none"}).input_tokens == plain
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               {"role": "assistant", "content": [
                   {"type": "text", "text": "Let me check."},
                   {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                             "content": [{"type": "text", "text": "18C and sunny"}]}]}]
    r = claude.messages.create(model=MODEL, max_tokens=16, messages=history, tools=[WEATHER], extra_body=GREEDY)
    assert r.content and r.content[0].type == "text" and r.stop_reason in ("end_turn", "max_tokens")
    wait_idle(server.base_url)


def test_an_assistant_turn_last_is_continued(claude, client):
    prefill = "The three colors are"
    r = claude.messages.create(model=MODEL, max_tokens=6, extra_body=GREEDY,
                               messages=[*USER, {"role": "assistant", "content": prefill}])
    whole = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=USER)
    if whole.choices[0].message.content.startswith(prefill):  # the oracle: greedy goes on the same way
        assert (prefill + r.content[0].text).startswith(whole.choices[0].message.content[:len(prefill) + 4])
    assert r.content[0].text and not r.content[0].text.startswith("<|im_start|>")


@pytest.mark.parametrize("body, status, kind, words", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400, "invalid_request_error",
     "image"),
    ({"max_tokens": None}, 400, "invalid_request_error", "max_tokens"),
    ({"model": "nope"}, 404, "not_found_error", "nope"),
    ({"tools": [{**WEATHER, "type": "web_search_20250305"}]}, 400, "invalid_request_error", "web_search"),
    ({"tool_choice": {"type": "tool", "name": "missing"}, "tools": [WEATHER]}, 400, "invalid_request_error",
     "missing"),
])
def test_errors_take_anthropics_shape(server, body, status, kind, words):
    full = {"model": MODEL, "max_tokens": 4, "messages": USER, **body}
    r = httpx.post(server.base_url + "/v1/messages", json={k: v for k, v in full.items() if v is not None})
    assert r.status_code == status
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == kind and words in err["error"]["message"]


def test_x_api_key(llm_engine):
    from lamina.server.app import build_app, make_state

    with serve_in_thread(build_app(make_state(llm_engine, [MODEL], "sk-test"))) as base:
        ok = anthropic.Anthropic(base_url=base, api_key="sk-test", max_retries=0, timeout=120)
        assert ok.messages.count_tokens(model=MODEL, messages=USER).input_tokens > 0
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.count_tokens(
                model=MODEL, messages=USER)
        assert e.value.body["error"]["type"] == "authentication_error"
        assert httpx.post(base + "/v1/chat/completions", headers={"x-api-key": "sk-test"},
                          json={"messages": USER, "max_tokens": 1}).status_code == 200


class _FakeStream:
    """A finished engine stream replaying cumulative outputs (the SDK parses what _stream makes of them)."""

    def __init__(self, texts: list[str], finish: str) -> None:
        self.outputs = [RequestOutput("r", None, [1, 2, 3], [CompletionOutput(0, t, list(range(i + 1)),
                                                                              finish_reason=None)], False)
                        for i, t in enumerate(texts)]
        self.outputs[-1].outputs[0].finish_reason = finish
        self.finished, self.request_id = True, "r"

    async def __aiter__(self):
        for out in self.outputs:
            yield out


def test_the_sdk_accumulates_thinking_and_tool_use_blocks():
    reply = ('<think>check the tool</think>\n\nSure.<tool_call>\n{"name": "get_weather", "arguments": '
             '{"city": "Oslo"}}\n</tool_call>')
    texts = [reply[:i] for i in range(3, len(reply), 5)] + [reply]

    async def run() -> bytes:
        gen = _stream(None, [_FakeStream(texts, "stop")], "msg_x", MODEL, 3,
                      OutputSplitter(reasoning=True, tools=True))
        return "".join([e async for e in gen]).encode()

    body = asyncio.run(run())
    import httpx2  # the transport layer the SDK is built on

    transport = httpx2.MockTransport(lambda _: httpx2.Response(200, content=body,
                                                                headers={"content-type": "text/event-stream"}))
    sdk = anthropic.Anthropic(base_url="http://fake", api_key="x", http_client=httpx2.Client(transport=transport))
    with sdk.messages.stream(model=MODEL, max_tokens=50, messages=USER) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["thinking", "text", "tool_use"]
    assert final.content[0].thinking == "check the tool" and final.content[1].text == "Sure."
    assert final.content[2].name == "get_weather" and final.content[2].input == {"city": "Oslo"}
    assert final.content[2].id.startswith("toolu_") and final.stop_reason == "tool_use"
