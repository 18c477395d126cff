"""Which GatedDeltaNet calls take the gated-norm + out_proj fusion (kernels/norm_gated.rms_norm_gated_linear):
at most 16 tokens on CUDA with a dense, unpartitioned, bias-free out_proj. LAMINA_FUSED_GDN_OUT=0 switches it
off; everything else keeps the two ops."""
from __future__ import annotations

import os

import torch
from torch import nn

from lamina.kernels.dispatch import use_triton
from lamina.kernels.norm_gated import MAX_FUSED_TOKENS, rms_norm_gated_linear
from lamina.models.weight_formats import DenseFormat

ENV_SWITCH = "LAMINA_FUSED_GDN_OUT"


def fused_norm_out_proj(layer: nn.Module, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor | None:
    """out_proj(norm(core, z)) for core, z [T, Hv, dv], or None when this call is not one the fusion takes.
    `layer` is a GatedDeltaNet (its `norm` and `out_proj`)."""
    if os.environ.get(ENV_SWITCH, "1") == "0" or not use_triton(core) or not 1 <= core.shape[0] <= MAX_FUSED_TOKENS:
        return None
    proj = layer.out_proj
    if type(proj.format) is not DenseFormat or proj.format.partition is not None or proj.bias is not None:
        return None
    return rms_norm_gated_linear(core, z, layer.norm.weight, layer.norm.eps, proj.weight)
