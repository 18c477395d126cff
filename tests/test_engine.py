"""Scheduler behaviour on a random Llama checkpoint: batch invariance, chunked prefill, preemption, abort,
and that every KV block is back in the pool after each scenario."""
from __future__ import annotations

import random

import pytest

from lamina import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def prompts(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 70))]} for _ in range(n)]


def make(path, **kw) -> LLM:
    kw = {"dtype": "float32", "device": "cpu", "block_size": 4, "progress": False, **kw}
    return LLM(model=str(path), **kw)


def all_free(llm: LLM) -> bool:
    eng = llm.engine
    return eng.allocator.num_free == eng.allocator.num_blocks and not eng.scheduler.running \
        and not eng.scheduler.waiting and not eng.groups


@pytest.fixture(scope="module")
def alone(checkpoints):
    """Each request's greedy output when it runs alone with a roomy pool and budget."""
    llm = make(checkpoints["llama"], num_kv_blocks=256)
    return [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in prompts(16)]


@pytest.mark.parametrize("overlap", [False, True])  # True: tokens read back one step late, as on the GPU
def test_batch_invariance_with_chunked_prefill(checkpoints, alone, overlap):
    # A 16-token budget forces chunked prefill and mixes prefill chunks with decode tokens in one forward.
    llm = make(checkpoints["llama"], num_kv_blocks=256, max_num_batched_tokens=16, async_scheduling=overlap)
    outs = llm.generate(prompts(16), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert all_free(llm)


@pytest.mark.parametrize("overlap", [False, True])
def test_preemption_gives_identical_outputs(checkpoints, alone, overlap):
    # 40 blocks of 4 tokens cannot hold 16 sequences of up to ~93 tokens: the scheduler must preempt.
    llm = make(checkpoints["llama"], num_kv_blocks=40, max_num_batched_tokens=64, async_scheduling=overlap)
    outs = llm.generate(prompts(16), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == alone
    assert all_free(llm)


def test_preemption_actually_happens(checkpoints):
    llm = make(checkpoints["llama"], num_kv_blocks=40, max_num_batched_tokens=64)
    eng = llm.engine
    for i, p in enumerate(prompts(16)):
        eng.add_request(str(i), p, GREEDY)
    seqs = [s for g in eng.groups.values() for s in g.seqs]
    while eng.has_unfinished_requests():
        eng.step()
    assert sum(s.num_preemptions for s in seqs) > 0
    assert all_free(llm)


def test_seeded_sampling_preempted_matches_unpreempted(checkpoints):
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=24, ignore_eos=True) for i in range(16)]
    roomy = make(checkpoints["llama"], num_kv_blocks=256).generate(prompts(16), params, use_tqdm=False)
    tight = make(checkpoints["llama"], num_kv_blocks=40, max_num_batched_tokens=64, async_scheduling=True).generate(
        prompts(16), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in roomy] == [o.outputs[0].token_ids for o in tight]


def test_abort_frees_blocks(checkpoints):
    llm = make(checkpoints["llama"], num_kv_blocks=64)
    eng = llm.engine
    for i, p in enumerate(prompts(4)):
        eng.add_request(str(i), p, SamplingParams(max_tokens=100, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert eng.allocator.num_free < eng.allocator.num_blocks
    out = eng.abort_request("1")
    assert out.finished and out.outputs[0].finish_reason == "abort"
    for rid in ("0", "2", "3"):
        eng.abort_request(rid)
    assert all_free(llm)


def test_prompt_longer_than_max_model_len_is_refused_and_engine_keeps_going(checkpoints):
    llm = make(checkpoints["llama"], num_kv_blocks=64, max_model_len=32)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": list(range(100, 140))}, GREEDY, use_tqdm=False)
    out = llm.generate({"prompt_token_ids": list(range(100, 110))}, GREEDY, use_tqdm=False)[0]
    # max_tokens is capped so prompt + output fit max_model_len.
    assert len(out.outputs[0].token_ids) == 22 and out.outputs[0].finish_reason == "length"
    assert all_free(llm)


def test_bad_batch_is_refused_whole(checkpoints):
    llm = make(checkpoints["llama"], num_kv_blocks=64)
    with pytest.raises(ValueError):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [-1]}], GREEDY, use_tqdm=False)
    assert all_free(llm)
