"""Stop strings behind the core client: matched on the client's side, the stopped sample finished in the core
at once (its blocks free, no tokens generated past it), nothing after the stop reaching the consumer, and
the token count equal to what was shown. The oracle is a greedy run without stop strings."""
from __future__ import annotations

import asyncio
import time

import pytest

from lamina.engine.async_engine import AsyncEngine
from lamina.sampling_params import SamplingParams

PROMPT = "Write a long story about a dragon."


class Recorder:
    def __init__(self) -> None:
        self.generated = 0
        self.finished = []

    def on_iteration(self, it, stats) -> None:
        self.generated += it.num_generation_tokens
        self.finished += it.finished


@pytest.fixture
def aengine(llm_engine):
    rec = Recorder()
    ae = AsyncEngine(llm_engine, observer=rec)
    ae.start()
    try:
        yield ae, rec
    finally:
        ae.shutdown()
        assert not llm_engine.has_unfinished_requests()
        s = llm_engine.stats()
        assert s.num_free_blocks == s.num_total_blocks


async def _collect(ae, rid, params):
    outs = []
    async for out in ae.generate(rid, PROMPT, params):
        outs.append(out)
    return outs


def _wait_idle(ae, engine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.has_unfinished_requests() or engine.stats().num_free_blocks != engine.stats().num_total_blocks:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.01)


def _observed(rec: Recorder, num_finished: int, timeout: float = 10.0) -> int:
    """rec.generated once the observer has seen num_finished requests end (it runs on the receiver thread
    just after the consumers got their outputs) and the messages after them (tokens the core made past a
    stop) have come in too."""
    deadline = time.monotonic() + timeout
    while len(rec.finished) < num_finished:
        assert time.monotonic() < deadline, (len(rec.finished), num_finished)
        time.sleep(0.01)
    time.sleep(0.3)
    return rec.generated


def test_stop_string_ends_the_sample_in_the_core(aengine, llm_engine):
    ae, rec = aengine
    ref = asyncio.run(_collect(ae, "ref", SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)))[-1]
    assert _observed(rec, 1) == 40
    text, ids = ref.outputs[0].text, ref.outputs[0].token_ids
    mid = len(text) // 2
    stop = text[mid:mid + 6]
    assert stop.strip() and stop not in text[:mid], "pick a stop string that first occurs mid-text"
    k = next(k for k in range(1, len(ids) + 1) if stop in llm_engine.tokenizer.decode(ids[:k]))
    before = rec.generated
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True, stop=[stop])
    outs = asyncio.run(_collect(ae, "stopped", params))
    comp = outs[-1].outputs[0]
    assert outs[-1].finished and comp.finish_reason == "stop" and comp.stop_reason == stop
    assert comp.text == text[:text.index(stop)]
    assert comp.token_ids == ids[:k]  # usage counts exactly what was shown
    for out in outs:  # the consumer never saw text past the cut, nor the stop's first characters
        assert comp.text.startswith(out.outputs[0].text) and stop not in out.outputs[0].text
    _wait_idle(ae, llm_engine)
    # The generation-token count is what the consumer was shown, not the token or two the core made before
    # the stop reached it.
    assert _observed(rec, 2) - before == k, (rec.generated - before, k)
    assert rec.finished[-1].finish_reason == "stop" and rec.finished[-1].num_generation_tokens == k


def test_n_samples_with_stop_strings_free_every_block(aengine, llm_engine):
    ae, rec = aengine
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=200, ignore_eos=True, stop=["e", "a"])
    out = asyncio.run(_collect(ae, "n4", params))[-1]
    assert out.finished and len(out.outputs) == 4
    for comp in out.outputs:
        assert comp.finish_reason == "stop" and "e" not in comp.text and "a" not in comp.text
        assert 1 <= len(comp.token_ids) < 200
    _wait_idle(ae, llm_engine)
    assert _observed(rec, 1) == sum(len(c.token_ids) for c in out.outputs)
