"""Bad input gets an OpenAI-shaped 4xx, never reaches the engine, and never takes the server down."""
from __future__ import annotations

import httpx
import pytest
from server_helpers import MAX_MODEL_LEN, MODEL, read_metrics, wait_idle

MSG = [{"role": "user", "content": "hi"}]
LONG = "hello " * (MAX_MODEL_LEN + 10)  # one token per word, plus BOS-free tokenizer: over the limit

# (name, path, body (dict or raw bytes), expected status, expected error param or None)
CASES = [
    ("invalid json", "/v1/completions", b'{"prompt": "x",', 400, None),
    ("not an object", "/v1/completions", b'["x"]', 400, None),
    ("empty body", "/v1/completions", b"", 400, None),
    ("missing prompt", "/v1/completions", {"max_tokens": 2}, 400, "prompt"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("empty prompt list", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("empty token list", "/v1/completions", {"prompt": [[]]}, 400, "prompt"),
    ("prompt wrong type", "/v1/completions", {"prompt": 5}, 400, None),
    ("token id out of vocab", "/v1/completions", {"prompt": [1, 99999999]}, 400, "prompt"),
    ("negative token id", "/v1/completions", {"prompt": [-1]}, 400, "prompt"),
    ("prompt too long", "/v1/completions", {"prompt": LONG}, 400, "prompt"),
    ("max_tokens past context", "/v1/completions", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN}, 400, "max_tokens"),
    ("max_tokens string", "/v1/completions", {"prompt": "x", "max_tokens": "ten"}, 400, "max_tokens"),
    ("max_tokens zero", "/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ("max_tokens negative", "/v1/completions", {"prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
    ("temperature negative", "/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("temperature string", "/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("temperature NaN", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', 400, None),
    ("top_p zero", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top_p above one", "/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("n zero", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("n string", "/v1/completions", {"prompt": "x", "n": "two"}, 400, "n"),
    ("logprobs too many", "/v1/completions", {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("presence_penalty range", "/v1/completions", {"prompt": "x", "presence_penalty": 5}, 400, "presence_penalty"),
    ("stop wrong type", "/v1/completions", {"prompt": "x", "stop": 5}, 400, None),
    ("stop empty string", "/v1/completions", {"prompt": "x", "stop": [""]}, 400, None),
    ("top_k string", "/v1/completions", {"prompt": "x", "top_k": "many"}, 400, "top_k"),
    ("min_p range", "/v1/completions", {"prompt": "x", "min_p": 2}, 400, "min_p"),
    ("repetition_penalty zero", "/v1/completions", {"prompt": "x", "repetition_penalty": 0}, 400, None),
    ("seed string", "/v1/completions", {"prompt": "x", "seed": "abc"}, 400, "seed"),
    ("stream_options without stream", "/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}},
     400, "stream_options"),
    ("logit_bias out of vocab", "/v1/completions", {"prompt": "x", "logit_bias": {"99999": 5}}, 400, "logit_bias"),
    ("logit_bias out of range", "/v1/completions", {"prompt": "x", "logit_bias": {"1": 101}}, 400, "logit_bias"),
    ("bad regex", "/v1/completions", {"prompt": "x", "structured_outputs": {"regex": "(a"}}, 400,
     "structured_outputs"),
    ("chat bad response_format", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                          "response_format": {"type": "xml"}}, 400, "response_format"),
    ("chat auto tools without a parser", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "f"}}]},
     400, "tool_choice"),
    ("unknown model", "/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "model"),
    ("chat no messages", "/v1/chat/completions", {"max_tokens": 2}, 400, "messages"),
    ("chat empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("chat messages string", "/v1/chat/completions", {"messages": "hello"}, 400, "messages"),
    ("chat message without role", "/v1/chat/completions", {"messages": [{"content": "x"}]}, 400, None),
    # (An unknown role is no longer a 400: the template renders or refuses it, as in vLLM; issue #16 and
    # test_vllm_extensions.py.)
    ("chat content number", "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, None),
    ("chat image part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages"),
    ("chat too long", "/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    ("chat top_logprobs without logprobs", "/v1/chat/completions", {"messages": MSG, "top_logprobs": 2}, 400,
     "top_logprobs"),
    ("chat top_logprobs too many", "/v1/chat/completions", {"messages": MSG, "logprobs": True, "top_logprobs": 30},
     400, "top_logprobs"),
    ("chat max_completion_tokens zero", "/v1/chat/completions", {"messages": MSG, "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("chat tools", "/v1/chat/completions", {"messages": MSG, "tools": [{"type": "function"}]}, 400, "tools"),
    ("chat unknown model", "/v1/chat/completions", {"messages": MSG, "model": "nope"}, 404, "model"),
    ("tokenize nothing", "/tokenize", {}, 400, None),
    ("detokenize strings", "/detokenize", {"tokens": ["a"]}, 400, None),
    ("detokenize out of vocab", "/detokenize", {"tokens": [-5]}, 400, "tokens"),
]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


@pytest.mark.parametrize("name,path,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_input(http, server, name, path, body, status, param):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if param is not None:
        assert err["param"] == param
    assert http.get("/health").status_code == 200


def test_unknown_route_and_method(http):
    r = http.get("/v1/nothing-here")
    assert r.status_code == 404 and "message" in r.json()["error"]
    r = http.get("/v1/completions")
    assert r.status_code == 405 and "message" in r.json()["error"]


def test_bad_input_never_reached_the_engine(http, server):
    """After the whole table: no prompt was processed for a bad request and the server still serves."""
    before = wait_idle(server.base_url)
    for _, path, body, _, _ in CASES:
        if isinstance(body, dict):
            http.post(path, json=body)
    after = read_metrics(server.base_url)
    assert after["lamina:prompt_tokens_total"] == before["lamina:prompt_tokens_total"]
    assert after["lamina:request_success_total"] == before["lamina:request_success_total"]
    r = http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    wait_idle(server.base_url)
