"""Grouped gated RMSNorm (the Mamba-2 mixer's output norm, norm_before_gate=False): the gate is applied first,
then each group of channels is RMS-normalized on its own.

    h = y * silu(z)            (fp32)
    out = weight * round(h / rms(h over its group of group_size channels))

The reference follows HF's NemotronHRMSNormGated / BambaRMSNormGated rounding: the gate and the norm in fp32,
the normalized value rounded to y's dtype, then the weight multiply in that dtype. CUDA tensors go to one
Triton kernel (triton_norm_gated_grouped.py) instead of the reference's six elementwise ops and fp32
temporaries.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from lamina.kernels.dispatch import use_triton


def grouped_gated_rms_norm_ref(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
                               eps: float) -> torch.Tensor:
    """y, z: [T, I] (z may be a strided view); weight [I]; I % group_size == 0. Returns [T, I] in y's dtype."""
    t, width = y.shape
    h = y.float() * F.silu(z.float())
    h = h.view(t, width // group_size, group_size)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.view(t, width).to(y.dtype)


def grouped_gated_rms_norm(y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, group_size: int,
                           eps: float) -> torch.Tensor:
    if use_triton(y):
        from lamina.kernels.triton_norm_gated_grouped import grouped_gated_rms_norm_triton

        return grouped_gated_rms_norm_triton(y, z, weight, group_size, eps)
    return grouped_gated_rms_norm_ref(y, z, weight, group_size, eps)
