"""Hybrid and MoE models on the GPU (skips without CUDA): bf16 prompt logprobs against HF (tolerance from
HF's own bf16 noise), CUDA-graph decode with state slots against eager, and prefix caching with state
snapshots through the Triton kernels (cache on == cache off, fp32)."""
from __future__ import annotations

import pytest
import torch
from hybrid_helpers import FAMILIES, hf_logprobs, hf_model, hybrid_checkpoints
from model_factory import assert_within_bf16_noise, shared_prefix_prompts

from lamina import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPT = [1000 + (37 * i) % 3000 for i in range(200)]


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory, smol_tokenizer):
    return hybrid_checkpoints(tmp_path_factory, smol_tokenizer)


def _hf_bf16_logprobs(path, ids):
    model = hf_model(path).to(device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        return model(torch.tensor([ids], device="cuda")).logits[0].float().log_softmax(-1).cpu()


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("chunk", [4096, 48])
def test_bf16_prompt_logprobs_match_hf(hybrid, family, chunk):
    path = hybrid[family]
    targets = torch.tensor(PROMPT[1:])[:, None]
    ref = hf_logprobs(path, PROMPT)[:-1].gather(1, targets)[:, 0]  # fp32 CPU: the oracle
    hf_bf16 = _hf_bf16_logprobs(path, PROMPT)[:-1].gather(1, targets)[:, 0]
    llm = LLM(model=str(path), dtype="bfloat16", device="cuda", num_kv_blocks=64, max_num_batched_tokens=chunk,
              max_num_seqs=8, progress=False)
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, prompt_logprobs=0),
                       use_tqdm=False)[0]
    ours = torch.tensor([out.prompt_logprobs[i][PROMPT[i]].logprob for i in range(1, len(PROMPT))])
    assert_within_bf16_noise(f"{family} chunk={chunk}", ours, ref, hf_bf16)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"])
def test_graph_decode_with_state_slots_matches_eager(hybrid, family):
    path = hybrid[family]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": PROMPT[: 1 + 9 * i]} for i in range(12)]  # a 1-token prompt too
    kw = dict(model=str(path), dtype="float32", device="cuda", num_kv_blocks=256, max_num_seqs=16, progress=False)
    graph = LLM(**kw)
    assert graph.engine.runner.graphs is not None and graph.engine.runner.graphs.state_slots is not None
    eager = LLM(**kw, enforce_eager=True)
    a = graph.generate(prompts, params, use_tqdm=False)
    b = eager.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for p, q, t in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, x.outputs[0].token_ids):
            assert abs(p[t].logprob - q[t].logprob) < 1e-3
    assert graph.engine.state_pool.num_free == graph.engine.state_pool.num_slots


def test_prefix_cache_with_snapshots_on_gpu_equals_cache_off(hybrid):
    path = hybrid["qwen3_next"]
    prompts = shared_prefix_prompts(4, per_group=4, prefix_len=70)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(model=str(path), dtype="float32", device="cuda", num_kv_blocks=256, max_num_seqs=8, block_size=16,
              max_num_batched_tokens=64, progress=False)
    on = LLM(**kw, enable_prefix_caching=True, state_snapshot_interval=32)
    off = LLM(**kw, enable_prefix_caching=False)
    first = on.generate(prompts, params, use_tqdm=False)
    again = on.generate(prompts, params, use_tqdm=False)  # now every prefix is cached
    base = off.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first] == [o.outputs[0].token_ids for o in base]
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in base]
    assert on.engine.stats().num_snapshot_hits > 0
    assert on.engine.state_pool.num_free == on.engine.state_pool.num_slots
