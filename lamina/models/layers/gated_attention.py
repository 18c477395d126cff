"""Gated attention (Qwen3-Next, Qwen3.5 full-attention layers): attention whose output is scaled by
sigmoid(gate) before o_proj, the gate coming from a doubled q_proj.

HF's q_proj emits, per head, [query (D) | gate (D)]: the merged qkv projection keeps that layout in its
"q" shard (2 * H * D rows), so the checkpoint's q_proj loads unchanged. Q/K norm and partial rotary are the
config's (qk_norm, norm_offset, partial_rotary_factor), as for plain attention.
"""
from __future__ import annotations

import torch
from torch import nn  # noqa: F401  (kept for the state-binding rework of this class)

from lamina.kernels.metadata import StepContext
from lamina.models.config import LayerSpec, ModelConfig
from lamina.models.layers.attention import AttentionBase
from lamina.models.layers.linear import Linear
from lamina.models.layers.rope_table import RopeTable


class GatedAttention(AttentionBase):
    """Paged attention (the same KV spec as plain attention) with a per-head output gate."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, rope: RopeTable) -> None:
        super().__init__(cfg, spec, rope)
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, {"q": 2 * q, "k": kv, "v": kv}, bias=cfg.attention_bias)
        self.o_proj = Linear(q, cfg.hidden_size, bias=cfg.attention_bias)  # HF biases o_proj here too

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        qg, k, v = self.qkv_proj(x).split([2 * h * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q, gate = qg.view(t, h, 2 * d).chunk(2, dim=-1)
        k = k.view(t, self.num_kv_heads, d)
        v = v.view(t, self.num_kv_heads, d)
        q = self._norm_rope_store(q, k, v, positions, ctx.attn)  # q is a strided view: read in place
        out = self._paged_attention(q, ctx.attn)
        out = out.reshape(t, h * d) * torch.sigmoid(gate.reshape(t, h * d))
        return self.o_proj(out)
