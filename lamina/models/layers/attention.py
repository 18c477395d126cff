"""Attention mixer over the paged KV pool: merged qkv projection, optional q/k norm, RoPE, KV store, attention."""
from __future__ import annotations

import torch
from torch import nn

from lamina.kernels.attention import paged_attention, store_kv
from lamina.kernels.metadata import StepContext
from lamina.kernels.rope import apply_rope
from lamina.models.config import LayerSpec, ModelConfig
from lamina.models.layers.linear import MergedLinear
from lamina.models.layers.norm import RMSNorm


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = MergedLinear(cfg.hidden_size, {"q": q, "k": kv, "v": kv}, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
        self.qk_norm = cfg.qk_norm
        self.scale = self.head_dim**-0.5
        self.sliding_window = spec.sliding_window
        # Bound by the KV pool at start-up (views into its one allocation; stable for CUDA graphs).
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        self.cos_sin_cache: torch.Tensor | None = None  # shared by all layers, set by the model

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                             self.num_kv_heads * self.head_dim], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, k, positions, self.cos_sin_cache)
        store_kv(k, v, self.k_cache, self.v_cache, ctx.attn.slot_mapping)
        out = paged_attention(q, self.k_cache, self.v_cache, ctx.attn, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(t, -1))
