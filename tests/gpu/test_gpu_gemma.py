"""Gemma 2 / Gemma 3 on the GPU (skips without CUDA): the Triton paths (soft-capped attention tiles, GeGLU,
sliding windows, per-layer RoPE tables) in fp32 against HF's fp32 logprobs (1e-4, like the CPU tests), in
bf16 within twice HF's own bf16 noise, CUDA-graph decode equal to eager, and a sliding-window-only model
freeing blocks under graphs."""
from __future__ import annotations

import pytest
import torch
from gemma_factory import GEMMA_FAMILIES, WINDOW, gemma_hf_logprobs, make_gemma_checkpoint
from model_factory import assert_within_bf16_noise

from lamina import LLM, SamplingParams
from lamina.cache.sliding_window import window_blocks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PROMPT = [1000 + (37 * i) % 3000 for i in range(120)]


@pytest.fixture(scope="module")
def gemma_ckpts(tmp_path_factory, smol_tokenizer):
    root = tmp_path_factory.mktemp("gemma_gpu")
    out = {f: make_gemma_checkpoint(root / f, f, smol_tokenizer, seed=i) for i, f in enumerate(GEMMA_FAMILIES)}
    out["sliding"] = make_gemma_checkpoint(root / "sliding", "gemma3_text", smol_tokenizer, seed=9, sliding_only=True)
    return out


def _prompt_logprobs(llm, ids):
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])


def _hf_bf16(path, ids):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                              attn_implementation="eager").cuda()
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids], device="cuda")).logits[0].float().log_softmax(-1).cpu()


@pytest.mark.parametrize("family", GEMMA_FAMILIES)
@pytest.mark.parametrize("chunk", [4096, 13])
def test_fp32_prompt_logprobs_match_hf(gemma_ckpts, family, chunk):
    path = gemma_ckpts[family]
    ref = gemma_hf_logprobs(path, PROMPT)[:-1].gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    llm = LLM(model=str(path), dtype="float32", device="cuda", num_kv_blocks=64, max_num_batched_tokens=chunk,
              progress=False)
    assert (_prompt_logprobs(llm, PROMPT) - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", GEMMA_FAMILIES)
def test_bf16_prompt_logprobs_within_hf_noise(gemma_ckpts, family):
    path = gemma_ckpts[family]
    targets = torch.tensor(PROMPT[1:])[:, None]
    ref = gemma_hf_logprobs(path, PROMPT)[:-1].gather(1, targets)[:, 0]
    hf_bf16 = _hf_bf16(path, PROMPT)[:-1].gather(1, targets)[:, 0]
    llm = LLM(model=str(path), dtype="bfloat16", device="cuda", num_kv_blocks=64, progress=False)
    assert_within_bf16_noise(family, _prompt_logprobs(llm, PROMPT), ref, hf_bf16)


@pytest.mark.parametrize("family", ["gemma2", "sliding"])
def test_graph_decode_matches_eager(gemma_ckpts, family):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=0)
    prompts = [{"prompt_token_ids": PROMPT[: 5 + 9 * i]} for i in range(8)]
    kw = dict(model=str(gemma_ckpts[family]), dtype="float32", device="cuda", num_kv_blocks=256, block_size=16,
              progress=False)
    graph, eager = LLM(**kw), LLM(**kw, enforce_eager=True)
    assert graph.engine.runner.graphs is not None
    for x, y in zip(graph.generate(prompts, params, use_tqdm=False), eager.generate(prompts, params, use_tqdm=False)):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        for p, q, t in zip(x.outputs[0].logprobs, y.outputs[0].logprobs, x.outputs[0].token_ids):
            assert abs(p[t].logprob - q[t].logprob) < 1e-3
    a = graph.engine.allocator
    assert a.num_free == a.num_blocks


def test_sliding_only_long_decode_on_a_small_pool(gemma_ckpts):
    path = gemma_ckpts["sliding"]
    chunk, bs = 16, 4
    llm = LLM(model=str(path), dtype="float32", device="cuda", num_kv_blocks=window_blocks(WINDOW, chunk, bs) + 2,
              block_size=bs, max_num_batched_tokens=chunk, progress=False)
    out = llm.generate({"prompt_token_ids": PROMPT[:40]},
                       SamplingParams(temperature=0, max_tokens=100, logprobs=0, ignore_eos=True), use_tqdm=False)[0]
    gen = out.outputs[0].token_ids
    ref = gemma_hf_logprobs(path, PROMPT[:40] + gen)
    for i, tok in enumerate(gen):
        assert tok == int(ref[40 + i - 1].argmax())
    a = llm.engine.allocator
    assert a.num_free == a.num_blocks
