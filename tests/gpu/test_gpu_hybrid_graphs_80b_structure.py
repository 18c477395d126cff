"""GPU (skips without CUDA): hybrid mixed graphs against eager on a small model with the Qwen3-Next-80B-A3B
model's structure AND head shapes: dk = dv = 128 with value heads = 2 x key heads (the bf16 chunk kernels'
64-wide state tiles once a step has enough sequence slots), gated attention with head_dim 256 and 8 query heads
per KV head, MoE in every layer (top-10 of 64 experts + the shared expert folded in: above 372 tokens a step's
pairs take the torch layout path), prompts of several 64-token chunks cut across steps by a 1,024-token budget,
32 sequences in flight. fp32 near-exact; bf16 greedy equal up to near-ties (eager's logprob of the graph's
token within 0.1 of its best)."""
from __future__ import annotations

import random

import pytest
import torch

from lamina import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CONFIG = dict(hidden_size=512, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
              partial_rotary_factor=0.25, max_position_embeddings=4096, intermediate_size=512,
              linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=4,
              linear_num_value_heads=8, num_experts=64, num_experts_per_tok=10, moe_intermediate_size=128,
              shared_expert_intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
              full_attention_interval=4)


@pytest.fixture(autouse=True)
def _defaults(monkeypatch):
    monkeypatch.delenv("LAMINA_HYBRID_MIXED_GRAPHS", raising=False)
    monkeypatch.delenv("LAMINA_MIXED_GRAPHS", raising=False)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, smol_tokenizer):
    import transformers

    path = tmp_path_factory.mktemp("hybrid_80b_structure")
    cfg = transformers.Qwen3NextConfig(**CONFIG, vocab_size=len(smol_tokenizer),
                                       bos_token_id=smol_tokenizer.bos_token_id,
                                       eos_token_id=smol_tokenizer.eos_token_id)
    torch.manual_seed(3)
    transformers.Qwen3NextForCausalLM(cfg).float().save_pretrained(path)
    smol_tokenizer.save_pretrained(path)
    return path


def _run(llm, n=40):
    """All requests at once (the bench's shape): the first steps are prefill only, later ones cut prompts mid-way
    next to the first sequences' decode rows. Returns outputs and the graph key of every step."""
    runner, seen = llm.engine.runner, []
    orig = runner.execute

    def execute(batch):
        seen.append(runner.graphs.pick(batch) if runner.graphs is not None else None)
        return orig(batch)

    runner.execute = execute
    rng = random.Random(4)
    prompts = [{"prompt_token_ids": [rng.randrange(1000, 40000) for _ in range(rng.randint(1, 700))]}
               for _ in range(n)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=20)
    outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    runner.execute = orig
    return outs, seen


@pytest.mark.parametrize("dtype,tol,tie", [("float32", 1e-3, 1e-3), ("bfloat16", 0.1, 0.1)])
def test_hybrid_mixed_graphs_on_80b_head_shapes(checkpoint, dtype, tol, tie):
    kw = dict(model=str(checkpoint), dtype=dtype, device="cuda", num_kv_blocks=2048, block_size=16,
              max_num_seqs=32, max_num_batched_tokens=1024, enable_prefix_caching=False, progress=False)
    llm = LLM(**kw)
    assert llm.engine.runner.graphs.mixed_sizes, "mixed graphs were not captured"
    graphed, seen = _run(llm)
    llm.engine.runner.graphs = None  # the same engine (same weights), every step eager
    eager, _ = _run(llm)
    assert seen and all(k is not None for k in seen), "a step ran eagerly"
    assert any(not k.decode and k.tokens >= 512 for k in seen) and any(k.decode for k in seen)
    agree = 0
    for x, y in zip(graphed, eager):
        for i, (tx, ty) in enumerate(zip(x.token_ids, y.token_ids)):
            if tx != ty:  # only where eager's logprob of the graph's token is within `tie` of its best
                assert tx in y.logprobs[i], (i, tx, ty, "not in eager's top 20")
                gap = y.logprobs[i][ty].logprob - y.logprobs[i][tx].logprob
                assert gap <= tie, (i, tx, ty, gap)
                break
            assert abs(x.logprobs[i][tx].logprob - y.logprobs[i][ty].logprob) < tol
        else:
            agree += 1
    assert agree >= len(graphed) - (1 if dtype == "float32" else 4), f"only {agree}/{len(graphed)} agree"
    eng = llm.engine
    assert eng.allocator.num_free == eng.allocator.num_blocks and eng.state_pool.num_free == eng.state_pool.num_slots
