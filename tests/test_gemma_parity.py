"""Gemma 2 / Gemma 3 (text and multimodal's language model): fp32 logprob parity with HF transformers at
every prompt position, with chunked prefill cutting inside the sliding window, greedy decode through the
paged cache, prefix cache on == off, and every block returned."""
from __future__ import annotations

import pytest
import torch
from gemma_factory import GEMMA_FAMILIES, WINDOW, gemma_hf_logprobs, make_gemma_checkpoint
from model_factory import shared_prefix_prompts

from lamina import LLM, SamplingParams

PROMPT = list(range(1000, 1030)) + [5, 17, 923, 4000, 31, 77, 12, 5000, 6, 7]  # 40 tokens, window 6


@pytest.fixture(scope="module")
def gemma_ckpts(tmp_path_factory, smol_tokenizer):
    root = tmp_path_factory.mktemp("gemma")
    return {f: make_gemma_checkpoint(root / f, f, smol_tokenizer, seed=i) for i, f in enumerate(GEMMA_FAMILIES)}


def make(path, **kw) -> LLM:
    kw = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 64, "block_size": 4, "progress": False, **kw}
    return LLM(model=str(path), **kw)


def all_free(llm: LLM) -> bool:
    a = llm.engine.allocator
    return a.num_free == a.num_blocks and not llm.engine.groups


def prompt_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0),
                       use_tqdm=False)[0]
    return torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])


def test_config_reads_the_gemma_fields(gemma_ckpts):
    from lamina.models.hf_loader import read_hf_config
    from lamina.models.registry import config_from_hf

    g2 = config_from_hf(read_hf_config(gemma_ckpts["gemma2"]))
    assert (g2.attn_logit_softcap, g2.final_logit_softcap, g2.qk_norm) == (2.0, 3.0, False)
    assert [s.sliding_window for s in g2.layers] == [WINDOW, None, WINDOW, WINDOW]
    for fam in ("gemma3_text", "gemma3"):
        g3 = config_from_hf(read_hf_config(gemma_ckpts[fam]))
        assert g3.family == fam and g3.qk_norm and g3.attn_logit_softcap is None
        assert [s.rope_theta for s in g3.layers] == [100.0, 10000.0, 100.0, 100.0]
        assert g3.layers[1].rope_scaling["factor"] == 4.0 and g3.layers[0].rope_scaling is None
        assert g3.query_pre_attn_scalar == 24 and g3.embed_scale == 8.0 and g3.norm_offset == 1.0


@pytest.mark.parametrize("family", GEMMA_FAMILIES)
@pytest.mark.parametrize("chunk", [2048, 7, 3])  # 7 and 3 cut inside blocks and inside the window
def test_prompt_logprobs_match_hf(gemma_ckpts, family, chunk):
    path = gemma_ckpts[family]
    ref = gemma_hf_logprobs(path, PROMPT)
    ref_chosen = ref[:-1].gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]
    llm = make(path, max_num_batched_tokens=chunk)
    ours = prompt_logprobs(llm, PROMPT)
    assert (ours - ref_chosen).abs().max().item() <= 1e-4
    assert all_free(llm)


@pytest.mark.parametrize("family", GEMMA_FAMILIES)
def test_decode_logprobs_match_hf(gemma_ckpts, family):
    path = gemma_ckpts[family]
    llm = make(path)
    out = llm.generate({"prompt_token_ids": PROMPT[:9]},
                       SamplingParams(temperature=0, max_tokens=20, logprobs=0, ignore_eos=True), use_tqdm=False)[0]
    gen = out.outputs[0].token_ids
    ref = gemma_hf_logprobs(path, PROMPT[:9] + gen)
    for i, tok in enumerate(gen):
        row = ref[9 + i - 1]
        assert tok == int(row.argmax()), f"greedy token {i} differs from HF"
        assert abs(out.outputs[0].logprobs[i][tok].logprob - row[tok].item()) <= 1e-4
    assert all_free(llm)


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text"])
def test_prefix_cache_on_equals_off(gemma_ckpts, family):
    prompts = shared_prefix_prompts(2, per_group=3)
    params = SamplingParams(temperature=0, max_tokens=10, logprobs=0, ignore_eos=True)
    off = make(gemma_ckpts[family], enable_prefix_caching=False).generate(prompts, params, use_tqdm=False)
    on = make(gemma_ckpts[family], enable_prefix_caching=True, max_num_batched_tokens=9)
    for _ in range(2):  # the second round hits the cache for every prefix
        outs = on.generate(prompts, params, use_tqdm=False)
        for a, b in zip(outs, off):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for la, lb, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
                assert abs(la[t].logprob - lb[t].logprob) <= 1e-4
    assert on.engine.prefix_cache.hit_tokens > 0
    assert all_free(on)
