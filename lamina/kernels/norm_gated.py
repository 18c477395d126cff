"""Gated RMSNorm: rms_norm(x) * weight * silu(gate), per head, on the output of a gated delta net layer."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lamina.kernels.dispatch import use_triton


def rms_norm_gated_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, gate: [..., D]; weight: [D]. Norm before gate, in the order of HF's Qwen3NextRMSNormGated: normalize
    in fp32, cast back, scale by weight, then multiply by silu(gate) in fp32."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * xf.to(x.dtype)
    return (y * F.silu(gate.float())).to(x.dtype)


def rms_norm_gated(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_triton(x) and x.dim() == 3:
        from lamina.kernels.triton_norm import rms_norm_gated_triton

        return rms_norm_gated_triton(x, gate, weight, eps)
    return rms_norm_gated_ref(x, gate, weight, eps)


MAX_FUSED_TOKENS = 16  # = triton_norm_gated_gemv.MAX_M


def rms_norm_gated_linear_ref(x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                              weight: torch.Tensor) -> torch.Tensor:
    """F.linear(rms_norm_gated(x, gate), weight) for x, gate [T, H, D]: the GDN layer's gated norm and out_proj."""
    t = x.shape[0]
    return F.linear(rms_norm_gated_ref(x, gate, norm_weight, eps).reshape(t, -1), weight)


def rms_norm_gated_linear(x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                          weight: torch.Tensor) -> torch.Tensor | None:
    """The gated norm fused into the out_proj GEMV (triton_norm_gated_gemv) for <= 16 tokens on CUDA with
    per-head-contiguous x and gate and a power-of-two head size; None where the caller should run the two
    ops (or the reference, off CUDA)."""
    if not use_triton(x):
        return rms_norm_gated_linear_ref(x, gate, norm_weight, eps, weight)
    t, _, d = x.shape
    if not (1 <= t <= MAX_FUSED_TOKENS and d & (d - 1) == 0 and x.stride(1) == d and gate.stride(1) == d
            and x.stride(2) == 1 and gate.stride(2) == 1 and weight.stride(-1) == 1
            and x.dtype == gate.dtype == weight.dtype):
        return None
    from lamina.kernels.triton_norm_gated_gemv import gated_norm_gemv

    return gated_norm_gemv(x, gate, norm_weight, eps, weight)
