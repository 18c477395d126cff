"""The cos/sin table that every attention layer of one model shares.

The model is built on the meta device and only gets real storage afterwards, so the table cannot be computed
at construction. Instead the model creates one empty RopeTable, hands it to each attention layer's
constructor, and fills it once after loading (CausalLM.init_rope); layers only read it.

YaRN scaling (DeepSeek-V2/V3, rope_type "yarn") is computed here, following HF transformers' formulas: the
inverse frequencies blend interpolated and extrapolated ones over a linear ramp between the correction dims
of beta_fast and beta_slow, and the table is multiplied by the attention factor (mscale / mscale_all_dim).
The factor MLA adds to its softmax scale is `yarn_softmax_mscale`.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from lamina.kernels.rope import rope_cos_sin_cache, rope_inv_freq


class RopeTable:
    def __init__(self, rotary_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        self.rotary_dim, self.theta, self.scaling = rotary_dim, theta, scaling
        self._table: torch.Tensor | None = None

    def build(self, max_positions: int, device: torch.device) -> None:
        """Computes the [max_positions, rotary_dim] fp32 table on `device` (replacing any earlier one)."""
        if _kind(self.scaling) == "yarn":
            inv_freq, factor = yarn_inv_freq(self.rotary_dim, self.theta, self.scaling)
        else:
            inv_freq, factor = rope_inv_freq(self.rotary_dim, self.theta, self.scaling)
        self._table = rope_cos_sin_cache(inv_freq, max_positions, factor).to(device)

    @property
    def table(self) -> torch.Tensor:
        if self._table is None:
            raise RuntimeError("the RoPE table is not built yet (CausalLM.init_rope after loading)")
        return self._table


def _kind(scaling: dict[str, Any] | None) -> str:
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default")) or "default"


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_softmax_mscale(scaling: dict[str, Any] | None) -> float:
    """What MLA multiplies its softmax scale by under a scaled rope: mscale(factor, mscale_all_dim)**2 when the
    config sets mscale_all_dim (DeepSeek's YaRN checkpoints), else 1 (as HF's yarn_apply_mscale)."""
    if _kind(scaling) == "default" or not scaling.get("mscale_all_dim"):
        return 1.0
    return _yarn_mscale(scaling["factor"], scaling["mscale_all_dim"]) ** 2


def yarn_inv_freq(dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [dim/2] fp32, cos/sin attention factor) of YaRN. `scaling` needs factor (or
    max_position_embeddings) and original_max_position_embeddings; beta_fast/beta_slow default to 32/1."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    attention = scaling.get("attention_factor")
    if attention is None:
        ms, ms_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = _yarn_mscale(factor, ms) / _yarn_mscale(factor, ms_all) if ms and ms_all else _yarn_mscale(factor)
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp needs a non-empty interval
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: keep the original frequency (high-frequency dims), 0: interpolate by factor
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention)
