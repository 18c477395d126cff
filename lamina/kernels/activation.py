"""Gated activations: SiLU-and-mul (SwiGLU feed-forwards) and tanh-GELU-and-mul (GeGLU: Gemma)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lamina.kernels.dispatch import use_triton


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2*I] with gate then up halves -> [T, I]."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        from lamina.kernels.triton_activation import silu_and_mul_triton

        return silu_and_mul_triton(x)
    return silu_and_mul_ref(x)


def gelu_tanh_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2*I] with gate then up halves -> [T, I]: gelu(gate, tanh approximation) * up (HF's
    gelu_pytorch_tanh)."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x):
        from lamina.kernels.triton_activation import gelu_tanh_and_mul_triton

        return gelu_tanh_and_mul_triton(x)
    return gelu_tanh_and_mul_ref(x)
