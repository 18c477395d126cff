"""The gated delta net's per-token gates, shared by the torch reference (gated_delta.py) and the Triton
chunked path (triton_gated_delta.py); a module of its own so neither imports the other for it."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
              dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (log decay g, rate beta) from the layer's raw projections a, b: [T, Hv].

    g in fp32: in fp16/bf16 exp(A_log) * softplus could round the decay to exactly 0 or overflow."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()
