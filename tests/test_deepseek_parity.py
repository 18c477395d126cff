"""DeepSeek-V2/V3 against HF transformers on tiny random fp32 checkpoints: prompt logprobs at every position
(chunked prefill forced down to 3-token chunks, so later chunks read earlier context only from the latent
cache, through the expanded form), greedy decode for 20 tokens with its logprobs (the absorbed form), the
routers against HF's own router modules, and the YaRN table and softmax scale against HF's."""
from __future__ import annotations

import functools

import pytest
import torch
from deepseek_factory import DEEPSEEK, deepseek_checkpoints
from model_factory import hf_logprobs

from lamina import LLM, SamplingParams
from lamina.models.layers.moe_routing import grouped_topk

PROMPT = [(i * 7919) % 40000 + 100 for i in range(61)]

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory, smol_tokenizer):
    return deepseek_checkpoints(tmp_path_factory, smol_tokenizer)


@functools.cache
def _hf_chosen(path) -> torch.Tensor:
    ref = hf_logprobs(path, PROMPT)
    return ref[:-1].gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0]


def make(path, **kw) -> LLM:
    kw = {"dtype": "float32", "device": "cpu", "num_kv_blocks": 64, "block_size": 4, "max_num_seqs": 4,
          "progress": False, **kw}
    return LLM(model=str(path), **kw)


def all_free(llm: LLM) -> bool:
    eng = llm.engine
    return eng.allocator.num_free == eng.allocator.num_blocks and not eng.scheduler.running and not eng.groups


@pytest.mark.parametrize("name", list(DEEPSEEK))
@pytest.mark.parametrize("chunk", [4096, 7, 3])
def test_prompt_logprobs_match_hf(ckpts, name, chunk):
    llm = make(ckpts[name], max_num_batched_tokens=chunk)
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0),
                       use_tqdm=False)[0]
    ours = torch.tensor([out.prompt_logprobs[i][PROMPT[i]].logprob for i in range(1, len(PROMPT))])
    assert (ours - _hf_chosen(ckpts[name])).abs().max().item() <= 1e-4
    assert all_free(llm)


@pytest.mark.parametrize("name", list(DEEPSEEK))
def test_greedy_decode_matches_hf(ckpts, name):
    path = ckpts[name]
    llm = make(path)
    out = llm.generate({"prompt_token_ids": PROMPT[:9]},
                       SamplingParams(temperature=0, max_tokens=20, logprobs=0, ignore_eos=True), use_tqdm=False)[0]
    gen = out.outputs[0].token_ids
    assert len(gen) == 20
    ref = hf_logprobs(path, PROMPT[:9] + gen)
    for i, tok in enumerate(gen):
        row = ref[9 + i - 1]
        assert tok == int(row.argmax()), f"greedy token {i} differs from HF"
        assert abs(out.outputs[0].logprobs[i][tok].logprob - row[tok].item()) <= 1e-4
    assert all_free(llm)


def test_the_cache_holds_one_latent_row_per_token(ckpts):
    from lamina.cache.specs import LatentAttentionSpec

    llm = make(ckpts["deepseek_v3"])
    specs = llm.engine.state_layout.kv_specs
    assert len(specs) == 3 and all(isinstance(s, LatentAttentionSpec) for s in specs)
    # kv_lora_rank 32 + rope 16 floats per token and layer, not 2 x 4 heads x 32.
    assert llm.engine.state_layout.kv_bytes_per_block(4) == 3 * 4 * (32 + 16) * 4


def _sorted(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("kind", ["v3", "v3_norm_off", "v2_greedy", "v2_group_limited"])
def test_router_matches_hf(kind):
    import transformers
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

    kw = dict(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
              routed_scaling_factor=2.5)
    if kind.startswith("v3"):
        cfg = transformers.DeepseekV3Config(**kw, norm_topk_prob=kind == "v3")
        router, method = v3.DeepseekV3TopkRouter(cfg), "noaux_tc"
    else:
        method = "greedy" if kind == "v2_greedy" else "group_limited_greedy"
        router = v2.DeepseekV2TopkRouter(transformers.DeepseekV2Config(**kw, topk_method=method))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        bias = None
        if method == "noaux_tc":
            bias = torch.randn(16, generator=g) * 0.3
            router.e_score_correction_bias.copy_(bias)
        x = torch.randn(50, 32, generator=g)
        logits, want_w, want_ids = router(x)
    w, ids = grouped_topk(logits, 4, method, 4, 2, renormalize=kind == "v3", scaling=2.5, correction_bias=bias)
    (w, ids), (want_w, want_ids) = _sorted(w, ids), _sorted(want_w, want_ids)
    assert torch.equal(ids, want_ids)
    assert torch.allclose(w, want_w, atol=1e-6)


def test_yarn_table_and_softmax_scale_match_hf():
    import transformers
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3

    from lamina.models.layers.rope_table import RopeTable, yarn_softmax_mscale

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}
    cfg = transformers.DeepseekV3Config(qk_rope_head_dim=64, qk_nope_head_dim=128, rope_parameters=dict(rope),
                                        max_position_embeddings=163840)
    emb = v3.DeepseekV3RotaryEmbedding(cfg)
    pos = torch.tensor([[0, 1, 77, 4095, 4096, 100000]])
    cos, sin = emb(torch.zeros(1, dtype=torch.float32), pos)
    table = RopeTable(64, 10000.0, rope)
    table.build(100001, torch.device("cpu"))
    ours = table.table[pos[0]]
    assert torch.allclose(ours[:, :32], cos[0, :, :32], atol=1e-5)
    assert torch.allclose(ours[:, 32:], sin[0, :, :32], atol=1e-5)
    hf_scale = v3.yarn_apply_mscale(cfg.rope_parameters, 192 ** -0.5)
    assert yarn_softmax_mscale(rope) * 192 ** -0.5 == pytest.approx(hf_scale, rel=1e-12)
    assert yarn_softmax_mscale(None) == 1.0


@pytest.mark.parametrize("name", ["deepseek_v3", "deepseek_v2"])
@pytest.mark.parametrize("budget", [1000, 4096])
def test_key_tiled_prefill_matches_hf(ckpts, name, budget, monkeypatch):
    # A tiny budget sends every chunk with context past ~14 tokens through the key-tiled online softmax
    # (16-key tiles; 1000: also 16-query sub-chunks of the 23-token chunks), as long contexts on a GPU would.
    from lamina.models.layers.mla import LatentAttention

    monkeypatch.setattr(LatentAttention, "expand_budget", budget)
    calls, tiled = [], LatentAttention._prefill_tiled
    monkeypatch.setattr(LatentAttention, "_prefill_tiled",
                        lambda self, q, rows: calls.append(1) or tiled(self, q, rows))
    llm = make(ckpts[name], max_num_batched_tokens=23)
    out = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0),
                       use_tqdm=False)[0]
    ours = torch.tensor([out.prompt_logprobs[i][PROMPT[i]].logprob for i in range(1, len(PROMPT))])
    assert (ours - _hf_chosen(ckpts[name])).abs().max().item() <= 1e-4
    assert calls
