"""Gated (SwiGLU) feed-forward: one merged gate|up matmul, SiLU-and-mul, down projection."""
from __future__ import annotations

import torch
from torch import nn

from lamina.kernels.activation import silu_and_mul
from lamina.models.layers.linear import Linear


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported activation {act!r}")
        self.gate_up_proj = Linear(hidden, {"gate": intermediate, "up": intermediate}, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
