"""Rotary position embeddings (NeoX / HF "rotate_half" layout), with the rope scalings families use."""
from __future__ import annotations

import math
from typing import Any

import torch

from lamina.kernels.dispatch import use_triton


def rope_inv_freq(rot_dim: int, theta: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention factor (cos/sin multiplier) for a rope config.

    Follows the formulas of HF transformers' rope init functions, so logits match it.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, dtype=torch.int64).double() / rot_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default")) or "default"
    if kind == "default":
        return inv_freq.float(), 1.0
    if kind == "linear":
        return (inv_freq / scaling["factor"]).float(), 1.0
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled).float(), 1.0
    raise ValueError(f"unsupported rope scaling type {kind!r}")


def rope_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int, attention_factor: float = 1.0) -> torch.Tensor:
    """[max_positions, rot_dim]: cos of the half-frequencies then sin, in fp32."""
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq.float())
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    if x.dtype != torch.float32:  # skipped, not no-op casts: the CPU pays ~1 us per aten call
        x1, x2 = x1.float(), x2.float()
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def apply_rope_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hk, D]; rotates the first rot_dim dims (partial rotary keeps the rest)."""
    rot_dim = cos_sin_cache.shape[-1]
    cs = cos_sin_cache.index_select(0, positions.long())
    cos, sin = cs[:, None, : rot_dim // 2], cs[:, None, rot_dim // 2 :]

    def rot(x: torch.Tensor) -> torch.Tensor:
        if rot_dim == x.shape[-1]:
            return _rotate(x, cos, sin)
        return torch.cat([_rotate(x[..., :rot_dim], cos, sin), x[..., rot_dim:]], dim=-1)

    if rot_dim == q.shape[-1] == k.shape[-1] and q.dtype == k.dtype:
        # q and k rotated as one tensor: half the small ops (the CPU path runs this per layer per step)
        qk = rot(torch.cat([q, k], dim=1))
        return qk[:, : q.shape[1]], qk[:, q.shape[1] :]
    return rot(q), rot(k)


def apply_rope(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(q):
        from lamina.kernels.triton_rope import apply_rope_triton

        return apply_rope_triton(q, k, positions, cos_sin_cache)
    return apply_rope_ref(q, k, positions, cos_sin_cache)
