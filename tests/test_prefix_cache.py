"""Prefix caching (dense models): outputs with the cache equal outputs without it; hits counted; all freed."""
from __future__ import annotations

import pytest
from model_factory import shared_prefix_prompts

from lamina import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def make(path, cache: bool, **kw) -> LLM:
    kw = {"dtype": "float32", "device": "cpu", "block_size": 4, "num_kv_blocks": 256, "progress": False,
          "enable_prefix_caching": cache, **kw}
    return LLM(model=str(path), **kw)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def all_free(llm):
    a = llm.engine.allocator
    return a.num_free == a.num_blocks and not llm.engine.groups


@pytest.mark.parametrize("family, overlap", [("llama", False), ("llama", True), ("mistral", True)])
def test_shared_prefixes_concurrent_and_sequential(checkpoints, family, overlap):
    prompts = shared_prefix_prompts(3)
    off = tokens(make(checkpoints[family], False).generate(prompts, GREEDY, use_tqdm=False))
    llm = make(checkpoints[family], True, async_scheduling=overlap)
    assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == off  # concurrent: hits within the batch
    again = llm.generate(prompts, GREEDY, use_tqdm=False)  # sequential: everything but the tail is cached
    assert tokens(again) == off
    assert all(o.num_cached_tokens >= 20 for o in again)
    pc = llm.engine.prefix_cache
    assert pc.hit_tokens > 0 and pc.hit_tokens <= pc.queried_tokens
    assert all_free(llm)


