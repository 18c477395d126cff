"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (layers/mla.py) in every layer, dense MLPs in the
first `first_k_dense_replace` layers, then MoE (routed experts + ungated shared experts) on every
`moe_layer_freq`-th layer.

Where they differ (as HF transformers 5.24 implements them):
  - routing (layers/moe_routing.py): V3 always "noaux_tc" (sigmoid scores, e_score_correction_bias for the
    choice, groups by top-2 sum, norm_topk_prob); V2 softmax with topk_method "greedy" or
    "group_limited_greedy", never renormalized (HF's V2 router ignores norm_topk_prob).
  - rope: V2's rope dims are always interleaved pairs; V3's when rope_interleave (default true).
Both scale the rope under YaRN with mscale / mscale_all_dim (layers/rope_table.py) and fold
mscale(factor, mscale_all_dim)^2 into the softmax scale.

Checkpoint names are HF's; the attention projections keep their own names (q_proj is not a q/k/v shard
here), and the multi-token-prediction layers that V3 checkpoints append (model.layers.<num_hidden_layers>...)
are skipped.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch

from lamina.models.config import LayerSpec, MLASpec, ModelConfig, MoESpec, eos_list, rope_params
from lamina.models.families.common import hf_targets
from lamina.models.weights import CheckpointMap, Target

ARCHITECTURES = {"DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3"}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def _scaling(hf: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    theta, scaling = rope_params(hf)
    if scaling is not None:
        scaling = dict(scaling)
        kind = scaling["rope_type"] = scaling.get("rope_type", scaling.get("type"))  # hub configs say "type"
        if kind == "yarn":  # YaRN's factor may be implied by the two lengths (HF's rule)
            scaling.setdefault("max_position_embeddings", hf.get("max_position_embeddings"))
            if hf.get("original_max_position_embeddings"):
                scaling.setdefault("original_max_position_embeddings", hf["original_max_position_embeddings"])
    return theta, scaling


def moe_spec(family: str, hf: dict[str, Any]) -> MoESpec | None:
    experts = int(hf.get("n_routed_experts") or 0)
    if not experts:
        return None
    if family == "deepseek_v3":
        method, renormalize = "noaux_tc", bool(hf.get("norm_topk_prob", True))
    else:
        method, renormalize = hf.get("topk_method") or "greedy", False
        if method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"deepseek_v2 topk_method {method!r} is not supported (greedy, group_limited_greedy)")
    inter = hf["moe_intermediate_size"]
    return MoESpec(num_experts=experts, top_k=hf["num_experts_per_tok"], intermediate_size=inter,
                   renormalize=renormalize, topk_method=method, n_group=hf.get("n_group") or 1,
                   topk_group=hf.get("topk_group") or 1,
                   routed_scaling_factor=float(hf.get("routed_scaling_factor") or 1.0),
                   shared_experts_intermediate_size=inter * int(hf.get("n_shared_experts") or 0))


def is_moe_layer(hf: dict[str, Any], layer: int) -> bool:
    """MoE from first_k_dense_replace on, on every moe_layer_freq-th layer (DeepSeek's rule; freq 1 in HF)."""
    dense = hf.get("first_k_dense_replace") or 0
    return bool(hf.get("n_routed_experts")) and layer >= dense and layer % (hf.get("moe_layer_freq") or 1) == 0


def config_from_hf(family: str, hf: dict[str, Any]) -> ModelConfig:
    theta, scaling = _scaling(hf)
    heads = hf["num_attention_heads"]
    n_layers = hf["num_hidden_layers"]
    mla = MLASpec(q_lora_rank=hf.get("q_lora_rank"), kv_lora_rank=hf["kv_lora_rank"],
                  qk_nope_head_dim=hf["qk_nope_head_dim"], qk_rope_head_dim=hf["qk_rope_head_dim"],
                  v_head_dim=hf["v_head_dim"],
                  rope_interleave=family == "deepseek_v2" or bool(hf.get("rope_interleave", True)))
    return ModelConfig(
        family=family,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=hf["qk_rope_head_dim"],  # what the shared RoPE table rotates
        layers=[LayerSpec("mla", "moe" if is_moe_layer(hf, i) else "dense") for i in range(n_layers)],
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)),
        hidden_act=hf.get("hidden_act", "silu"),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_list(hf.get("eos_token_id")),
        torch_dtype=hf.get("dtype") or hf.get("torch_dtype"),
        moe=moe_spec(family, hf),
        mla=mla,
    )


def checkpoint_map(cfg: ModelConfig) -> CheckpointMap:
    """HF names; attention projections as they are, MTP layers past the decoder skipped."""

    def targets(name: str, tensor: torch.Tensor) -> Iterable[tuple[Target, torch.Tensor]]:
        m = _LAYER.match(name)
        if m and int(m.group(1)) >= cfg.num_layers:
            return []
        if ".self_attn." in name:
            return [(Target(name), tensor)]
        return hf_targets(name, tensor)

    return targets
