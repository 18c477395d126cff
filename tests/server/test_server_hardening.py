"""What a hostile or careless client sends to the shared `lamina serve`: one request's settings never fail
another, caps answer with a clear 400, tiny temperatures are greedy, a big body is a 413, docs stay off."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
from server_helpers import MODEL, raw_exchange, read_metrics, wait_idle


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c


@pytest.mark.parametrize("extra,param", [
    ({"top_k": 2**63}, "top_k"),
    ({"top_k": 10**6}, "top_k"),  # past the vocabulary
    ({"stop_token_ids": [10**8], "min_tokens": 1}, "stop_token_ids"),
    ({"seed": 2**64}, "seed"),
    ({"stop": [f"stop{i}" for i in range(1000)]}, "stop"),
    ({"stop": ["x" * 1000]}, "stop"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"n": 128, "prompt": ["a", "b", "c"]}, "n"),  # 384 sequences in one request
])
def test_bad_settings_are_400_and_do_not_touch_other_requests(server, http, extra, param):
    """A concurrent stream runs to its end while the bad requests come back 400, naming the field."""
    async def main() -> tuple[list[httpx.Response], str | None]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as c:
            async def stream() -> str | None:
                body = {"model": MODEL, "prompt": "Count:", "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                        "stream": True}
                finish = None
                async with c.stream("POST", "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            choice = json.loads(line[6:])["choices"][0]
                            finish = choice["finish_reason"] or finish
                return finish

            good = asyncio.ensure_future(stream())
            bad = [await c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 4, **extra})
                   for _ in range(3)]
            return bad, await good

    bad, finish = asyncio.run(main())
    for r in bad:
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    assert finish == "length"
    wait_idle(server.base_url)


def test_tiny_temperature_is_greedy(http):
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8}
    greedy = http.post("/v1/completions", json={**body, "temperature": 0}).json()["choices"][0]["text"]
    for t in (1e-40, 1e-6):
        assert http.post("/v1/completions", json={**body, "temperature": t}).json()["choices"][0]["text"] == greedy


def test_prompt_checks_are_the_engines(http):
    """Prompt length and vocabulary are checked once, by the engine; the server answers its ValueError with a
    400 on the prompt (or the messages)."""
    r = http.post("/v1/completions", json={"prompt": [5, 10**7]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "[0, 49152)" in r.text
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi " * 600}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages" and "max_model_len" in r.text


def test_body_over_the_limit_is_413_and_closes(server):
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 50000000\r\n\r\n{\"prompt\": \"")
        reply = s.recv(4096)
        assert reply.startswith(b"HTTP/1.1 413") and b"connection: close" in reply.lower()
        while s.recv(4096):  # the server closes the connection without reading the 50 MB
            pass
    r = httpx.post(server.api_url + "/completions", content=b'{"prompt": "' + b"a" * (5 * 2**20) + b'"}',
                   headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and "larger than" in r.json()["error"]["message"]
    assert read_metrics(server.base_url)["lamina:http_errors_total"] >= 2


def test_both_framings_is_400_and_closes(server):
    reply = raw_exchange(server.base_url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 400") and b"connection: close" in reply.lower()
    assert b"Transfer-Encoding" in reply


def test_docs_are_off_by_default(http):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert http.get(path).status_code == 404
    assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200


def test_disconnect_while_many_prompts_are_added_aborts_them(server):
    """8 prompts x n=32 (256 sequences, the cap); the client leaves once they are in the engine: all of it is
    aborted (nothing runs on, nothing finishes)."""
    before = wait_idle(server.base_url)
    body = {"model": MODEL, "prompt": [f"Story {i}:" for i in range(8)], "n": 32, "max_tokens": 300,
            "ignore_eos": True, "temperature": 1.0}

    async def main() -> None:
        async with httpx.AsyncClient(timeout=120) as c, httpx.AsyncClient(timeout=30) as probe:
            task = asyncio.ensure_future(c.post(server.api_url + "/completions", json=body))
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                text = (await probe.get(server.base_url + "/metrics")).text
                if "lamina:num_requests_running{" in text and _gauge(text, "lamina:num_requests_running") > 0:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("the request never started")
            task.cancel()  # closes the connection

    asyncio.run(main())
    t0 = time.monotonic()
    after = wait_idle(server.base_url, timeout=20)
    assert time.monotonic() - t0 < 20
    time.sleep(0.5)
    settled = read_metrics(server.base_url)
    assert settled["lamina:generation_tokens_total"] == after["lamina:generation_tokens_total"]  # nothing runs on
    assert after["lamina:request_success_total"] == before["lamina:request_success_total"]
    assert after["lamina:generation_tokens_total"] - before["lamina:generation_tokens_total"] < 256 * 300


def _gauge(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0
