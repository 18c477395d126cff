"""Forced tool use and structured outputs on Anthropic's Messages API, through the official `anthropic` SDK
against a real `lamina serve` (the built-in SmolLM2, which would rarely call a tool by itself).

Oracles: jsonschema on every tool input and JSON reply (the constraint, not the model, guarantees them), the
raw SSE events as Anthropic documents them, the SDK's own accumulation of the stream, the non-streamed reply
to the same greedy request, and the KV pool counted idle afterwards.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field
from server_helpers import MODEL, wait_idle

WEATHER = {"name": "get_weather", "description": "The weather of a city", "input_schema": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}
TIME = {"name": "get_time", "description": "The time in a zone", "input_schema": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"type": "string", "maxLength": 16}}}}
SCHEMAS = {t["name"]: t["input_schema"] for t in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "population", "coastal"],
        "properties": {"city": {"type": "string", "maxLength": 24}, "population": {"type": "integer"},
                       "coastal": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


def _uses(msg) -> list:
    return [b for b in msg.content if b.type == "tool_use"]


def _events(server, body: dict) -> list[dict]:
    with httpx.stream("POST", server.base_url + "/v1/messages", json={**body, "stream": True}, timeout=300) as r:
        assert r.status_code == 200
        text = "".join(r.iter_text())
    return [json.loads(frame.split("\n", 1)[1][len("data: "):]) for frame in text.strip().split("\n\n")]


def test_any_tool_choice_is_enforced(claude, server):
    def ask(i: int):
        return claude.messages.create(model=MODEL, max_tokens=80, messages=ASK, tools=[WEATHER, TIME],
                                      tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                      extra_body={"temperature": 1.0, "top_k": 50 + i})

    with ThreadPoolExecutor(6) as pool:
        msgs = list(pool.map(ask, range(6)))
    for msg in msgs:
        (use,) = _uses(msg)  # one call: parallel use switched off
        assert msg.stop_reason == "tool_use" and use.id.startswith("toolu_") and use.name in SCHEMAS
        jsonschema.validate(use.input, SCHEMAS[use.name])
    greedy = claude.messages.create(model=MODEL, max_tokens=120, messages=ASK, tools=[WEATHER, TIME],
                                    tool_choice={"type": "any"}, extra_body={"temperature": 0})
    assert greedy.stop_reason == "tool_use" and _uses(greedy)
    for use in _uses(greedy):
        jsonschema.validate(use.input, SCHEMAS[use.name])
    wait_idle(server.base_url)


def test_named_tool_choice_is_enforced_and_round_trips(claude, server):
    def ask(i: int):
        return claude.messages.create(model=MODEL, max_tokens=60, messages=ASK, tools=[WEATHER, TIME],
                                      tool_choice={"type": "tool", "name": "get_time"},
                                      extra_body={"temperature": 1.0, "top_k": 40 + i})

    with ThreadPoolExecutor(6) as pool:
        msgs = list(pool.map(ask, range(6)))
    for msg in msgs:
        (use,) = _uses(msg)
        assert msg.stop_reason == "tool_use" and use.name == "get_time"
        jsonschema.validate(use.input, TIME["input_schema"])
    use = _uses(msgs[0])[0]
    history = [*ASK, {"role": "assistant", "content": [u.model_dump() for u in msgs[0].content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "09:30"}]}]
    answer = claude.messages.create(model=MODEL, max_tokens=20, messages=history, tools=[WEATHER, TIME],
                                    extra_body={"temperature": 0})
    assert answer.content and answer.content[0].type == "text" and answer.stop_reason in ("end_turn", "max_tokens")
    wait_idle(server.base_url)


def test_forced_call_streams_its_input_in_fragments(claude, server):
    body = {"model": MODEL, "max_tokens": 60, "messages": ASK, "tools": [WEATHER, TIME],
            "tool_choice": {"type": "tool", "name": "get_weather"}, "temperature": 0}
    events = _events(server, body)
    kinds = [e["type"] for e in events]
    assert kinds[:3] == ["message_start", "ping", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = events[2]["content_block"]
    assert start["type"] == "tool_use" and start["name"] == "get_weather" and start["input"] == {}
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    assert all(d["type"] == "input_json_delta" for d in deltas) and len(deltas) > 1  # streamed, not at the end
    streamed = json.loads("".join(d["partial_json"] for d in deltas))
    assert events[-2]["delta"]["stop_reason"] == "tool_use"
    whole = claude.messages.create(extra_body={"temperature": 0}, **{k: v for k, v in body.items()
                                                                      if k != "temperature"})
    assert _uses(whole)[0].input == streamed
    jsonschema.validate(streamed, WEATHER["input_schema"])
    with claude.messages.stream(extra_body={"temperature": 0},
                                **{k: v for k, v in body.items() if k != "temperature"}) as s:
        final = s.get_final_message()
    assert [b.type for b in final.content] == ["tool_use"] and final.content[0].input == streamed
    wait_idle(server.base_url)


def test_output_config_format_validates(claude, server):
    fmt = {"type": "json_schema", "schema": CITY}

    def ask(i: int):
        return claude.messages.create(model=MODEL, max_tokens=60, output_config={"format": fmt},
                                      messages=[{"role": "user", "content": f"Describe city number {i} as JSON."}],
                                      extra_body={"temperature": 0.9})

    with ThreadPoolExecutor(8) as pool:
        msgs = list(pool.map(ask, range(8)))
    for msg in msgs:
        assert [b.type for b in msg.content] == ["text"] and msg.stop_reason == "end_turn"
        jsonschema.validate(json.loads(msg.content[0].text), CITY)
    beta = claude.messages.create(model=MODEL, max_tokens=60, messages=ASK, extra_body={
        "temperature": 0, "output_format": fmt})  # the structured-outputs beta's field
    jsonschema.validate(json.loads(beta.content[0].text), CITY)
    wait_idle(server.base_url)


class City(BaseModel):
    name: str = Field(max_length=20)
    coastal: bool


def test_the_sdks_parse_helper(claude):
    msg = claude.messages.parse(model=MODEL, max_tokens=40, output_format=City, messages=ASK,
                                extra_body={"temperature": 0})
    assert isinstance(msg.parsed_output, City)
    with claude.messages.stream(model=MODEL, max_tokens=40, output_format=City, messages=ASK,
                                extra_body={"temperature": 0}) as s:
        assert s.get_final_message().parsed_output == msg.parsed_output


@pytest.mark.parametrize("extra, words", [
    ({"output_config": {"format": {"type": "json_schema", "schema": {"type": "object", "properties": {
        "a": {"type": "nope"}}}}}}, "output_config.format.schema"),
    ({"output_config": {"format": {"type": "json_schema", "schema": "x"}}}, "schema"),
    ({"output_format": {"type": "xml"}}, "json_schema"),
    ({"tools": [WEATHER], "tool_choice": {"type": "any"}, "thinking": {"type": "enabled", "budget_tokens": 1024}},
     "thinking"),
    ({"tools": [WEATHER], "tool_choice": {"type": "any"},
      "output_config": {"format": {"type": "json_schema", "schema": CITY}}}, "one output constraint"),
])
def test_bad_constraints_are_400s_in_anthropics_shape(server, extra, words):
    r = httpx.post(server.base_url + "/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": ASK, **extra})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert words in err["error"]["message"]
    count = httpx.post(server.base_url + "/v1/messages/count_tokens", json={"model": MODEL, "messages": ASK, **extra})
    assert count.status_code == 400 and count.json()["type"] == "error"
