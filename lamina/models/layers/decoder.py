"""One decoder layer: norm -> mixer -> residual -> norm -> FFN -> residual, built from a LayerSpec.

The residual add is fused into the following norm, so each layer takes and returns (hidden, residual).
"""
from __future__ import annotations

import torch
from torch import nn

from lamina.kernels.metadata import StepContext
from lamina.models.config import LayerSpec, ModelConfig
from lamina.models.layers import dense_decode_path
from lamina.models.layers.attention import Attention
from lamina.models.layers.gated_attention import GatedAttention
from lamina.models.layers.gated_delta_net import GatedDeltaNet
from lamina.models.layers.mamba2 import Mamba2Mixer
from lamina.models.layers.mla import LatentAttention
from lamina.models.layers.mlp import GatedMLP
from lamina.models.layers.moe import SparseMoE
from lamina.models.layers.norm import RMSNorm
from lamina.models.layers.rope_table import RopeTable


def build_mixer(cfg: ModelConfig, spec: LayerSpec, rope: RopeTable) -> nn.Module:
    """Every mixer implements state_spec()/bind_state() (cache/specs.py); rope: the model's shared table."""
    if spec.mixer == "attention":
        return Attention(cfg, spec, rope)
    if spec.mixer == "gated_attention":
        return GatedAttention(cfg, spec, rope)
    if spec.mixer == "mla":
        return LatentAttention(cfg, rope)
    if spec.mixer == "gated_delta_net":
        # Held as `self_attn` like every mixer (HF calls it linear_attn; the family maps the names).
        return GatedDeltaNet(cfg, spec)
    if spec.mixer == "mamba2":
        return Mamba2Mixer(cfg, spec)
    raise ValueError(f"unsupported mixer kind {spec.mixer!r}")


def build_ffn(cfg: ModelConfig, spec: LayerSpec) -> nn.Module:
    if spec.ffn == "dense":
        return GatedMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
    if spec.ffn == "moe":
        return SparseMoE(cfg)
    if spec.ffn == "plain":
        from lamina.models.layers.single_block import PlainMLP

        return PlainMLP(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act)
    if spec.ffn == "relu2_moe":
        from lamina.models.layers.relu2_moe import Relu2MoE

        return Relu2MoE(cfg)
    raise ValueError(f"unsupported FFN kind {spec.ffn!r}")


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, rope: RopeTable) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.self_attn = build_mixer(cfg, spec, rope)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.mlp = build_ffn(cfg, spec)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        if dense_decode_path.applies(self, x):  # CUDA decode rows: norms and SiLU inside the GEMVs
            return dense_decode_path.forward(self, x, residual, positions, ctx)
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, positions, ctx)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual
