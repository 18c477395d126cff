"""Server edges on a second `lamina serve`: a model without a tokenizer (random: preset), short header and
body timeouts, the docs switched on, and sampling defaults from --generation-config."""
from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from server_helpers import MODEL, raw_exchange, serve_in_thread, start_server, stop_server

from lamina.server.app import ServerOptions, build_app, make_state


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    gen = tmp_path_factory.mktemp("genconfig")
    (gen / "generation_config.json").write_text(json.dumps({"max_new_tokens": 2, "temperature": 0.0}))
    srv = start_server(["--header-timeout", "1", "--body-timeout", "1", "--enable-docs",
                        "--generation-config", str(gen)], model="random:tiny-llama")
    try:
        yield srv
    finally:
        stop_server(srv)


def _address(srv) -> tuple[str, int]:
    host, port = srv.base_url.removeprefix("http://").split(":")
    return host, int(port)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hello"}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 3], "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ("/tokenize", {"prompt": "hello"}, "prompt"),
    ("/detokenize", {"tokens": [1, 2]}, "tokens"),
])
def test_no_tokenizer_is_a_400_saying_to_send_ids(edge, path, body, param):
    r = httpx.post(edge.base_url + path, json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "token ids" in err["message"] and err["param"] == param


def test_token_ids_work_and_take_the_generation_config_default(edge):
    r = httpx.post(edge.api_url + "/completions", json={"prompt": [1, 2, 3]}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2  # max_new_tokens, not 16
    r = httpx.post(edge.api_url + "/completions", json={"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True},
                   timeout=60)
    assert r.json()["usage"]["completion_tokens"] == 3  # the request's own value wins


def test_half_a_request_line_is_closed(edge):
    _check_half_requests_closed(edge)


def test_half_a_request_line_is_closed_by_h11_too():
    srv = start_server(["--header-timeout", "1", "--http", "h11"], model="random:tiny-llama")
    try:
        _check_half_requests_closed(srv)
    finally:
        stop_server(srv)


def _check_half_requests_closed(edge):
    socks = [socket.create_connection(_address(edge), timeout=10) for _ in range(20)]
    start = time.monotonic()
    for i, s in enumerate(socks):
        if i % 2:
            s.sendall(b"GET /heal")  # half a request line; the others send nothing at all
    for s in socks:
        assert s.recv(100) == b""  # closed by the server
        s.close()
    assert time.monotonic() - start < 8
    assert httpx.get(edge.base_url + "/health", timeout=10).status_code == 200


def test_a_stalled_body_is_408(edge):
    reply = raw_exchange(edge.base_url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                         b"\r\nContent-Length: 100\r\n\r\n{\"prom", timeout=10)
    assert reply.startswith(b"HTTP/1.1 408") and b"connection: close" in reply.lower()


def test_docs_when_asked_for(edge):
    assert httpx.get(edge.base_url + "/docs", timeout=10).status_code == 200
    spec = httpx.get(edge.base_url + "/openapi.json", timeout=10).json()
    assert "/v1/completions" in spec["paths"]


def test_docs_behind_the_api_key(llm_engine):
    app = build_app(make_state(llm_engine, [MODEL], "sk-docs"), ServerOptions(enable_docs=True))
    with serve_in_thread(app) as base:
        assert httpx.get(base + "/openapi.json", timeout=10).status_code == 401
        r = httpx.get(base + "/openapi.json", headers={"Authorization": "Bearer sk-docs"}, timeout=10)
        assert r.status_code == 200 and "/v1/chat/completions" in r.json()["paths"]
        assert httpx.get(base + "/health", timeout=10).status_code == 200
