"""Hybrid Qwen families: Qwen3-Next, Qwen3.5 and Qwen3.5-MoE (language model only).

All three interleave Gated DeltaNet layers ("linear_attention") with gated full attention
("full_attention", usually every 4th layer), use zero-centred RMSNorm weights ((1 + w), norm_offset 1.0)
everywhere except the GDN output norm, q/k norm, and partial rotary (default 0.25 of head_dim).
Feed-forwards: Qwen3-Next is MoE with a gated shared expert (dense where mlp_only_layers/decoder_sparse_step
say), Qwen3.5 dense, Qwen3.5-MoE MoE on every layer (always renormalized top-k).

Checkpoint names, as transformers lays them out:
  - the mixer of a GDN layer is `linear_attn` in HF and `self_attn` here (every mixer is `self_attn` in the
    one loop);
  - Qwen3.5 multimodal checkpoints (…ForConditionalGeneration) keep the LM under model.language_model.* and
    carry a vision tower (model.visual.*); a multi-token-prediction head (mtp.*) may ride along: skipped
    here, loaded by the `mtp` proposer through mtp_checkpoint_map (lamina/spec/mtp_head.py);
  - Qwen3-Next fuses the GDN input projections as in_proj_qkvz / in_proj_ba, grouped per key head
    ([q_g | k_g | v_g | z_g] for each of the Hk groups); they are split into Qwen3.5's flat
    in_proj_qkv / in_proj_z / in_proj_b / in_proj_a layout here, i.e. straight into the qkv | z | b | a
    shards of the fused in_proj.
Everything else is named as families/common.py expects.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from lamina.models.config import GatedDeltaNetSpec, LayerSpec, ModelConfig, eos_list, rope_params
from lamina.models.families.common import hf_targets
from lamina.models.families.qwen3_moe import is_sparse_layer, moe_spec
from lamina.models.weights import CheckpointMap, Target

ARCHITECTURES = {
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
}
_SKIPPED_PREFIXES = ("mtp.", "model.mtp.", "model.visual.", "visual.")


def _layer_types(hf: dict[str, Any]) -> list[str]:
    types = hf.get("layer_types")
    if types:
        return list(types)
    interval = hf.get("full_attention_interval", 4)  # HF's default pattern: every 4th layer is full attention
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(hf["num_hidden_layers"])]


def _ffn(family: str, hf: dict[str, Any], layer: int) -> str:
    if family == "qwen3_5_moe":
        return "moe"
    if family == "qwen3_next":
        return "moe" if is_sparse_layer(hf, layer) else "dense"
    return "dense"


def config_from_hf(family: str, hf: dict[str, Any]) -> ModelConfig:
    theta, scaling = rope_params(hf)
    params = hf.get("rope_parameters") or {}
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 0.25))
    hidden, heads = hf["hidden_size"], hf["num_attention_heads"]
    mixers = {"linear_attention": "gated_delta_net", "full_attention": "gated_attention"}
    types = _layer_types(hf)
    unknown = sorted(set(types) - set(mixers))
    if unknown:
        raise ValueError(f"{family}: unsupported layer types {unknown}")
    layers = [LayerSpec(mixers[t], _ffn(family, hf, i)) for i, t in enumerate(types)]
    moe = None
    if any(s.ffn == "moe" for s in layers):
        moe = moe_spec(hf, family == "qwen3_5_moe" or bool(hf.get("norm_topk_prob", True)))
    return ModelConfig(
        family=family,
        vocab_size=hf["vocab_size"],
        hidden_size=hidden,
        intermediate_size=hf.get("intermediate_size") or 0,  # Qwen3.5-MoE has no dense layers
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hidden // heads,
        layers=layers,
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,  # Qwen3.5's mrope sections collapse to plain rope for text-only positions
        partial_rotary_factor=float(partial),
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_bias=bool(hf.get("attention_bias", False)),
        qk_norm=True,
        hidden_act=hf.get("hidden_act", "silu"),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=eos_list(hf.get("eos_token_id")),
        torch_dtype=hf.get("dtype") or hf.get("torch_dtype"),
        norm_offset=1.0,
        gdn=GatedDeltaNetSpec(num_k_heads=hf["linear_num_key_heads"], num_v_heads=hf["linear_num_value_heads"],
                              head_k_dim=hf["linear_key_head_dim"], head_v_dim=hf["linear_value_head_dim"],
                              conv_kernel=hf.get("linear_conv_kernel_dim", 4)),
        moe=moe,
    )


def _split_qkvz(cfg: GatedDeltaNetSpec, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-Next's per-key-head-group [q | k | v | z] rows -> (q | k | v rows, z rows)."""
    r = cfg.num_v_heads // cfg.num_k_heads
    dk, dv = cfg.head_k_dim, cfg.head_v_dim
    q, k, v, z = w.view(cfg.num_k_heads, 2 * dk + 2 * r * dv, -1).split([dk, dk, r * dv, r * dv], dim=1)
    flat = [t.reshape(-1, w.shape[-1]) for t in (q, k, v, z)]
    return torch.cat(flat[:3]), flat[3]


def _split_ba(cfg: GatedDeltaNetSpec, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    r = cfg.num_v_heads // cfg.num_k_heads
    b, a = w.view(cfg.num_k_heads, 2 * r, -1).split([r, r], dim=1)
    return b.reshape(-1, w.shape[-1]), a.reshape(-1, w.shape[-1])


def checkpoint_map(cfg: ModelConfig) -> CheckpointMap:
    """Checkpoint tensor -> (target, tensor) pairs for load_weights (see the module docstring)."""
    gdn = cfg.gdn

    def targets(name: str, tensor: torch.Tensor) -> Iterable[tuple[Target, torch.Tensor]]:
        if name.startswith(_SKIPPED_PREFIXES):
            return []
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        name = name.replace(".linear_attn.", ".self_attn.")
        if name.endswith(".in_proj_qkvz.weight"):
            qkv, z = _split_qkvz(gdn, tensor)
            param = name[: -len("_qkvz.weight")] + ".weight"
            return [(Target(param, "qkv"), qkv), (Target(param, "z"), z)]
        if name.endswith(".in_proj_ba.weight"):
            b, a = _split_ba(gdn, tensor)
            param = name[: -len("_ba.weight")] + ".weight"
            return [(Target(param, "b"), b), (Target(param, "a"), a)]
        return hf_targets(name, tensor)

    return targets


def mtp_checkpoint_map(cfg: ModelConfig) -> CheckpointMap:
    """The multi-token-prediction head's tensors (mtp.* / model.mtp.*) -> MTPHead's parameters (the prefix
    dropped; its layer is named like a decoder layer). Every other tensor is skipped."""

    def targets(name: str, tensor: torch.Tensor) -> Iterable[tuple[Target, torch.Tensor]]:
        for prefix in ("mtp.", "model.mtp."):
            if name.startswith(prefix):
                return hf_targets(name[len(prefix):], tensor)
        return []

    return targets
