"""Engine-side hardening: parameter checks against the vocabulary, tiny temperatures, fair admission of a
small request next to a huge one, and stop strings matched on the new text's tail only."""
from __future__ import annotations

import random
import time

import pytest

from lamina import LLM, SamplingParams
from lamina.engine.stop import find_stop, held_back
from lamina.sampling_params import MAX_STOP_STRING_LEN, MAX_STOP_STRINGS, SamplingParamsError


def make(path, **kw) -> LLM:
    kw = {"dtype": "float32", "device": "cpu", "block_size": 4, "progress": False, **kw}
    return LLM(model=str(path), **kw)


@pytest.mark.parametrize("bad,param", [
    (dict(top_k=2**63), "top_k"), (dict(top_k=-5), "top_k"), (dict(seed=2**63), "seed"),
    (dict(seed=-(2**63) - 1), "seed"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
    (dict(stop=["s"] * (MAX_STOP_STRINGS + 1)), "stop"), (dict(stop=["s" * (MAX_STOP_STRING_LEN + 1)]), "stop"),
    (dict(temperature=float("nan")), "temperature"), (dict(temperature=float("inf")), "temperature"),
    (dict(min_tokens=3, max_tokens=2), "min_tokens"),
])
def test_out_of_range_settings_name_their_field(bad, param):
    with pytest.raises(SamplingParamsError) as e:
        SamplingParams(**bad)
    assert e.value.param == param


def test_vocabulary_checks_and_pickling():
    import pickle

    p = SamplingParams(top_k=100, stop_token_ids=[99], seed=2**63 - 1)
    p.validate(vocab_size=100)
    with pytest.raises(SamplingParamsError, match="top_k"):
        SamplingParams(top_k=101).validate(vocab_size=100)
    with pytest.raises(SamplingParamsError, match=r"\[0, 100\)") as e:
        SamplingParams(stop_token_ids=[100], min_tokens=1).validate(vocab_size=100)
    again = pickle.loads(pickle.dumps(e.value))  # the param survives a trip to another process
    assert isinstance(again, ValueError) and again.param == "stop_token_ids"
    assert SamplingParams(top_k=-1).top_k == 0


def test_engine_refuses_what_would_break_a_step(checkpoints):
    """Settings that made the sampler raise inside a batched step are refused at add_request, so the
    requests sharing the step are never touched."""
    llm = make(checkpoints["llama"], num_kv_blocks=64)
    vocab = llm.engine.model_config.vocab_size
    for bad in (SamplingParams(top_k=vocab + 1), SamplingParams(stop_token_ids=[vocab], min_tokens=1)):
        with pytest.raises(ValueError):
            llm.engine.add_request("bad", {"prompt_token_ids": [1, 2, 3]}, bad)
    assert not llm.engine.groups and not llm.engine.scheduler.waiting


def test_tiny_temperature_is_greedy(checkpoints):
    llm = make(checkpoints["llama"], num_kv_blocks=64)
    prompt = {"prompt_token_ids": [5, 6, 7, 8, 9]}
    greedy = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for t in (1e-40, 9e-6):
        assert SamplingParams(temperature=t).greedy
        out = llm.generate(prompt, SamplingParams(temperature=t, max_tokens=8, ignore_eos=True, logprobs=1),
                           use_tqdm=False)
        assert out[0].outputs[0].token_ids == greedy[0].outputs[0].token_ids
    assert not SamplingParams(temperature=2e-5).greedy


def test_small_request_is_not_queued_behind_a_huge_one(checkpoints):
    """One request with n=32 on 4 sequence slots, then a 2-token request: the small one takes the first free
    slot instead of waiting for all 32 (about 8 rounds of 16 tokens) to finish."""
    llm = make(checkpoints["llama"], num_kv_blocks=256, max_num_seqs=4)
    eng = llm.engine
    eng.add_request("huge", {"prompt_token_ids": [11, 12, 13]}, SamplingParams(n=32, max_tokens=16, ignore_eos=True))
    eng.step()
    eng.add_request("small", {"prompt_token_ids": [21, 22]}, SamplingParams(max_tokens=2, ignore_eos=True))
    finished_huge = 0
    for _ in range(200):
        outs = eng.step()
        if any(o.request_id == "small" and o.finished for o in outs):
            break
    else:
        raise AssertionError("the small request never finished")
    finished_huge = sum(1 for s in eng.groups["huge"].seqs if s.finished)
    assert finished_huge <= 8, f"the small request waited for {finished_huge} of the huge one's sequences"
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.allocator.num_free == eng.allocator.num_blocks


def test_two_requests_take_turns_when_slots_free(checkpoints):
    """Fair share between two big requests: once slots free up, they alternate rather than the first one
    getting every slot."""
    llm = make(checkpoints["llama"], num_kv_blocks=256, max_num_seqs=4)
    eng = llm.engine
    eng.add_request("a", {"prompt_token_ids": [1, 2, 3]}, SamplingParams(n=8, max_tokens=4, ignore_eos=True))
    eng.add_request("b", {"prompt_token_ids": [4, 5, 6]}, SamplingParams(n=8, max_tokens=4, ignore_eos=True))
    eng.step()
    running = [s.request_id for s in eng.scheduler.running]
    assert running.count("a") == 2 and running.count("b") == 2
    while eng.has_unfinished_requests():
        eng.step()


def _ref_held_back(text: str, stops: list[str]) -> int:
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold


def test_held_back_matches_the_plain_definition():
    rng = random.Random(0)
    for _ in range(5000):
        text = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        stops = ["".join(rng.choice("abc") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))]
        assert held_back(text, stops) == _ref_held_back(text, stops), (text, stops)


