"""What the Triton kernel tests share: where they run, tolerances, and the error measure."""
from __future__ import annotations

import os

import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
TOL = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 1e-2}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref||; every output element must be finite (outputs and forbidden state slots are
    poisoned with NaN, so an unwritten element or a read of a slot the kernel must not read shows here)."""
    out, ref = out.double().cpu(), ref.double().cpu()
    assert torch.isfinite(out).all(), "non-finite output (an element left unwritten, or a poisoned state read?)"
    return ((out - ref).norm() / ref.norm()).item()
