"""Gated attention (Qwen3-Next, Qwen3.5 full-attention layers): attention whose output is scaled by
sigmoid(gate) before o_proj, the gate coming from a doubled q_proj.

HF's q_proj emits, per head, [query (D) | gate (D)]: the merged qkv projection keeps that layout in its
"q" shard (2 * H * D rows), so the checkpoint's q_proj loads unchanged. Q/K norm and partial rotary are the
config's (qk_norm, norm_offset, partial_rotary_factor), as for plain attention.
"""
from __future__ import annotations

import torch
from torch import nn

from lamina.kernels.attention import paged_attention, store_kv
from lamina.kernels.metadata import StepContext
from lamina.kernels.rope import apply_rope
from lamina.models.config import LayerSpec, ModelConfig
from lamina.models.layers.attention import Attention
from lamina.models.layers.linear import MergedLinear


class GatedAttention(Attention):
    """An Attention (so the KV pool binds it like any other) with a per-head output gate."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec) -> None:
        super().__init__(cfg, spec)
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, {"q": 2 * q, "k": kv, "v": kv}, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=cfg.attention_bias)  # HF biases o_proj here too

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        qg, k, v = self.qkv_proj(x).split([2 * h * d, self.num_kv_heads * d, self.num_kv_heads * d], dim=-1)
        q, gate = qg.view(t, h, 2 * d).chunk(2, dim=-1)
        k = k.view(t, self.num_kv_heads, d)
        v = v.view(t, self.num_kv_heads, d)
        if self.qk_norm:
            q, k = self.q_norm(q.contiguous()), self.k_norm(k)
        q, k = apply_rope(q, k, positions, self.cos_sin_cache)
        store_kv(k, v, self.k_cache, self.v_cache, ctx.attn.slot_mapping)
        out = paged_attention(q, self.k_cache, self.v_cache, ctx.attn, self.scale, self.sliding_window)
        out = out.reshape(t, h * d) * torch.sigmoid(gate.reshape(t, h * d))
        return self.o_proj(out)
