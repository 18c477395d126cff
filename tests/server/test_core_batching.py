"""The core loop batches: every add that arrived during a step joins the next one; outputs travel as deltas
that rebuild exactly the engine's cumulative outputs."""
from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from lamina.engine.async_engine import AsyncEngine
from lamina.engine.deltas import DeltaEncoder, OutputAssembler
from lamina.engine.ipc import Codec, OutputDelta
from lamina.outputs import CompletionOutput, Logprob, RequestOutput
from lamina.sampling_params import SamplingParams


class Recorder:
    def __init__(self) -> None:
        self.added: list[int] = []

    def on_iteration(self, it, stats) -> None:
        self.added.append(it.num_added)


class SlowStep:
    """engine.step that takes at least `seconds`: a window in which adds pile up."""

    def __init__(self, fn, seconds: float) -> None:
        self.fn, self.seconds = fn, seconds

    def __call__(self):
        time.sleep(self.seconds)
        return self.fn()


def test_adds_during_a_step_join_the_next_step_together(llm_engine, monkeypatch):
    rec = Recorder()
    ae = AsyncEngine(llm_engine, observer=rec)
    monkeypatch.setattr(llm_engine, "step", SlowStep(llm_engine.step, 0.3))
    ae.start()
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)

    async def main() -> list:
        first = await ae.add_request("busy", [1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=8,
                                                                          ignore_eos=True))
        await asyncio.sleep(0.1)  # the core is inside a (slow) step now
        streams = await asyncio.gather(*(ae.add_request(f"b{i}", [5, 6, 7, i + 8], params) for i in range(5)))
        outs = [[o async for o in s] for s in [first, *streams]]
        return outs

    try:
        outs = asyncio.run(main())
    finally:
        ae.shutdown()
    assert 5 in rec.added, rec.added  # all five were drained in one go and admitted before the same step
    assert all(o[-1].finished and len(o[-1].outputs[0].token_ids) == (8 if i == 0 else 3) for i, o in enumerate(outs))
    s = llm_engine.stats()
    assert s.num_free_blocks == s.num_total_blocks


def _out(text: str, ids: list[int], finished: bool = False, lps: int = 0) -> RequestOutput:
    logprobs = [{t: Logprob(-0.5, 1, str(t))} for t in ids[:lps]] if lps else None
    comp = CompletionOutput(0, text, list(ids), -1.0 if lps else None, logprobs, "stop" if finished else None)
    return RequestOutput("r", None, [9, 9], [comp], finished, metrics={"arrival_time": 1.0})


@pytest.mark.parametrize("lps", [0, 3])
def test_deltas_rebuild_the_cumulative_outputs(lps):
    """Through msgpack and back. No text travels: the client's output processor makes it."""
    enc, asm, codec = DeltaEncoder(), OutputAssembler(), Codec()
    dec = msgspec.msgpack.Decoder(OutputDelta)
    asm.start("r", None)
    steps = [_out("He", [1], lps=min(lps, 1)), _out("Hello", [1, 2], lps=min(lps, 2)),
             _out("Hello wo", [1, 2, 3], lps=min(lps, 3)), _out("Hello", [1, 2, 3, 4], True, lps=min(lps, 3))]
    sizes = []
    for want in steps:
        data = codec.encode(enc.encode(want))
        sizes.append(len(data))
        got = asm.apply(dec.decode(data))
        assert got.outputs[0].text == ""
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].logprobs == want.outputs[0].logprobs
        assert got.finished == want.finished and got.prompt_token_ids == [9, 9]
    assert asm.apply(dec.decode(codec.encode(enc.encode(_out("x", [1]))))) is None  # finished: forgotten
