"""RMSNorm module; with a residual it does the fused add + norm and returns the new residual too."""
from __future__ import annotations

import torch
from torch import nn

from lamina.kernels.norm import fused_add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps, self.offset = eps, offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None:
            return rms_norm(x, self.weight, self.eps, self.offset)
        return fused_add_rms_norm(x, residual, self.weight, self.eps, self.offset)
