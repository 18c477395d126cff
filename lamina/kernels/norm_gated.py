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
