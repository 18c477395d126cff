"""The window group on the GPU (skips without CUDA): a Gemma 3 model interleaving sliding-window and full layers,
its sliding layers' blocks in their own pool (cache/kv_groups.py), through the Triton kernels and CUDA graphs
(decode and mixed): greedy tokens and logprobs equal HF's fp32 ones over a sequence many windows long, the
window pool holds a window's worth of blocks, prefix caching on == off, and every block of both pools comes back."""
from __future__ import annotations

import pytest
import torch
from gemma_factory import WINDOW, gemma_hf_logprobs, make_gemma_checkpoint

from lamina import LLM, SamplingParams
from lamina.cache.sliding_window import window_blocks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
PROMPT = [1000 + (37 * i) % 3000 for i in range(60)]
BS, CHUNK = 4, 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, smol_tokenizer):
    return make_gemma_checkpoint(tmp_path_factory.mktemp("wg_gpu") / "g3", "gemma3_text", smol_tokenizer, seed=5)


def _llm(path, **kw) -> LLM:
    return LLM(model=str(path), dtype="float32", device="cuda", block_size=BS, max_num_batched_tokens=CHUNK,
               num_kv_blocks=128, progress=False, **kw)


def _all_free(llm: LLM) -> bool:
    e = llm.engine
    w = e.window_group.allocator
    return e.allocator.num_free == e.allocator.num_blocks and w.num_free == w.num_blocks


def test_long_decode_under_graphs_matches_hf(ckpt):
    llm = _llm(ckpt)
    assert llm.engine.runner.graphs is not None and llm.engine.window_group is not None
    w = llm.engine.window_group.allocator
    peak, allocate = [0], w.allocate

    def counted(n, after=None):
        out = allocate(n, after=after)
        peak[0] = max(peak[0], w.num_blocks - w.num_free)
        return out

    w.allocate = counted
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0, max_tokens=80, logprobs=0,
                                                                    ignore_eos=True), use_tqdm=False)[0]
    gen = out.outputs[0].token_ids
    ref = gemma_hf_logprobs(ckpt, PROMPT + gen)
    for i, tok in enumerate(gen):
        row = ref[len(PROMPT) + i - 1]
        assert tok == int(row.argmax()), f"greedy token {i} differs from HF"
        assert abs(out.outputs[0].logprobs[i][tok].logprob - row[tok].item()) <= 1e-4
    assert peak[0] <= window_blocks(WINDOW, CHUNK, BS)
    assert _all_free(llm)


def test_prefix_cache_on_equals_off_under_graphs(ckpt):
    prompts = [{"prompt_token_ids": PROMPT[:40] + [7 + i, 9, 11]} for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=0, ignore_eos=True)
    off = _llm(ckpt, enable_prefix_caching=False).generate(prompts, params, use_tqdm=False)
    on = _llm(ckpt, enable_prefix_caching=True)
    outs = [on.generate(p, params, use_tqdm=False)[0] for p in prompts]
    for a, b in zip(outs, off):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert abs(la[t].logprob - lb[t].logprob) <= 1e-4
    assert outs[1].num_cached_tokens >= 32
    assert _all_free(on)
