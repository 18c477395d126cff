"""The cos/sin table that every attention layer of one model shares.

The model is built on the meta device and only gets real storage afterwards, so the table cannot be computed
at construction. Instead the model creates one empty RopeTable, hands it to each attention layer's
constructor, and fills it once after loading (CausalLM.init_rope); layers only read it.
"""
from __future__ import annotations

from typing import Any

import torch

from lamina.kernels.rope import rope_cos_sin_cache, rope_inv_freq


class RopeTable:
    def __init__(self, rotary_dim: int, theta: float, scaling: dict[str, Any] | None) -> None:
        self.rotary_dim, self.theta, self.scaling = rotary_dim, theta, scaling
        self._table: torch.Tensor | None = None

    def build(self, max_positions: int, device: torch.device) -> None:
        """Computes the [max_positions, rotary_dim] fp32 table on `device` (replacing any earlier one)."""
        inv_freq, factor = rope_inv_freq(self.rotary_dim, self.theta, self.scaling)
        self._table = rope_cos_sin_cache(inv_freq, max_positions, factor).to(device)

    @property
    def table(self) -> torch.Tensor:
        if self._table is None:
            raise RuntimeError("the RoPE table is not built yet (CausalLM.init_rope after loading)")
        return self._table
