"""Checkpoint names as HF transformers writes them for the Llama-style layout, mapped onto our parameters.

Most names are ours already (model.layers.N.self_attn.o_proj.weight). The exceptions are the projections we
fuse: q/k/v_proj load as shards of qkv_proj, gate/up_proj of gate_up_proj, the GDN's in_proj_qkv/_z/_b/_a
of in_proj, and per-expert tensors as (expert, shard) parts of the stacked experts. Whatever follows the
module name is kept (weight, bias; a quantized format's weight_scale_inv, qweight, ...), so a format whose
parameters are named like the checkpoint's needs no change here.
"""
from __future__ import annotations

import re
from collections.abc import Iterable

import torch

from lamina.models.config import ModelConfig
from lamina.models.weights import CheckpointMap, Target

# Checkpoint module name -> (our fused module name, shard).
FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
    # Gated delta net input projections (Qwen3.5 names; Qwen3-Next's are split into these by its family).
    "in_proj_qkv": ("in_proj", "qkv"),
    "in_proj_z": ("in_proj", "z"),
    "in_proj_b": ("in_proj", "b"),
    "in_proj_a": ("in_proj", "a"),
}
# One routed expert's projection -> (the stacked experts tensor, expert N, shard "gate" | "up" | none).
# A quantized format's per-expert tensors (any suffix but "weight") keep it (gate_proj.weight_scale_inv ->
# gate_up_proj_weight_scale_inv, expert N, shard "gate").
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.(\w+)$")
_IGNORED = ("rotary_emb.inv_freq",)  # buffers some checkpoints carry; we compute them


def config_float(value) -> float:
    """A config float; transformers 5 writes non-finite ones as {"__float__": "Infinity"} (JSON has none)."""
    return float(value["__float__"]) if isinstance(value, dict) else float(value)


def dt_limit(value) -> tuple[float, float]:
    """A Mamba-2 config's time_step_limit (dt clamped to it after softplus); absent or null: (0, inf)."""
    lo, hi = value if value else (0.0, float("inf"))
    return config_float(lo), config_float(hi)


def hf_target(name: str) -> Target | None:
    """Our target for an HF-named checkpoint tensor (None: not a weight we load)."""
    if any(s in name for s in _IGNORED):
        return None
    if m := _EXPERT.match(name):
        prefix, expert, proj, suffix = m.groups()
        tail = "" if suffix == "weight" else f"_{suffix}"
        if proj == "down_proj":
            return Target(f"{prefix}.down_proj{tail}", expert=int(expert))
        return Target(f"{prefix}.gate_up_proj{tail}", proj.removesuffix("_proj"), int(expert))
    parts = name.split(".")
    if len(parts) >= 3 and parts[-2] in FUSED:
        fused, shard = FUSED[parts[-2]]
        return Target(".".join(parts[:-2] + [fused, parts[-1]]), shard)
    return Target(name)


def hf_targets(name: str, tensor: torch.Tensor) -> Iterable[tuple[Target, torch.Tensor]]:
    target = hf_target(name)
    return [] if target is None else [(target, tensor)]


def checkpoint_map(cfg: ModelConfig) -> CheckpointMap:
    """The map for families whose checkpoints use these names as they are (Llama, Qwen2/3, Mistral, Qwen3-MoE)."""
    return hf_targets
