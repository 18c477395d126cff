"""Nemotron-H (NVIDIA's Mamba-2 hybrids): a pattern of single-sublayer blocks in any order.

Each layer is norm -> one sublayer -> residual (layers/single_block.py), the sublayer chosen by the pattern
(`layers_block_type` as transformers 5 writes it, or the older `hybrid_override_pattern` string):
  M / linear_attention: Mamba-2 mixer (layers/mamba2.py)
  * / full_attention:   attention without RoPE (positions come from the Mamba layers), no biases
  - / mlp:              up -> relu2 -> down, no gate
  E / moe:              grouped sigmoid-routed relu2 experts + a shared expert (layers/relu2_moe.py)
Plain RMSNorms (weight, no offset), eps layer_norm_epsilon everywhere, the Mamba gated norm over groups of
intermediate / n_groups channels. dt is clamped to the config's time_step_limit (mamba_dt_limit in NVIDIA's
configs; default (0, inf): no clamp), as in Mamba-2's own kernels and transformers >= 5.25; transformers
before 5.25 clamped its chunked scan at time_step_min instead (not its single-token update), which only
changes tokens whose softplus(dt + dt_bias) falls below time_step_min.

Checkpoint names: backbone.embeddings / backbone.layers.N.norm / backbone.layers.N.mixer.* / backbone.norm_f
(as NVIDIA's checkpoints and transformers' save_pretrained write them; model.* is accepted too); the mixer
is our `self_attn` for Mamba and attention layers and our `mlp` for MLP layers. Multi-token-prediction
layers (mtp.*) are skipped.
"""
from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch

from lamina.models.config import LayerSpec, Mamba2Spec, ModelConfig, Relu2MoESpec, eos_list
from lamina.models.families.common import dt_limit, hf_targets
from lamina.models.weights import CheckpointMap, Target

ARCHITECTURES = {"NemotronHForCausalLM": "nemotron_h"}
_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_LAYERS = {"linear_attention": LayerSpec("mamba2", "none"), "full_attention": LayerSpec("attention", "none"),
           "mlp": LayerSpec("none", "plain"), "moe": LayerSpec("none", "relu2_moe")}
_SKIPPED_PREFIXES = ("mtp.", "model.mtp.", "backbone.mtp.")
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")


def layer_types(hf: dict[str, Any]) -> list[str]:
    """The block types in order, from layers_block_type (or layer_types) or hybrid_override_pattern."""
    types = hf.get("layers_block_type") or hf.get("layer_types")
    if types:
        return list(types)
    pattern = hf.get("hybrid_override_pattern")
    if not pattern:
        raise ValueError("nemotron_h: config.json has neither layers_block_type nor hybrid_override_pattern")
    unknown = sorted(set(pattern) - set(_PATTERN))
    if unknown:
        raise ValueError(f"nemotron_h: unknown hybrid_override_pattern symbols {unknown}")
    return [_PATTERN[c] for c in pattern]


def _get(hf: dict[str, Any], name: str, legacy: str, default: Any) -> Any:
    """A config number under its transformers-5 name or its older mamba_* one."""
    return hf[name] if hf.get(name) is not None else hf.get(legacy, default)


def mamba_spec(hf: dict[str, Any]) -> Mamba2Spec:
    if hf.get("mamba_hidden_act", "silu") not in ("silu", "swish"):
        raise ValueError(f"nemotron_h: unsupported mamba_hidden_act {hf['mamba_hidden_act']!r}")
    dt_min, dt_max = dt_limit(_get(hf, "time_step_limit", "mamba_dt_limit", None))
    return Mamba2Spec(num_heads=hf["mamba_num_heads"], head_dim=hf["mamba_head_dim"],
                      state_size=hf.get("ssm_state_size", 128), n_groups=_get(hf, "n_groups", "mamba_n_groups", 8),
                      conv_kernel=_get(hf, "conv_kernel", "mamba_d_conv", 4),
                      conv_bias=bool(_get(hf, "use_conv_bias", "mamba_conv_bias", True)),
                      proj_bias=bool(hf.get("use_bias", False)),
                      chunk_size=_get(hf, "chunk_size", "mamba_chunk_size", 128),
                      dt_min=dt_min, dt_max=dt_max,
                      norm_eps=hf.get("layer_norm_epsilon", 1e-5))


def moe_spec(hf: dict[str, Any]) -> Relu2MoESpec:
    return Relu2MoESpec(num_experts=hf.get("n_routed_experts", 8), top_k=hf.get("num_experts_per_tok", 2),
                        intermediate_size=hf.get("moe_intermediate_size", 7688),
                        shared_intermediate_size=hf.get("moe_shared_expert_intermediate_size", 7688),
                        n_group=hf.get("n_group") or 1, topk_group=hf.get("topk_group") or 1,
                        norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
                        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
                        latent_size=hf.get("moe_latent_size"))


def config_from_hf(family: str, hf: dict[str, Any]) -> ModelConfig:
    types = layer_types(hf)
    unknown = sorted(set(types) - set(_LAYERS))
    if unknown:
        raise ValueError(f"nemotron_h: unsupported block types {unknown}")
    if hf.get("mlp_bias"):
        raise ValueError("nemotron_h: mlp_bias is not supported")
    if hf.get("sliding_window"):
        raise ValueError("nemotron_h: sliding-window attention is not supported")
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    layers = [LayerSpec(_LAYERS[t].mixer, _LAYERS[t].ffn) for t in types]
    return ModelConfig(
        family=family,
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hf.get("intermediate_size") or 0,
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf.get("attention_head_dim") or hidden // heads,
        layers=layers,
        rms_norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        partial_rotary_factor=0.0,  # no RoPE: rotary_dim 0 leaves q and k as they are
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=False,  # HF's NemotronHAttention has no biases whatever attention_bias says
        hidden_act=hf.get("mlp_hidden_act", "relu2"),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_list(hf.get("eos_token_id")),
        torch_dtype=hf.get("dtype") or hf.get("torch_dtype"),
        mamba2=mamba_spec(hf) if "mamba2" in {s.mixer for s in layers} else None,
        relu2_moe=moe_spec(hf) if "relu2_moe" in {s.ffn for s in layers} else None,
        single_sublayer=True,
    )


def checkpoint_map(cfg: ModelConfig) -> CheckpointMap:
    """Checkpoint tensor -> (target, tensor) pairs for load_weights (see the module docstring)."""
    ffn_layers = {i for i, s in enumerate(cfg.layers) if s.mixer == "none"}

    def targets(name: str, tensor: torch.Tensor) -> Iterable[tuple[Target, torch.Tensor]]:
        if name.startswith(_SKIPPED_PREFIXES):
            return []
        if name.startswith("backbone."):
            name = "model." + name[len("backbone."):]
        if name == "model.embeddings.weight":
            name = "model.embed_tokens.weight"
        elif name == "model.norm_f.weight":
            name = "model.norm.weight"
        parts = name.split(".")
        if len(parts) > 4 and parts[:2] == ["model", "layers"] and parts[3] == "mixer":
            if int(parts[2]) in ffn_layers:  # ungated MLPs and experts: up_proj is whole, not a gate|up shard
                name = ".".join(parts[:3] + ["mlp"] + parts[4:])
                if m := _EXPERT.match(name):  # one expert's matrix -> its row of the stacked experts
                    return [(Target(f"{m[1]}.{m[3]}", expert=int(m[2])), tensor)]
                return [(Target(name), tensor)]
            parts[3] = "self_attn"
            name = ".".join(parts)
        return hf_targets(name, tensor)

    return targets