def test_multi_turn_conversation(checkpoints):
    on, off = make(checkpoints["qwen3"], True), make(checkpoints["qwen3"], False)
    history_on = history_off = [7, 8, 9, 10, 11]
    computed_before = 0  # tokens whose KV the previous turn computed (all but its last sampled token)
    for turn in range(4):
        a = on.generate({"prompt_token_ids": history_on}, GREEDY, use_tqdm=False)[0]
        b = off.generate({"prompt_token_ids": history_off}, GREEDY, use_tqdm=False)[0]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        # The previous turn's prompt and reply are reused up to their last full block.
        assert a.num_cached_tokens == min(computed_before // 4, (len(history_on) - 1) // 4) * 4
        computed_before = len(history_on) + len(a.outputs[0].token_ids) - 1
        user = [1000 + turn * 10 + i for i in range(5)]
        history_on = history_on + a.outputs[0].token_ids + user
        history_off = history_off + b.outputs[0].token_ids + user
    assert all_free(on)


def test_eviction_under_a_small_pool(checkpoints):
    prompts = shared_prefix_prompts(n_groups=6, per_group=3, prefix_len=30, seed=3)
    off = tokens(make(checkpoints["llama"], False, num_kv_blocks=40, max_num_batched_tokens=32).generate(
        prompts, GREEDY, use_tqdm=False))
    llm = make(checkpoints["llama"], True, num_kv_blocks=40, max_num_batched_tokens=32)
    for _ in range(2):  # the second round finds some prefixes evicted, some not
        assert tokens(llm.generate(prompts, GREEDY, use_tqdm=False)) == off
    assert llm.engine.allocator.num_cached <= 40
    assert all_free(llm)


def test_hit_counts_exact(checkpoints):
    llm = make(checkpoints["llama"], True)
    p = list(range(2000, 2019))  # 19 tokens: 4 full blocks, 3 in the tail
    llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)
    pc = llm.engine.prefix_cache
    assert (pc.queried_tokens, pc.hit_tokens) == (19, 0)
    out = llm.generate({"prompt_token_ids": p}, GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 16 and pc.hit_tokens == 16
    # A prompt that is exactly block-aligned keeps its last block to compute (logits are needed).
    q = list(range(3000, 3016))
    llm.generate({"prompt_token_ids": q}, GREEDY, use_tqdm=False)
    assert llm.generate({"prompt_token_ids": q}, GREEDY, use_tqdm=False)[0].num_cached_tokens == 12


def test_prompt_logprobs_bypass_the_cache(checkpoints):
    llm = make(checkpoints["llama"], True)
    p = {"prompt_token_ids": list(range(2000, 2019))}
    llm.generate(p, GREEDY, use_tqdm=False)
    out = llm.generate(p, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == 19 and out.prompt_logprobs[18] is not None


@pytest.mark.parametrize("overlap, budget", [(False, 24), (True, 24), (True, 512)])
def test_burst_sharing_a_prefix_computes_it_once(checkpoints, overlap, budget):
    """Requests arriving together wait for the one computing their shared prefix instead of all prefilling
    it: every follower is served the whole prefix from the cache, even with chunked prefill."""
    prefix = list(range(3000, 3064))  # 16 blocks of 4
    prompts = [{"prompt_token_ids": prefix + [100 + i, 200 + i, 300 + i]} for i in range(6)]
    prompts.append({"prompt_token_ids": list(range(5000, 5030))})  # unrelated: not held back by the waiters
    off = tokens(make(checkpoints["llama"], False).generate(prompts, GREEDY, use_tqdm=False))
    # budget 24: the prefix takes several steps; 512: the whole burst would fit in the first step
    llm = make(checkpoints["llama"], True, max_num_batched_tokens=budget, async_scheduling=overlap)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(outs) == off
    assert sorted(o.num_cached_tokens for o in outs) == [0, 0] + [64] * 5
    assert not llm.engine.prefix_cache.computing and all_free(llm)


def test_mostly_cached_request_is_admitted_before_an_earlier_cold_one(checkpoints):
    """A request whose prompt is mostly cached starts before a cold request that arrived first (it needs a
    few tokens, the cold one many), and both produce the same tokens as without the cache."""
    prefix = list(range(4000, 4032))  # 8 blocks of 4
    cold = {"prompt_token_ids": list(range(6000, 6040))}
    hot = {"prompt_token_ids": prefix + [77, 78]}
    off = tokens(make(checkpoints["llama"], False).generate([cold, hot], GREEDY, use_tqdm=False))
    llm = make(checkpoints["llama"], True, max_num_batched_tokens=16, async_scheduling=False)
    llm.generate({"prompt_token_ids": prefix + [99]}, GREEDY, use_tqdm=False)  # caches the prefix
    eng = llm.engine
    eng.stream_outputs = True  # every step's progress, to see who gets a first token when
    eng.add_request("cold", cold, GREEDY)
    eng.add_request("hot", hot, GREEDY)
    first, step, outs = {}, 0, {}
    while eng.has_unfinished_requests():
        step += 1
        for o in eng.step():
            if o.outputs[0].token_ids:
                first.setdefault(o.request_id, step)
            if o.finished:
                outs[o.request_id] = o
    assert first["hot"] == 1 and first["cold"] > first["hot"]
    assert outs["hot"].num_cached_tokens == 32
    assert [outs["cold"].outputs[0].token_ids, outs["hot"].outputs[0].token_ids] == off
    assert all_free(llm)


def test_cold_request_passed_over_at_most_a_bounded_number_of_times(checkpoints):
    """Mostly-cached requests go first, but a cold request that keeps being passed over gets its turn."""
    from lamina.engine import scheduler as sched

    llm = make(checkpoints["llama"], True, max_num_batched_tokens=8, async_scheduling=False)
    prefix = list(range(4000, 4032))
    llm.generate({"prompt_token_ids": prefix + [99]}, GREEDY, use_tqdm=False)  # caches the prefix
    eng = llm.engine
    eng.add_request("cold", {"prompt_token_ids": list(range(6000, 6040))}, GREEDY)
    waited = 0
    one = SamplingParams(temperature=0, max_tokens=1)
    for i in range(sched.MAX_PASSED_OVER + 5):  # cache hits of 2 new tokens each, 4 a step: the whole budget
        for j in range(4):
            eng.add_request(f"hot{i}.{j}", {"prompt_token_ids": prefix + [7, 4 * i + j]}, one)
        eng.step()
        if any(s.request_id == "cold" for s in eng.scheduler.waiting):
            waited += 1
    assert sched.MAX_PASSED_OVER <= waited <= sched.MAX_PASSED_OVER + 2  # then it was admitted
    while eng.has_unfinished_requests():
        eng.step()
    assert all_free(llm)
