"""Structured output, tool calls and logits controls through a real `lamina serve` with the official openai
client: JSON that validates (jsonschema), a required tool call round trip, named and streamed calls in
OpenAI's shapes, and the 400s for bad constraints and logit_bias."""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest
from server_helpers import start_server, stop_server

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "population", "coastal"],
          "properties": {"city": {"type": "string", "maxLength": 24}, "population": {"type": "integer"},
                         "coastal": {"type": "boolean"}}}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 24},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 16}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tool_server():
    srv = start_server(["--tool-call-parser", "hermes", "--enable-auto-tool-choice"])
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture
def oai(tool_server):
    return openai.OpenAI(base_url=tool_server.api_url, api_key="unused", max_retries=0, timeout=300)


def test_json_schema_validates_on_20_prompts(oai):
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}}

    def ask(i: int):
        return oai.chat.completions.create(
            model="smollm2-135m-instruct", max_tokens=60, temperature=0.9, seed=i, response_format=fmt,
            messages=[{"role": "user", "content": f"Tell me about city number {i} as JSON."}])

    with ThreadPoolExecutor(20) as pool:
        outs = list(pool.map(ask, range(20)))
    for out in outs:
        jsonschema.validate(json.loads(out.choices[0].message.content), SCHEMA)


def test_structured_outputs_regex_choice_on_completions(oai):
    out = oai.completions.create(model="smollm2-135m-instruct", prompt="The code is", max_tokens=12,
                                 temperature=1.0, n=3, extra_body={"structured_outputs": {"regex": r"[A-F]{4}-\d{2}"}})
    assert all(re.fullmatch(r"[A-F]{4}-\d{2}", c.text) for c in out.choices)
    out = oai.chat.completions.create(model="smollm2-135m-instruct", max_tokens=5, temperature=1.0,
                                      messages=[{"role": "user", "content": "Pick one."}],
                                      extra_body={"structured_outputs": {"choice": ["red", "green"]}})
    assert out.choices[0].message.content in ("red", "green")


def test_required_tool_call_round_trip(oai):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    out = oai.chat.completions.create(model="smollm2-135m-instruct", messages=messages, tools=[WEATHER, TIME],
                                      tool_choice="required", max_tokens=60, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id and call.function.name in ("get_weather", "get_time")
    params = (WEATHER if call.function.name == "get_weather" else TIME)["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), params)
    messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                 {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 18})}]
    answer = oai.chat.completions.create(model="smollm2-135m-instruct", messages=messages, tools=[WEATHER, TIME],
                                         max_tokens=30, temperature=0)
    assert answer.choices[0].message.content and answer.choices[0].finish_reason in ("stop", "length")


