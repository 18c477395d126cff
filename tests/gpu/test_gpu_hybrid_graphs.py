"""GPU (skips without CUDA): every step of a hybrid model (gated delta net + gated attention + MoE) replays a
CUDA graph, mixed prefill+decode steps included, and gives the eager engine's tokens: fp32 near-exact, bf16
greedy equal up to near-ties; prefix caching with state snapshots on == off with graphs; every KV block and
state slot free afterwards."""
from __future__ import annotations

import pytest
import torch
from hybrid_helpers import hybrid_checkpoints
from model_factory import shared_prefix_prompts

from lamina import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(autouse=True)
def _hybrid_mixed_graphs(monkeypatch):
    """Hybrid mixed graphs are on by default: these tests check the default, whatever the caller's environment."""
    monkeypatch.delenv("LAMINA_HYBRID_MIXED_GRAPHS", raising=False)
    monkeypatch.delenv("LAMINA_MIXED_GRAPHS", raising=False)

PROMPT = [1000 + (37 * i) % 3000 for i in range(400)]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, smol_tokenizer):
    return hybrid_checkpoints(tmp_path_factory, smol_tokenizer)


def _count(llm):
    runner, seen = llm.engine.runner, []
    orig = runner.execute

    def execute(batch):
        seen.append(runner.graphs.pick(batch) if runner.graphs is not None else None)
        return orig(batch)

    runner.execute = execute
    return seen


def _staggered(llm, prompts, params):
    """Requests join two every other step, so prefill chunks of many sizes meet decode rows."""
    eng, outs, step = llm.engine, {}, 0
    pending = list(enumerate(zip(prompts, params)))
    while pending or eng.has_unfinished_requests():
        if step % 2 == 0:
            for _ in range(2):
                if pending:
                    i, (p, sp) = pending.pop(0)
                    eng.add_request(f"r{i}", p, sp)
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0]
        step += 1
    return [outs[f"r{i}"] for i in range(len(prompts))]


def _all_free(eng):
    return (eng.allocator.num_free == eng.allocator.num_blocks and not eng.groups
            and eng.state_pool.num_free == eng.state_pool.num_slots)


def _workload(n=14):
    prompts = [{"prompt_token_ids": PROMPT[: (1, 2, 17)[i] if i < 3 else 3 + 29 * i]} for i in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=6 + 3 * (i % 5), ignore_eos=True, logprobs=2)
              for i in range(n)]
    return prompts, params


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
@pytest.mark.parametrize("budget", [64, 512])
def test_hybrid_mixed_graphs_match_eager_fp32(hybrid, family, budget):
    kw = {"model": str(hybrid[family]), "dtype": "float32", "device": "cuda", "num_kv_blocks": 512,
          "max_num_batched_tokens": budget, "max_num_seqs": 8, "progress": False}
    graph = LLM(**kw)
    assert graph.engine.runner.graphs.mixed_sizes, "mixed graphs were not captured"
    seen = _count(graph)
    eager = LLM(enforce_eager=True, **kw)
    prompts, params = _workload()
    a = _staggered(graph, prompts, params)
    b = _staggered(eager, prompts, params)
    assert seen and all(k is not None for k in seen), "a step ran eagerly"
    assert any(not k.decode for k in seen) and any(k.decode for k in seen)
    assert any(not k.decode and k.tokens > 16 for k in seen), "no mixed step beyond the smallest graph"
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        for p, q, t in zip(x.logprobs, y.logprobs, x.token_ids):
            assert abs(p[t].logprob - q[t].logprob) < 1e-3
    assert _all_free(graph.engine) and _all_free(eager.engine)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_hybrid_mixed_graphs_bf16_greedy_equal_up_to_near_ties(hybrid, family):
    kw = {"model": str(hybrid[family]), "dtype": "bfloat16", "device": "cuda", "num_kv_blocks": 512,
          "max_num_batched_tokens": 128, "max_num_seqs": 8, "progress": False}
    graph = LLM(**kw)
    seen = _count(graph)
    eager = LLM(enforce_eager=True, **kw)
    prompts, params = _workload()
    a = _staggered(graph, prompts, params)
    b = _staggered(eager, prompts, params)
    assert all(k is not None for k in seen), "a step ran eagerly"
    agree = 0
    for x, y in zip(a, b):
        for i, (tx, ty) in enumerate(zip(x.token_ids, y.token_ids)):
            if tx != ty:  # allowed only where eager's top two are within bf16 noise
                gap = y.logprobs[i][ty].logprob - y.logprobs[i].get(tx, y.logprobs[i][ty]).logprob
                assert tx in y.logprobs[i] and gap < 0.1, (i, tx, ty, gap)
                break
            assert abs(x.logprobs[i][tx].logprob - y.logprobs[i][ty].logprob) < 0.1
        else:
            agree += 1
    assert agree >= len(a) - 2, f"only {agree}/{len(a)} requests fully agree"
    assert _all_free(graph.engine)


def test_hybrid_prefix_cache_with_graphs_equals_cache_off(hybrid):
    """Snapshot steps (chunks cut to end at snapshot positions, the copy enqueued after the replay) and restores
    (before the step that uses them) replay graphs like every other step."""
    prompts = shared_prefix_prompts(4, per_group=4, prefix_len=70)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(model=str(hybrid["qwen3_next"]), dtype="float32", device="cuda", num_kv_blocks=256, max_num_seqs=8,
              block_size=16, max_num_batched_tokens=64, progress=False)
    on = LLM(**kw, enable_prefix_caching=True, state_snapshot_interval=32)
    seen = _count(on)
    off = LLM(**kw, enable_prefix_caching=False, enforce_eager=True)
    first = on.generate(prompts, params, use_tqdm=False)
    again = on.generate(prompts, params, use_tqdm=False)  # now every prefix is cached
    base = off.generate(prompts, params, use_tqdm=False)
    assert all(k is not None for k in seen), "a step ran eagerly"
    assert any(not k.decode for k in seen)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in base]
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in base]
    assert on.engine.stats().num_snapshot_hits > 0
    assert _all_free(on.engine) and _all_free(off.engine)
