"""Bamba (IBM's Mamba-2 hybrid): Llama-style decoder layers whose mixer is Mamba-2, except at
`attn_layer_indices` where it is attention with RoPE on the first half of each head (transformers hardcodes
partial_rotary_factor 0.5); every layer has a SwiGLU MLP behind its own norm.

The Mamba-2 mixer's numbers come from the mamba_* keys (mamba_d_head "auto": expand * hidden / heads), its dt
clamped to time_step_limit (HF's chunked scan; None: unclamped), its gated norm and every RMSNorm at
rms_norm_eps, its activation hidden_act (SiLU).

Checkpoint names: model.layers.N.mamba.* is our self_attn (attention layers are self_attn already),
pre_ff_layernorm our post_attention_layernorm, feed_forward our mlp, model.final_layernorm our model.norm.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lamina.models.config import LayerSpec, Mamba2Spec, ModelConfig, eos_list, rope_params
from lamina.models.families.common import dt_limit, hf_targets
from lamina.models.weights import CheckpointMap, Target

ARCHITECTURES = {"BambaForCausalLM": "bamba"}
_RENAMES = ((".mamba.", ".self_attn."), (".pre_ff_layernorm.", ".post_attention_layernorm."),
            (".feed_forward.", ".mlp."))


def mamba_spec(hf: dict[str, Any]) -> Mamba2Spec:
    hidden, heads = hf["hidden_size"], hf.get("mamba_n_heads", 128)
    expand = hf.get("mamba_expand", 2)
    head_dim = hf.get("mamba_d_head", "auto")
    if head_dim in (None, "auto"):
        head_dim = expand * hidden // heads
    if head_dim * heads != expand * hidden:
        raise ValueError(f"bamba: mamba_d_head {head_dim} x mamba_n_heads {heads} != mamba_expand x hidden_size")
    dt_min, dt_max = dt_limit(hf.get("time_step_limit"))
    if hf.get("hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"bamba: unsupported hidden_act {hf['hidden_act']!r}")
    return Mamba2Spec(num_heads=heads, head_dim=head_dim, state_size=hf.get("mamba_d_state", 256),
                      n_groups=hf.get("mamba_n_groups", 1), conv_kernel=hf.get("mamba_d_conv", 4),
                      conv_bias=bool(hf.get("mamba_conv_bias", True)), proj_bias=bool(hf.get("mamba_proj_bias", False)),
                      chunk_size=hf.get("mamba_chunk_size", 256), dt_min=dt_min, dt_max=dt_max,
                      norm_eps=hf.get("rms_norm_eps", 1e-5))


def config_from_hf(family: str, hf: dict[str, Any]) -> ModelConfig:
    if hf.get("mlp_bias"):
        raise ValueError("bamba: mlp_bias is not supported")
    theta, scaling = rope_params(hf)
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    attn = set(hf.get("attn_layer_indices") or [])
    layers = [LayerSpec("attention" if i in attn else "mamba2", "dense") for i in range(hf["num_hidden_layers"])]
    return ModelConfig(
        family=family,
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hf["intermediate_size"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hidden // heads,  # BambaConfig has no head_dim
        layers=layers,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
        rope_theta=theta,
        rope_scaling=scaling,
        partial_rotary_factor=0.5,
        max_position_embeddings=hf.get("max_position_embeddings", 262144),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)),
        hidden_act=hf.get("hidden_act", "silu"),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_list(hf.get("eos_token_id")),
        torch_dtype=hf.get("dtype") or hf.get("torch_dtype"),
        mamba2=mamba_spec(hf) if len(attn) < len(layers) else None,
    )


def checkpoint_map(cfg: ModelConfig) -> CheckpointMap:
    def targets(name: str, tensor: torch.Tensor) -> Iterable[tuple[Target, torch.Tensor]]:
        if name == "model.final_layernorm.weight":
            name = "model.norm.weight"
        for old, new in _RENAMES:
            name = name.replace(old, new)
        return hf_targets(name, tensor)

    return targets
