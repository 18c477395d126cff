"""The Gemma 2/3 decoder layer: each sublayer's output is normed again before it joins the residual.

    h = x + post_attention_norm(attn(input_norm(x)))
    out = h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))

Like DecoderLayer it carries the residual separately, so every residual add is fused into the norm after
it: the layer takes and returns (hidden, residual) with hidden + residual = the HF layer's output, and the
model's final norm adds the last pair. Parameter names are HF's.
"""
from __future__ import annotations

import torch
from torch import nn

from lamina.kernels.metadata import StepContext
from lamina.models.config import LayerSpec, ModelConfig
from lamina.models.layers.decoder import build_ffn, build_mixer
from lamina.models.layers.norm import RMSNorm
from lamina.models.layers.rope_table import RopeTable


class SandwichDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, rope: RopeTable) -> None:
        super().__init__()
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = build_mixer(cfg, spec, rope)
        self.post_attention_layernorm = norm()
        self.pre_feedforward_layernorm = norm()
        self.mlp = build_ffn(cfg, spec)
        self.post_feedforward_layernorm = norm()

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_attention_layernorm(self.self_attn(x, positions, ctx))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual
