"""Nemotron-H's MoE block (layers/relu2_moe.py) against HF's NemotronHMoE module with the same weights: grouped
sigmoid routing with a correction bias, relu2 experts, latent projections, the shared expert; the router kept
fp32 in a bf16 model; the dense (CUDA-graph) expert path equal to the eager one; per-expert and stacked
checkpoint tensors load alike."""
from __future__ import annotations

import shutil

import pytest
import torch
from mamba2_factory import make_mamba2_checkpoint
from safetensors.torch import load_file, save_file

from lamina import LLM, SamplingParams
from lamina.models.config import LayerSpec, ModelConfig, Relu2MoESpec
from lamina.models.layers.relu2_moe import Relu2MoE

pytestmark = pytest.mark.usefixtures("one_thread")


def hf_moe(latent: int | None, n_group: int, topk_group: int, seed: int = 0):
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMoE

    cfg = NemotronHConfig(vocab_size=10, hidden_size=32, layers_block_type=["moe"], n_routed_experts=8,
                          num_experts_per_tok=3, moe_intermediate_size=16, moe_shared_expert_intermediate_size=24,
                          n_group=n_group, topk_group=topk_group, routed_scaling_factor=1.7, moe_latent_size=latent,
                          num_attention_heads=2, num_key_value_heads=1, mamba_num_heads=2, mamba_head_dim=4)
    torch.manual_seed(seed)
    moe = NemotronHMoE(cfg).float()
    with torch.no_grad():
        for _, p in [*moe.named_parameters(), *moe.named_buffers()]:
            p.copy_(torch.randn_like(p) * 0.3)
    return cfg, moe


def ours_like(cfg, moe) -> Relu2MoE:
    spec = Relu2MoESpec(num_experts=8, top_k=3, intermediate_size=16, shared_intermediate_size=24,
                        n_group=cfg.n_group, topk_group=cfg.topk_group, norm_topk_prob=True,
                        routed_scaling_factor=1.7, latent_size=cfg.moe_latent_size)
    mc = ModelConfig(family="nemotron_h", vocab_size=10, hidden_size=32, intermediate_size=0, num_heads=2,
                     num_kv_heads=1, head_dim=16, layers=[LayerSpec("none", "relu2_moe")], hidden_act="relu2",
                     relu2_moe=spec)
    ours = Relu2MoE(mc)
    state = moe.state_dict()  # HF's names are ours
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.copy_(state[name])
    return ours


@pytest.mark.parametrize("latent,n_group,topk_group", [(None, 1, 1), (None, 4, 2), (12, 2, 1)])
def test_matches_hf_moe(latent, n_group, topk_group):
    cfg, moe = hf_moe(latent, n_group, topk_group)
    ours = ours_like(cfg, moe)
    x = torch.randn(37, 32)
    with torch.no_grad():
        ref = moe(x[None])[0]
        out = ours(x)
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
        # the graph path: every expert on every row, weighted (0 where not chosen)
        from lamina.models.layers.relu2_moe import grouped_sigmoid_topk

        s = ours.spec
        w, ids = grouped_sigmoid_topk(ours.gate(x), ours.gate.e_score_correction_bias, s.top_k, s.n_group,
                                      s.topk_group, True, s.routed_scaling_factor)
        h = ours.fc1_latent_proj(x) if latent else x
        torch.testing.assert_close(ours.experts.dense_forward(h, w, ids), ours.experts(h, w, ids))
        _, hf_w, hf_ids = moe.gate(x)
        order = hf_ids.sort(-1).indices
        assert torch.equal(ids.sort(-1).values, hf_ids.sort(-1).values)
        torch.testing.assert_close(w.gather(1, ids.sort(-1).indices), hf_w.gather(1, order))


def test_router_stays_fp32_in_a_bf16_model():
    from lamina.models.loader import build_model

    spec = Relu2MoESpec(num_experts=4, top_k=2, intermediate_size=8, shared_intermediate_size=8)
    mc = ModelConfig(family="nemotron_h", vocab_size=10, hidden_size=16, intermediate_size=0, num_heads=2,
                     num_kv_heads=1, head_dim=8, layers=[LayerSpec("none", "relu2_moe")], hidden_act="relu2",
                     relu2_moe=spec, single_sublayer=True)
    model = build_model(mc, torch.bfloat16, torch.device("cpu"))
    moe = model.model.layers[0].mlp
    assert moe.gate.weight.dtype == moe.gate.e_score_correction_bias.dtype == torch.float32
    assert moe.experts.up_proj.dtype == moe.shared_experts.up_proj.weight.dtype == torch.bfloat16


def test_stacked_expert_checkpoint_loads(tmp_path, smol_tokenizer):
    """transformers saves one tensor per expert (experts.N.up_proj.weight); stacked [E, I, H] tensors load too."""
    src = make_mamba2_checkpoint(tmp_path / "moe", "nemotron_h_moe", smol_tokenizer, seed=4)
    dst = tmp_path / "stacked"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for layer in (1, 3):  # the E blocks of ME*EM
        p = f"backbone.layers.{layer}.mixer.experts"
        for proj in ("up_proj", "down_proj"):
            tensors[f"{p}.{proj}"] = torch.stack([tensors.pop(f"{p}.{e}.{proj}.weight") for e in range(8)])
    save_file(tensors, str(dst / "model.safetensors"))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(300, 333))}
    kw = dict(dtype="float32", device="cpu", num_kv_blocks=32, block_size=4, progress=False)
    a, b = LLM(model=str(src), **kw), LLM(model=str(dst), **kw)
    ea, eb = (m.engine.model.model.layers[1].mlp.experts for m in (a, b))
    assert torch.equal(ea.up_proj, eb.up_proj) and torch.equal(ea.down_proj, eb.down_proj)
    assert a.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids == \
        b.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids


def test_benchmark_bytes_count_only_the_routed_experts():
    from lamina.bench.offline import weight_bytes_per_token
    from lamina.models.loader import build_model

    spec = Relu2MoESpec(num_experts=4, top_k=1, intermediate_size=8, shared_intermediate_size=8)
    mc = ModelConfig(family="nemotron_h", vocab_size=10, hidden_size=16, intermediate_size=0, num_heads=2,
                     num_kv_heads=1, head_dim=8, layers=[LayerSpec("none", "relu2_moe")], hidden_act="relu2",
                     relu2_moe=spec, single_sublayer=True)
    model = build_model(mc, torch.float32, torch.device("cpu"))
    experts = model.model.layers[0].mlp.experts
    stacked = experts.up_proj.numel() + experts.down_proj.numel()
    everything = sum(p.numel() for p in model.parameters()) - model.model.embed_tokens.weight.numel()
    assert weight_bytes_per_token(model) == 4 * (everything - stacked * 3 // 4)  # fp32; 1 of 4 experts read
