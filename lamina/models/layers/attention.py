"""Attention mixer over the paged KV pool: merged qkv projection, optional q/k norm, RoPE, KV store, attention."""
from __future__ import annotations

import torch
from torch import nn

from lamina.cache.specs import FullAttentionSpec, KVBlocks, SlidingWindowSpec
from lamina.kernels.attention import AttentionMetadata, paged_attention
from lamina.kernels.attention_prep import qk_norm_rope_store
from lamina.kernels.metadata import StepContext
from lamina.models.config import LayerSpec, ModelConfig
from lamina.models.layers.linear import Linear
from lamina.models.layers.norm import RMSNorm
from lamina.models.layers.rope_table import RopeTable


class AttentionBase(nn.Module):
    """What the attention mixers over the paged KV pool share: head geometry, optional q/k norms, the model's
    RoPE table, their KV state spec and the KV view the engine binds. Subclasses add projections + forward."""

    def __init__(self, cfg: ModelConfig, spec: LayerSpec, rope: RopeTable) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
        self.qk_norm = cfg.qk_norm
        # Gemma scales by query_pre_attn_scalar**-0.5 (its head_dim or hidden/heads), others by head_dim's.
        self.scale = float(cfg.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.softcap = cfg.attn_logit_softcap  # tanh soft-capping of the scores (Gemma 2); None: off
        self.sliding_window = spec.sliding_window
        self.rope = rope  # shared by all layers; filled by the model after loading
        self._kv: KVBlocks | None = None  # bound by the engine (views into the KV pool; stable for CUDA graphs)
        # The checkpoint's calibrated k_scale / v_scale (set_kv_scales); an FP8 cache stores K/k_scale and
        # V/v_scale. Python floats: applied as host constants, so CUDA graphs keep them.
        self.kv_scales = (1.0, 1.0)

    def set_kv_scales(self, k_scale: float, v_scale: float) -> None:
        if not all(0 < s < float("inf") for s in (k_scale, v_scale)):
            raise ValueError(f"KV cache scales must be positive and finite, got k {k_scale}, v {v_scale}")
        self.kv_scales = (float(k_scale), float(v_scale))

    @property
    def active_kv_scales(self) -> tuple[float, float]:
        """(k, v) scales of the bound cache: the checkpoint's for an FP8 cache, else 1 (nothing is rounded)."""
        return self.kv_scales if self.k_cache.dtype == torch.float8_e4m3fn else (1.0, 1.0)

    def state_spec(self, dtype: torch.dtype) -> FullAttentionSpec:
        if self.sliding_window:
            return SlidingWindowSpec(self.num_kv_heads, self.head_dim, dtype, self.sliding_window)
        return FullAttentionSpec(self.num_kv_heads, self.head_dim, dtype)

    def bind_state(self, view: KVBlocks) -> None:
        self._kv = view

    @property
    def k_cache(self) -> torch.Tensor:
        if self._kv is None:
            raise RuntimeError("no KV view bound (the engine binds one before the first forward)")
        return self._kv.k

    @property
    def v_cache(self) -> torch.Tensor:
        if self._kv is None:
            raise RuntimeError("no KV view bound (the engine binds one before the first forward)")
        return self._kv.v

    def _own(self, meta: AttentionMetadata) -> AttentionMetadata:
        """The step's addressing of the pool this layer is bound to: the window group's (cache/kv_groups.py)
        for a layer bound to that pool, else the primary one."""
        if self._kv is None or not self._kv.windowed:
            return meta
        if meta.window is None:
            raise RuntimeError("a layer bound to the window group's pool got a step without its block tables")
        return meta.window

    @property
    def cos_sin_cache(self) -> torch.Tensor:
        return self.rope.table

    def _norm_rope_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                         meta: AttentionMetadata) -> torch.Tensor:
        """q/k norm (if the model has it), RoPE, and the KV store in one op; returns the new q."""
        meta = self._own(meta)
        norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.q_norm.offset) if self.qk_norm else ()
        ks, vs = self.active_kv_scales
        if vs != 1.0:
            v = v * (1.0 / vs)
        if ks != 1.0:  # K/ks: folded into k_norm's weight (the norm would undo a scaled input), else scaled
            if self.qk_norm:
                off = self.k_norm.offset
                kw = ((self.k_norm.weight.float() + off) / ks - off).to(self.k_norm.weight.dtype)
                norm = (self.q_norm.weight, kw, self.q_norm.eps, off)
            else:
                k = k * (1.0 / ks)
        return qk_norm_rope_store(q, k, v, positions, self.cos_sin_cache, self.k_cache, self.v_cache,
                                  meta.slot_mapping, *norm)

    def _prep_attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     meta: AttentionMetadata) -> torch.Tensor:
        """_norm_rope_store then _paged_attention; under LAMINA_FUSED_ATTN_PREP=1 a decode-only CUDA batch with
        an unscaled cache runs both as one kernel (decode_prep.py), one launch fewer per layer."""
        from lamina.kernels import decode_prep

        own = self._own(meta)
        if decode_prep.applies(q, own) and self.active_kv_scales == (1.0, 1.0):
            norm = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, self.q_norm.offset) \
                if self.qk_norm else (None, None, 1e-6, 0.0)
            return decode_prep.prep_attention(q, k, v, positions, self.cos_sin_cache, self.k_cache, self.v_cache,
                                              own, self.scale, self.sliding_window, self.softcap, *norm)
        return self._paged_attention(self._norm_rope_store(q, k, v, positions, meta), meta)

    def _paged_attention(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention over the bound cache; a scaled FP8 cache's k_scale joins the softmax scale and its
        v_scale multiplies the output."""
        meta = self._own(meta)
        ks, vs = self.active_kv_scales
        out = paged_attention(q, self.k_cache, self.v_cache, meta, self.scale * ks, self.sliding_window,
                              self.softcap)
        return out if vs == 1.0 else out * vs


class Attention(AttentionBase):
    def __init__(self, cfg: ModelConfig, spec: LayerSpec, rope: RopeTable) -> None:
        super().__init__(cfg, spec, rope)
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, {"q": q, "k": kv, "v": kv}, bias=cfg.attention_bias)
        self.o_proj = Linear(q, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        return self.forward_qkv(self.qkv_proj(x), positions, ctx)

    def forward_qkv(self, qkv: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """The layer after its qkv projection (the fused decode path runs the projection with the norm)."""
        return self.o_proj(self.attend(qkv, positions, ctx))

    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Between the projections: q/k norm + RoPE + KV store, attention; [T, Hq * Dv], o_proj's input."""
        t = qkv.shape[0]
        q, k, v = qkv.split([self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                             self.num_kv_heads * self.head_dim], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        return self._prep_attend(q, k, v, positions, ctx.attn).reshape(t, -1)
