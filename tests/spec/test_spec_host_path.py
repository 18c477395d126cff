"""The verify step's host path: a sync step read back at the start of the next call (async scheduling), the
n-gram proposer's buffered fast lookup against its definition; outputs equal plain decoding and every block
and slot comes back, with outputs streamed every step and a request aborted while a verify step is in flight."""
from __future__ import annotations

import numpy as np
import pytest
from spec_helpers import GREEDY64, all_free, make, outputs, spec_prompts

from lamina.engine.request import Sequence
from lamina.sampling_params import SamplingParams
from lamina.spec.config import parse_speculative_config
from lamina.spec.decoder import SpecDecoder
from lamina.spec.ngram import NgramProposer, ngram_lookup, ngram_lookup_fast


def test_ngram_fast_matches_definition():
    rng = np.random.default_rng(7)
    for _ in range(3000):
        t = rng.integers(0, int(rng.integers(1, 6)), int(rng.integers(1, 50))).astype(np.int64)
        lo = int(rng.integers(1, 4))
        hi, k = lo + int(rng.integers(0, 4)), int(rng.integers(1, 6))
        assert ngram_lookup_fast(t, lo, hi, k) == ngram_lookup(t, lo, hi, k), (t.tolist(), lo, hi, k)


def test_ngram_buffers_follow_growing_sequences():
    rng = np.random.default_rng(3)
    prop = NgramProposer(1, 4)
    seqs = [Sequence(i, f"r{i}", 0, rng.integers(0, 4, 5).tolist(), 5, SamplingParams(), None, 500, None)
            for i in range(3)]
    for _ in range(200):  # runs of 1-4 tokens at a time, past the buffers' first capacity
        for s in seqs:
            s.token_ids += rng.integers(0, 4, int(rng.integers(1, 5))).tolist()
        got = prop.propose(seqs, 3)
        assert got == [ngram_lookup(np.asarray(s.token_ids, np.int64), 1, 4, 3) for s in seqs]
    seqs[0] = Sequence(0, "r0", 0, [1, 2, 1], 3, SamplingParams(), None, 10, None)  # same id, a new sequence
    assert prop.propose(seqs[:1], 3) == [ngram_lookup(np.asarray([1, 2, 1], np.int64), 1, 4, 3)]


@pytest.fixture(scope="module")
def plain(checkpoints, one_thread):
    ps = spec_prompts(6, seed=11)
    return ps, outputs(make(checkpoints["llama"]), ps, GREEDY64)


def _ngram(llm):
    cfg = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3, "gate": "off"})
    llm.engine.spec = SpecDecoder(cfg, NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max))
    return llm


def test_streamed_outputs_equal_plain(checkpoints, plain):
    ps, ref = plain
    llm = _ngram(make(checkpoints["llama"], async_scheduling=True))
    llm.engine.stream_outputs = True  # every step's outputs, as a server's engine
    assert outputs(llm, ps, GREEDY64) == ref
    assert llm.engine.spec.num_verify_steps > 0 and all_free(llm)


def test_abort_with_a_verify_step_in_flight(checkpoints, plain):
    ps, ref = plain
    llm = _ngram(make(checkpoints["llama"], async_scheduling=True))
    eng, done, aborted = llm.engine, {}, None
    for i, p in enumerate(ps):
        eng.add_request(f"r{i}", p, GREEDY64)
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        flight = eng.in_flight
        if aborted is None and flight is not None and flight.sync and any(n > 1 for _, _, n in flight.sampled):
            aborted = flight.sampled[0][0].request_id  # its verify rows are still on the device
            eng.abort_request(aborted)
    assert aborted is not None
    assert {r: t for r, t in done.items() if r != aborted} == {f"r{i}": t for i, t in enumerate(ref)
                                                               if f"r{i}" != aborted}
    assert all_free(llm)
