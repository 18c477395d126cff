"""Gated feed-forward: one merged gate|up matmul, act-and-mul (SiLU: SwiGLU; tanh GELU: GeGLU), down
projection."""
from __future__ import annotations

import torch
from torch import nn

from lamina.kernels.activation import gelu_tanh_and_mul, silu_and_mul
from lamina.models.layers.linear import Linear

# HF activation names -> the fused act-and-mul.
_ACTS = {"silu": silu_and_mul, "swish": silu_and_mul, "gelu_pytorch_tanh": gelu_tanh_and_mul,
         "gelu_tanh": gelu_tanh_and_mul}


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, act: str = "silu", bias: bool = False) -> None:
        super().__init__()
        if act not in _ACTS:
            raise ValueError(f"unsupported activation {act!r}")
        self.act = _ACTS[act]
        self.act_kind = "silu" if self.act is silu_and_mul else "gelu_tanh"  # the GEMV prologue's name for it
        self.gate_up_proj = Linear(hidden, {"gate": intermediate, "up": intermediate}, bias=bias)
        self.down_proj = Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))
