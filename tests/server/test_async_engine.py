"""AsyncEngine: validation raised to the caller, streaming, aborts that free blocks at once, no busy loop."""
from __future__ import annotations

import asyncio
import time

import pytest
from server_helpers import MAX_MODEL_LEN

from lamina.engine.async_engine import AsyncEngine
from lamina.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


class CountingObserver:
    def __init__(self) -> None:
        self.iterations = 0

    def on_iteration(self, it, stats) -> None:
        self.iterations += 1


@pytest.fixture
def aengine(llm_engine):
    obs = CountingObserver()
    ae = AsyncEngine(llm_engine, observer=obs)
    ae.start()
    try:
        yield ae, obs
    finally:
        ae.shutdown()
        assert not llm_engine.has_unfinished_requests()
        s = llm_engine.stats()
        assert s.num_free_blocks == s.num_total_blocks


async def _wait_free(ae: AsyncEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = ae.last_stats
        # No stream left means the core has answered every abort (the stats may predate a request's step).
        if s.num_free_blocks == s.num_total_blocks and s.num_running == 0 and s.num_waiting == 0 \
                and ae.num_in_flight == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"blocks still leased: {ae.last_stats}")


def test_bad_requests_raise_to_the_caller(aengine):
    ae, _ = aengine

    async def main() -> None:
        with pytest.raises(ValueError, match="max_model_len"):
            await ae.add_request("long", [1] * MAX_MODEL_LEN, GREEDY)
        with pytest.raises(ValueError, match="empty"):
            await ae.add_request("empty", [], GREEDY)
        with pytest.raises(ValueError):
            await ae.add_request("vocab", [10**9], GREEDY)
        stream = await ae.add_request("dup", "Hello", GREEDY)
        with pytest.raises(ValueError, match="already in use"):
            await ae.add_request("dup", "Hello", GREEDY)
        outs = [o async for o in stream]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 6

    asyncio.run(main())
    assert ae.engine.stats().num_free_blocks == ae.engine.stats().num_total_blocks


def test_streams_are_cumulative_and_concurrent(aengine):
    ae, _ = aengine

    async def run(i: int) -> list:
        return [o async for o in ae.generate(f"c{i}", f"Story {i}:", GREEDY)]

    async def main() -> list:
        return await asyncio.gather(*(run(i) for i in range(8)))

    results = asyncio.run(main())
    for outs in results:
        lens = [len(o.outputs[0].token_ids) for o in outs]
        assert lens == sorted(lens) and lens[-1] == 6 and outs[-1].finished
        assert all(not o.finished for o in outs[:-1])
        assert outs[-1].outputs[0].text.startswith(outs[0].outputs[0].text)


def test_consumer_that_stops_early_aborts(aengine):
    ae, _ = aengine
    long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main() -> None:
        gen = ae.generate("early", "Tell me a story.", long)
        async for out in gen:
            if len(out.outputs[0].token_ids) >= 2:
                break
        await gen.aclose()
        await _wait_free(ae)

        task = asyncio.ensure_future(_consume(ae.generate("cancelled", "Tell me a story.", long)))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _wait_free(ae)

    asyncio.run(main())
    assert not ae.engine.has_unfinished_requests()


async def _consume(gen) -> None:
    async for _ in gen:
        pass


def test_idle_loop_blocks(aengine):
    ae, obs = aengine

    async def main() -> None:
        await _consume(ae.generate("one", "Hi", SamplingParams(temperature=0, max_tokens=2)))

    asyncio.run(main())
    time.sleep(0.2)
    before = obs.iterations
    time.sleep(1.0)
    assert obs.iterations == before, "the engine loop iterates while idle (busy spin)"
