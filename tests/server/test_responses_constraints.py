"""Forced tool choice and structured output (text.format) on OpenAI's Responses API, through the official
`openai` SDK's client.responses against a real `lamina serve` on the built-in SmolLM2.

Oracles: jsonschema on every call's arguments and every JSON reply (the constraint guarantees them, not the
model), the typed event order as OpenAI documents it, the SDK's own stream accumulation and parse helpers,
the non-streamed reply to the same greedy request, and the KV pool counted idle afterwards.
"""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field
from server_helpers import MODEL, wait_idle

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather of a city", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city"],
    "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}
TIME = {"type": "function", "name": "get_time", "description": "The time in a zone", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"],
    "properties": {"zone": {"type": "string", "maxLength": 16}}}}
SCHEMAS = {t["name"]: t["parameters"] for t in (WEATHER, TIME)}
ASK = "What is the weather in Paris, and the time in Tokyo?"
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "population", "coastal"],
        "properties": {"city": {"type": "string", "maxLength": 24}, "population": {"type": "integer"},
                       "coastal": {"type": "boolean"}}}


def _calls(r) -> list:
    return [i for i in r.output if i.type == "function_call"]


def test_required_tool_choice_is_enforced(client, server):
    def ask(i: int):
        return client.responses.create(model=MODEL, input=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       parallel_tool_calls=False, max_output_tokens=80, temperature=1.0,
                                       top_p=0.9 + i / 100)

    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(ask, range(6)))
    for r in outs:
        (call,) = _calls(r)  # one call: parallel calls switched off
        assert r.status == "completed" and call.call_id.startswith("call_") and call.name in SCHEMAS
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    greedy = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                     max_output_tokens=120, temperature=0)
    assert greedy.status == "completed" and _calls(greedy)
    for call in _calls(greedy):
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    wait_idle(server.base_url)


def test_named_tool_choice_is_enforced_and_round_trips(client, server):
    def ask(i: int):
        return client.responses.create(model=MODEL, input=ASK, tools=[WEATHER, TIME], max_output_tokens=60,
                                       tool_choice={"type": "function", "name": "get_weather"}, temperature=1.0,
                                       top_p=0.9 + i / 100)

    with ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(ask, range(6)))
    for r in outs:
        (call,) = _calls(r)
        assert [i.type for i in r.output] == ["function_call"] and call.name == "get_weather"
        jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    call = _calls(outs[0])[0]
    follow = client.responses.create(model=MODEL, tools=[WEATHER, TIME], max_output_tokens=16, temperature=0, input=[
        {"role": "user", "content": ASK}, call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "18C and sunny"}])
    assert follow.output and follow.output[0].type == "message"
    wait_idle(server.base_url)


def test_forced_call_streams_its_arguments(client, server):
    kw = dict(model=MODEL, input=ASK, tools=[WEATHER, TIME], max_output_tokens=60, temperature=0,
              tool_choice={"type": "function", "name": "get_time"})
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"} and len(kinds) > 7  # in fragments
    assert [e.sequence_number for e in events] == list(range(len(events)))
    added = events[2].item
    assert added.type == "function_call" and added.name == "get_time" and added.arguments == ""
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert events[-3].arguments == args and events[-2].item.arguments == args
    assert all(e.item_id == added.id for e in events[3:-2])
    whole = client.responses.create(**kw)
    assert _calls(whole)[0].arguments == args
    jsonschema.validate(json.loads(args), TIME["parameters"])
    with client.responses.stream(**kw) as s:
        for _ in s:
            pass
        final = s.get_final_response()
    assert [i.type for i in final.output] == ["function_call"] and final.output[0].arguments == args
    wait_idle(server.base_url)


def test_text_format_json_schema_validates(client, server):
    fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}

    def ask(i: int):
        return client.responses.create(model=MODEL, input=f"Describe city number {i} as JSON.", text={"format": fmt},
                                       max_output_tokens=60, temperature=0.9)

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(ask, range(8)))
    for r in outs:
        assert r.status == "completed" and r.text.format.type == "json_schema"
        jsonschema.validate(json.loads(r.output_text), CITY)
    obj = client.responses.create(model=MODEL, input=ASK, text={"format": {"type": "json_object"}},
                                  max_output_tokens=60, temperature=0)
    if obj.status == "completed":  # any object: the model decides when it ends
        assert isinstance(json.loads(obj.output_text), dict)
    streamed = list(client.responses.create(model=MODEL, input="Describe city number 0 as JSON.", stream=True,
                                            text={"format": fmt}, max_output_tokens=60, temperature=0))
    jsonschema.validate(json.loads("".join(e.delta for e in streamed if e.type == "response.output_text.delta")),
                        CITY)
    wait_idle(server.base_url)


class City(BaseModel):
    name: str = Field(max_length=20)
    coastal: bool


def test_the_sdks_parse_helper(client):
    r = client.responses.parse(model=MODEL, input=ASK, text_format=City, max_output_tokens=40, temperature=0)
    assert isinstance(r.output_parsed, City)
    with client.responses.stream(model=MODEL, input=ASK, text_format=City, max_output_tokens=40,
                                 temperature=0) as s:
        for _ in s:
            pass
        assert s.get_final_response().output_parsed == r.output_parsed


@pytest.mark.parametrize("body, param", [
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object", "properties": {
        "a": {"type": "nope"}}}}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": []}}}, "text.format.schema"),
    ({"text": {"format": {"type": "json_schema", "schema": CITY}}}, "text.format.name"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
    ({"tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "text.format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
])
def test_bad_constraints_are_400s(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, **{"input": ASK, "max_output_tokens": 2, **body})
    assert e.value.body["param"] == param
