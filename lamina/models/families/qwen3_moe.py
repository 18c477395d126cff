"""Qwen3-MoE: Qwen3 attention (q/k norm) with sparse MoE feed-forwards (no shared expert).

Checkpoints hold one tensor per expert (mlp.experts.N.{gate,up,down}_proj.weight) and the router as
mlp.gate.weight; families/common.py maps each expert tensor to its (expert, shard) slot of the stacked
experts. Layers listed in mlp_only_layers, or off the decoder_sparse_step grid, keep a dense MLP of
intermediate_size.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from lamina.models.config import ModelConfig, MoESpec
from lamina.models.families import llama

ARCHITECTURES = {"Qwen3MoeForCausalLM": "qwen3_moe"}


def num_experts(hf: dict[str, Any]) -> int:
    # transformers 5 writes num_local_experts for Qwen3-MoE; hub checkpoints say num_experts.
    return int(hf.get("num_experts", hf.get("num_local_experts")) or 0)


def is_sparse_layer(hf: dict[str, Any], layer: int) -> bool:
    """HF's rule (Qwen2-MoE, Qwen3-MoE, Qwen3-Next): MoE unless listed as MLP-only or off the sparse step."""
    step = hf.get("decoder_sparse_step", 1) or 1
    return layer not in (hf.get("mlp_only_layers") or []) and num_experts(hf) > 0 and (layer + 1) % step == 0


def moe_spec(hf: dict[str, Any], renormalize: bool) -> MoESpec:
    return MoESpec(num_experts=num_experts(hf), top_k=hf["num_experts_per_tok"],
                   intermediate_size=hf["moe_intermediate_size"], renormalize=renormalize,
                   shared_intermediate_size=hf.get("shared_expert_intermediate_size") or 0)


def config_from_hf(family: str, hf: dict[str, Any]) -> ModelConfig:
    base = llama.config_from_hf("qwen3", hf)  # attention, rope, norms and ids are Qwen3's
    layers = [dataclasses.replace(spec, ffn="moe" if is_sparse_layer(hf, i) else "dense")
              for i, spec in enumerate(base.layers)]
    moe = moe_spec(hf, bool(hf.get("norm_topk_prob", False))) if num_experts(hf) else None
    return dataclasses.replace(base, family=family, layers=layers, moe=moe)
