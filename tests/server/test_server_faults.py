"""A failure inside the engine fails the affected requests with 500 and the server keeps serving.

Faults are injected into an in-process engine served by uvicorn on a thread, so the test can reach inside.
"""
from __future__ import annotations

import threading

import openai
import pytest
from server_helpers import MODEL, serve_in_thread, wait_idle

from lamina.server.app import build_app, make_state


class Fault:
    """Raises from the patched callable for the next `times` calls, then behaves normally again."""

    def __init__(self, fn, times: int) -> None:
        self.fn, self.left = fn, times

    def __call__(self, *a, **kw):
        if self.left > 0:
            self.left -= 1
            raise RuntimeError("injected fault")
        return self.fn(*a, **kw)


@pytest.fixture(scope="module")
def served(llm_engine):
    with serve_in_thread(build_app(make_state(llm_engine, [MODEL]))) as base:
        yield base, llm_engine


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=60)


def _check_recovered(base: str) -> None:
    r = _client(base).completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3
    wait_idle(base)


@pytest.mark.parametrize("target", ["model", "step"])
def test_engine_fault_non_streaming(served, monkeypatch, target):
    """'model': the forward pass raises (the engine contains it); 'step': engine.step itself raises."""
    base, engine = served
    if target == "model":
        monkeypatch.setattr(engine.runner, "execute", Fault(engine.runner.execute, 1))
    else:
        monkeypatch.setattr(engine, "step", Fault(engine.step, 1))
    with pytest.raises(openai.InternalServerError) as info:
        _client(base).completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    assert info.value.status_code == 500 and "injected fault" in str(info.value)
    _check_recovered(base)


def test_engine_fault_mid_stream(served, monkeypatch):
    base, engine = served
    fault = Fault(engine.runner.execute, 0)
    monkeypatch.setattr(engine.runner, "execute", fault)
    stream = _client(base).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                   max_tokens=50, stream=True, extra_body={"ignore_eos": True})
    got = []
    with pytest.raises(openai.APIError, match="injected fault"):
        for chunk in stream:
            got.append(chunk)
            if len(got) == 3:
                fault.left = 1  # fail the request once it is streaming
    assert len(got) >= 3
    _check_recovered(base)


def test_fault_with_concurrent_requests(served, monkeypatch):
    base, engine = served
    monkeypatch.setattr(engine, "step", Fault(engine.step, 1))
    results: list = []

    def call(i: int) -> None:
        try:
            _client(base).completions.create(model=MODEL, prompt=f"Hi {i}", max_tokens=3)
            results.append("ok")
        except openai.InternalServerError:
            results.append(500)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert 500 in results and len(results) == 4  # the failed step hit at least one; the rest went on
    _check_recovered(base)
