"""Tiny random DeepSeek-V2/V3 checkpoints made with HF transformers' save_pretrained (fp32), for the parity
and engine tests: MLA with and without q_lora_rank, YaRN rope with mscale_all_dim, interleaved and halved rope
dims, every routing method, shared experts, dense first layers."""
from __future__ import annotations

from pathlib import Path

import torch

_BASE = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, qk_rope_head_dim=16,
             qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
             first_k_dense_replace=1, max_position_embeddings=512, initializer_range=0.15)
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
         "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}

# name -> (config class, overrides)
DEEPSEEK = {
    # V3: q_lora_rank, YaRN with mscale_all_dim (the softmax scale gains mscale^2), noaux_tc routing with a
    # correction bias over 4 groups (2 kept), routed_scaling_factor, interleaved rope dims.
    "deepseek_v3": ("DeepseekV3Config", dict(q_lora_rank=48, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                             rope_parameters=_YARN)),
    # V3 variant: rope dims as two halves, no renormalization, MoE from layer 0, no groups.
    "deepseek_v3_halves": ("DeepseekV3Config", dict(q_lora_rank=40, n_group=1, topk_group=1, rope_interleave=False,
                                                    norm_topk_prob=False, first_k_dense_replace=0,
                                                    routed_scaling_factor=1.5)),
    # V2-Lite's layout: no q_lora_rank (one q_proj), group-limited greedy softmax routing, 2 shared experts.
    "deepseek_v2": ("DeepseekV2Config", dict(q_lora_rank=None, n_group=4, topk_group=2,
                                             topk_method="group_limited_greedy", n_shared_experts=2,
                                             routed_scaling_factor=1.0)),
    "deepseek_v2_greedy": ("DeepseekV2Config", dict(q_lora_rank=None, topk_method="greedy",
                                                    routed_scaling_factor=2.0)),
}


def make_deepseek_checkpoint(path: Path, name: str, tokenizer, seed: int = 0, **overrides) -> Path:
    import transformers

    cls_name, extra = DEEPSEEK[name]
    cfg = getattr(transformers, cls_name)(**{**_BASE, **extra, **overrides}, vocab_size=len(tokenizer),
                                          bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():  # HF initializes the correction bias to zeros: make it decide something
        for m in model.modules():
            if getattr(m, "e_score_correction_bias", None) is not None:
                m.e_score_correction_bias.normal_(0.0, 0.2)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def deepseek_checkpoints(tmp_path_factory, tokenizer) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("deepseek")
    return {n: make_deepseek_checkpoint(root / n, n, tokenizer, seed=i) for i, n in enumerate(DEEPSEEK)}
