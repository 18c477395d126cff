"""OpenAI's Responses API through the official `openai` SDK's client.responses against a real server.

Oracles: the chat endpoint of the same server (same template and greedy tokens; a follow-up's prompt equals
the whole conversation sent to chat), the typed event order as OpenAI documents it, the store's LRU bound,
and the KV pool counted idle afterwards.
"""
from __future__ import annotations

import asyncio
import json

import openai
import pytest
from server_helpers import MODEL, serve_in_thread, wait_idle

from lamina.outputs import CompletionOutput, RequestOutput
from lamina.server.agent_output import OutputSplitter
from lamina.server.response_store import ResponseStore
from lamina.server.responses_api import _Run, _stream
from lamina.server.responses_protocol import ResponsesRequest

Q = "Name three colors."
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather of a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_reply_matches_the_chat_endpoint(client, server):
    r = client.responses.create(model=MODEL, input=Q, instructions="Be brief.", max_output_tokens=12, temperature=0)
    chat = client.chat.completions.create(model=MODEL, max_tokens=12, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": Q}])
    assert r.object == "response" and r.id.startswith("resp_") and r.output_text == chat.choices[0].message.content
    assert [i.type for i in r.output] == ["message"] and r.output[0].role == "assistant"
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if chat.choices[0].finish_reason == "length":
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    else:
        assert r.status == "completed" and r.incomplete_details is None
    assert r.store is False  # this server keeps nothing (no --responses-store-size)
    wait_idle(server.base_url)


def test_stream_events_in_order(client, server):
    full = client.responses.create(model=MODEL, input=Q, max_output_tokens=40, temperature=0)
    events = list(client.responses.create(model=MODEL, input=Q, max_output_tokens=40, temperature=0, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if full.status == "incomplete" else "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == full.output_text == events[-4].text
    assert events[-1].response.output_text == text
    assert events[-1].response.usage.output_tokens == full.usage.output_tokens
    # The SDK's accumulating helper (it expects response.completed: the greedy reply ends before 40 tokens).
    assert full.status == "completed"
    with client.responses.stream(model=MODEL, input=Q, max_output_tokens=40, temperature=0) as s:
        for _ in s:
            pass
        assert s.get_final_response().output_text == text
    wait_idle(server.base_url)


def test_stateless_by_default(client, server):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model=MODEL, input=Q, previous_response_id="resp_nope", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_nope")


def test_function_call_items_and_tools(client):
    base = client.responses.create(model=MODEL, input=Q, max_output_tokens=1).usage.input_tokens
    with_tool = client.responses.create(model=MODEL, input=Q, tools=[WEATHER], max_output_tokens=1)
    assert with_tool.usage.input_tokens > base + 20  # the definition is in the prompt
    none = client.responses.create(model=MODEL, input=Q, tools=[WEATHER], tool_choice="none", max_output_tokens=1)
    assert none.usage.input_tokens == base
    r = client.responses.create(model=MODEL, tools=[WEATHER], max_output_tokens=8, temperature=0, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "ask"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18C and sunny"}])
    assert r.output and r.usage.input_tokens > with_tool.usage.input_tokens


@pytest.mark.parametrize("body, words", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "text only"),
    ({"tools": [{"type": "web_search"}]}, "web_search"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format"),  # json_schema and json_object: constraints
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]}, "not valid JSON"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
def test_bad_requests(client, body, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, **{"input": Q, "max_output_tokens": 2, **body})
    assert words in e.value.body["message"]


def test_previous_response_id_and_the_bounded_store(llm_engine):
    from lamina.server.app import ServerOptions, build_app, make_state

    app = build_app(make_state(llm_engine, [MODEL]), ServerOptions(responses_store_size=2))
    with serve_in_thread(app) as base:
        c = openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=120)
        first = c.responses.create(model=MODEL, input=Q, max_output_tokens=6, temperature=0)
        assert first.store is True and c.responses.retrieve(first.id).output_text == first.output_text
        follow = c.responses.create(model=MODEL, input="Two more?", previous_response_id=first.id,
                                    max_output_tokens=4, temperature=0)
        chat = c.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
            {"role": "user", "content": Q}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Two more?"}])
        assert follow.usage.input_tokens == chat.usage.prompt_tokens  # the history went into the prompt
        assert follow.output_text == chat.choices[0].message.content
        assert follow.previous_response_id == first.id
        unstored = c.responses.create(model=MODEL, input=Q, max_output_tokens=1, store=False)
        assert unstored.store is False
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(unstored.id)
        c.responses.create(model=MODEL, input=Q, max_output_tokens=1)  # a third stored: the oldest goes
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(first.id)
        c.responses.delete(follow.id)
        with pytest.raises(openai.NotFoundError):
            c.responses.retrieve(follow.id)


def test_store_bound():
    s = ResponseStore(2)
    for k in "abc":
        s.put(k, k)  # type: ignore[arg-type]
    assert s.get("a") is None and len(s) == 2
    s.get("b")
    s.put("d", "d")  # type: ignore[arg-type]
    assert s.get("c") is None and s.get("b") == "b"
    assert len(ResponseStore(0)) == 0 and not ResponseStore(0).enabled


class _FakeState:
    model_name = MODEL

    @staticmethod
    def tokenizer(text, add_special_tokens=False):
        return type("Enc", (), {"input_ids": text.split()})


class _FakeStream:
    def __init__(self, texts: list[str]) -> None:
        self.outputs = [RequestOutput("r", None, [1], [CompletionOutput(0, t, list(range(i + 1)))], False)
                        for i, t in enumerate(texts)]
        self.outputs[-1].outputs[0].finish_reason = "stop"
        self.finished, self.request_id = True, "r"

    async def __aiter__(self):
        for out in self.outputs:
            yield out


def test_the_sdk_accumulates_reasoning_and_function_calls():
    reply = ('<think>use the tool</think>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
             '</tool_call>')
    texts = [reply[:i] for i in range(4, len(reply), 6)] + [reply]
    run = _Run(ResponsesRequest(input=Q, tools=[WEATHER]), _FakeState(), ResponseStore(0), [], 5)

    async def body() -> bytes:
        gen = _stream(run, [_FakeStream(texts)], OutputSplitter(reasoning=True, tools=True))
        return "".join([e async for e in gen]).encode()

    data = asyncio.run(body())
    import httpx2  # the transport layer the SDK is built on

    transport = httpx2.MockTransport(lambda _: httpx2.Response(200, content=data,
                                                                headers={"content-type": "text/event-stream"}))
    sdk = openai.OpenAI(base_url="http://fake/v1", api_key="x", http_client=httpx2.Client(transport=transport))
    with sdk.responses.stream(model=MODEL, input=Q) as s:
        for _ in s:
            pass
        final = s.get_final_response()
    assert [i.type for i in final.output] == ["reasoning", "function_call"]
    assert final.output[0].content[0].text == "use the tool"
    call = final.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    assert call.call_id.startswith("call_") and final.status == "completed"