def test_stop_strings_cost_does_not_grow_with_the_text():
    """Many long stop strings: each new piece of text costs about the same however long the output is."""
    rng = random.Random(1)
    stops = ["".join(rng.choice("abcdefgh") for _ in range(MAX_STOP_STRING_LEN)) for _ in range(MAX_STOP_STRINGS)]
    text = ""

    def per_piece(n_pieces: int) -> float:
        nonlocal text
        start = time.perf_counter()
        for _ in range(n_pieces):
            piece = "".join(rng.choice("abcdefgh ") for _ in range(4))
            text += piece
            assert find_stop(text, len(piece), stops) is None
            held_back(text, stops)
        return (time.perf_counter() - start) / n_pieces

    early = per_piece(300)
    late = per_piece(3000)
    assert late < 5 * early + 1e-4, (early, late)
    before = len(text)
    text += stops[3]
    assert find_stop(text, len(stops[3]), stops) == (before, stops[3])


def test_small_request_gets_blocks_from_a_stream_holding_the_pool(checkpoints):
    """A small pool, one n=32 stream that could hold every block, then a 4-token request: the small one is
    admitted within a few steps by preempting the big one's newest sequences (it is over its fair share),
    and finishes long before the stream; the stream's outputs are unchanged and every block comes back."""
    llm = make(checkpoints["llama"], num_kv_blocks=64)
    eng = llm.engine
    big = SamplingParams(n=32, temperature=0, max_tokens=48, ignore_eos=True)
    ref = llm.generate({"prompt_token_ids": [11, 12, 13]}, SamplingParams(temperature=0, max_tokens=48,
                                                                           ignore_eos=True), use_tqdm=False)[0]
    eng.add_request("huge", {"prompt_token_ids": [11, 12, 13]}, big)
    for _ in range(12):
        eng.step()
    assert eng.allocator.num_free < 4, "the stream should hold (nearly) the whole pool by now"
    eng.add_request("small", {"prompt_token_ids": [21, 22, 23, 24]}, SamplingParams(max_tokens=4, ignore_eos=True))
    steps = 0
    outs: dict[str, object] = {}
    while "small" not in outs:
        steps += 1
        assert steps <= 12, "the small request was not served promptly"
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert "huge" not in outs and len(outs["small"].outputs[0].token_ids) == 4
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert all(c.token_ids == ref.outputs[0].token_ids for c in outs["huge"].outputs)
    assert eng.allocator.num_free == eng.allocator.num_blocks and not eng.scheduler.running


def test_small_request_gets_a_sequence_slot_from_a_long_stream_holding_all(checkpoints):
    """Every sequence slot held by one long n=8 stream: a 2-token request takes one of them (the stream's
    newest sequence is preempted and recomputed later, same output) instead of waiting for the stream."""
    llm = make(checkpoints["llama"], num_kv_blocks=256, max_num_seqs=4)
    eng = llm.engine
    ref = llm.generate({"prompt_token_ids": [11, 12, 13]}, SamplingParams(temperature=0, max_tokens=40,
                                                                           ignore_eos=True), use_tqdm=False)[0]
    eng.add_request("long", {"prompt_token_ids": [11, 12, 13]},
                    SamplingParams(n=8, temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(3):
        eng.step()
    eng.add_request("small", {"prompt_token_ids": [21, 22]}, SamplingParams(max_tokens=2, ignore_eos=True))
    outs: dict[str, object] = {}
    for _ in range(6):
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert "small" in outs and "long" not in outs
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
    assert all(c.token_ids == ref.outputs[0].token_ids for c in outs["long"].outputs)
    assert eng.allocator.num_free == eng.allocator.num_blocks and not eng.scheduler.running
