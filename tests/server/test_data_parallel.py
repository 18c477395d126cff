"""`lamina serve --data-parallel-size 2`: two engine core processes behind one server, with the official
openai client.

Oracle: the session's DP=1 server (conftest.py) on the same model and settings: greedy outputs identical.
Routing is read from the per-replica series of /metrics. One DP=2 server for the module; the last test kills
one of its replicas.
"""
from __future__ import annotations

import os
import re
import signal
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import MODEL, start_server, stop_server, wait_idle

WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa "
         "quebec romeo sierra tango uniform victor whiskey xray yankee zulu").split()


def _text(seed: int, n: int = 40) -> str:
    """A prompt of well over one 16-token block, distinct per seed from its first words on."""
    return " ".join(WORDS[(seed * 7 + k * (seed + 3)) % len(WORDS)] for k in range(n))


@pytest.fixture(scope="module")
def dp_server():
    srv = start_server(["--data-parallel-size", "2", "--enable-prompt-tokens-details"], verbose=True)
    try:
        yield srv
    finally:
        stop_server(srv)


@pytest.fixture(scope="module")
def dp_client(dp_server):
    return openai.OpenAI(base_url=dp_server.api_url, api_key="unused", max_retries=0, timeout=120)


def _by_replica(base_url: str, name: str) -> dict[str, float]:
    text = httpx.get(base_url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                out[s.labels["replica"]] = s.value
    return out


def _pids(server) -> dict[int, int]:
    return {int(i): int(p) for i, p in re.findall(r"data-parallel replica (\d+): engine core pid (\d+)", server.log())}


def _wait_running(base_url: str, timeout: float = 60.0) -> str:
    """The replica running a request (the first one seen)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for replica, n in _by_replica(base_url, "lamina:dp_num_requests_running").items():
            if n > 0:
                return replica
        time.sleep(0.05)
    raise AssertionError("no replica reported a running request")


def test_outputs_equal_dp1(client, dp_client):
    for seed in range(3):
        kw = dict(model=MODEL, prompt=_text(seed, 12), max_tokens=12, temperature=0, logprobs=2)
        one = client.completions.create(**kw).choices[0]
        two = dp_client.completions.create(**kw).choices[0]
        assert two.text == one.text and two.logprobs.tokens == one.logprobs.tokens
        for a, b in zip(one.logprobs.token_logprobs, two.logprobs.token_logprobs):
            assert abs(a - b) < 1e-4
    chat = [{"role": "user", "content": "Name three colours."}]
    a = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=10, temperature=0)
    b = dp_client.chat.completions.create(model=MODEL, messages=chat, max_tokens=10, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content


def test_both_replicas_serve_and_prefix_routing(server, dp_server, dp_client):
    base = dp_server.base_url
    routed0 = _by_replica(base, "lamina:dp_requests_routed_total")
    by_prefix0 = sum(_by_replica(base, "lamina:dp_prefix_routed_total").values())
    a, b = _text(10), _text(11)
    for prompt in (a, b, b, a):  # idle server: a and b go round robin, their repeats follow their prefix
        dp_client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    routed = _by_replica(base, "lamina:dp_requests_routed_total")
    assert {r: routed[r] - routed0[r] for r in routed} == {"0": 2.0, "1": 2.0}
    assert sum(_by_replica(base, "lamina:dp_prefix_routed_total").values()) - by_prefix0 == 2
    usage = dp_client.completions.create(model=MODEL, prompt=a, max_tokens=1, temperature=0).usage
    assert usage.prompt_tokens_details.cached_tokens >= 16  # served where its blocks are cached
    m = wait_idle(base)  # the server's gauges are the replicas' sums
    assert m["lamina:kv_cache_total_blocks"] == 2 * wait_idle(server.base_url)["lamina:kv_cache_total_blocks"]
    assert m["lamina:request_success_total"] >= 5


def test_abort_of_a_stream_reaches_its_replica(dp_server, dp_client):
    base = dp_server.base_url
    stream = dp_client.completions.create(model=MODEL, prompt=_text(20), max_tokens=400, temperature=0,
                                          stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    for _ in range(3):
        next(it)
    replica = _wait_running(base)
    t0 = time.monotonic()
    stream.close()
    deadline = time.monotonic() + 20
    while _by_replica(base, "lamina:dp_num_requests_running")[replica] > 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _by_replica(base, "lamina:dp_num_requests_running")[replica] == 0
    assert time.monotonic() - t0 < 20
    wait_idle(base)  # every block of both replicas is back


def test_killed_replica_fails_its_requests_and_health(dp_server, dp_client):
    """Last in the module: the server keeps answering, /health turns 503, the survivor still serves."""
    base = dp_server.base_url
    pids = _pids(dp_server)
    assert set(pids) == {0, 1}, dp_server.log()
    assert httpx.get(base + "/health").status_code == 200
    stream = dp_client.completions.create(model=MODEL, prompt=_text(30), max_tokens=400, temperature=0,
                                          stream=True, extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)
    replica = int(_wait_running(base))
    os.kill(pids[replica], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(openai.APIError, match="engine core process died"):
        for _ in it:
            pass
    assert time.monotonic() - t0 < 30
    deadline = time.monotonic() + 10
    while httpx.get(base + "/health").status_code != 503 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert httpx.get(base + "/health").status_code == 503
    assert _by_replica(base, "lamina:dp_replica_up") == {str(replica): 0.0, str(1 - replica): 1.0}
    out = dp_client.completions.create(model=MODEL, prompt=_text(31), max_tokens=3, temperature=0)
    assert out.choices[0].finish_reason == "length"  # the other replica still serves