def test_auto_tool_choice_parses_hermes_calls(oai):
    """tool_choice auto with --tool-call-parser hermes: a regex makes the small model write a hermes call
    (it would rarely choose to), which comes back as a tool call, streamed and not."""
    call = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)"\}\}\n</tool_call>'
    kw = dict(model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Weather in Paris?"}],
              tools=[WEATHER], max_tokens=120, temperature=0, extra_body={"structured_outputs": {"regex": call}})
    choice = oai.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (tc,) = choice.message.tool_calls
    assert tc.function.name == "get_weather" and json.loads(tc.function.arguments)["city"] in ("Paris", "Oslo")
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    pieces = [t for c in chunks for ch in c.choices for t in (ch.delta.tool_calls or [])]
    assert pieces[0].function.name == "get_weather" and pieces[0].id
    assert "".join(p.function.arguments or "" for p in pieces) == tc.function.arguments
    assert not "".join(ch.delta.content or "" for c in chunks for ch in c.choices)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_named_tool_choice_streamed_like_openai(oai):
    stream = oai.chat.completions.create(
        model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60, temperature=0, stream=True)
    chunks = list(stream)
    pieces = [tc for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or [])]
    first = pieces[0]
    assert first.id and first.type == "function" and first.function.name == "get_weather"
    assert first.function.arguments == "" and all(p.id is None and p.function.name is None for p in pieces[1:])
    args = "".join(p.function.arguments for p in pieces[1:])
    jsonschema.validate(json.loads(args), WEATHER["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "stop"  # OpenAI keeps "stop" for a named choice
    whole = oai.chat.completions.create(
        model="smollm2-135m-instruct", messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=60, temperature=0)
    assert whole.choices[0].message.tool_calls[0].function.arguments == args


def test_required_streamed_arguments_add_up(oai):
    kw = dict(model="smollm2-135m-instruct", messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
              tools=[WEATHER, TIME], tool_choice="required", max_tokens=160, temperature=0,
              extra_body={"structured_outputs": None})
    first = oai.chat.completions.create(**kw).choices[0]
    whole = first.message.tool_calls
    assert whole, (first.finish_reason, first.message.content)
    chunks = list(oai.chat.completions.create(**kw, stream=True))
    calls: dict[int, list[str]] = {}
    for c in chunks:
        for ch in c.choices:
            for tc in ch.delta.tool_calls or []:
                if tc.id is not None:
                    calls[tc.index] = [tc.function.name, ""]
                calls[tc.index][1] += tc.function.arguments or ""
    assert [tuple(v) for _, v in sorted(calls.items())] == [(t.function.name, t.function.arguments) for t in whole]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_bad_requests_are_400s_with_the_reason(oai):
    def bad(match: str, **kw):
        with pytest.raises(openai.BadRequestError, match=match):
            oai.chat.completions.create(model="smollm2-135m-instruct", max_tokens=4,
                                        messages=[{"role": "user", "content": "hi"}], **kw)

    bad("Unsupported type", response_format={"type": "json_schema", "json_schema": {"name": "x",
                                                                                 "schema": {"type": "objekt"}}})
    bad("regex", extra_body={"structured_outputs": {"regex": "(ab"}})
    bad("grammar", extra_body={"structured_outputs": {"grammar": "root ::= nothing"}})
    bad("not in the vocabulary.*49152", logit_bias={"49152": 5})
    bad(r"\[-100, 100\]", logit_bias={"10": 150})
    bad("allowed_token_ids", extra_body={"allowed_token_ids": [-1]})
    bad("not among the tools", tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}})
    bad("tool_choice needs tools", tool_choice="required")
    bad("one output constraint", tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"})


def test_logits_controls(oai):
    kw = dict(model="smollm2-135m-instruct", prompt="Hello", max_tokens=6, temperature=0)
    out = oai.completions.create(**kw, logit_bias={"45": 100})  # token 45 is "="
    assert out.choices[0].text == "=" * 6
    out = oai.completions.create(**kw, extra_body={"allowed_token_ids": [49, 50]})  # "A", "B"
    assert len(out.choices[0].text) == 6 and set(out.choices[0].text) <= {"A", "B"}
    plain = oai.completions.create(model="smollm2-135m-instruct", prompt="The capital of France is", max_tokens=8,
                                   temperature=0).choices[0].text
    assert "Paris" in plain
    banned = oai.completions.create(model="smollm2-135m-instruct", prompt="The capital of France is", max_tokens=8,
                                    temperature=0, extra_body={"bad_words": ["Paris"]}).choices[0].text
    assert "Paris" not in banned


def test_the_readmes_serve_snippets_run(tool_server, capsys):
    """The README's Python under "Serve" against a server started as it says (tool parser, auto choice):
    every snippet runs as written, and the forced calls it prints match their schemas."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    section = readme.split("## Serve", 1)[1].split("\n## ", 1)[0]
    code = "\n".join(re.findall(r"```python\n(.*?)```", section, flags=re.S))
    assert "anthropic.Anthropic" in code and "tool_choice" in code and "json_schema" in code
    scope: dict = {}
    exec(compile(code.replace("http://127.0.0.1:8000", tool_server.base_url), "README.md", "exec"), scope)
    weather = scope["weather"]["function"]["parameters"]
    jsonschema.validate(json.loads(scope["call"].arguments), weather)
    jsonschema.validate(scope["use"].input, weather)
    if scope["reply"].status == "completed":  # sampled: 64 tokens may cut the JSON short
        jsonschema.validate(json.loads(scope["reply"].output_text), scope["schema"])
    if scope["msg"].stop_reason == "end_turn":
        jsonschema.validate(json.loads(scope["msg"].content[0].text), scope["schema"])
    assert capsys.readouterr().out
