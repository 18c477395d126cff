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


def small_sparse_moe(seed: int, dtype: torch.dtype):
    """A tiny SparseMoE (12 experts, top 3, a shared expert) with random weights, on the CPU in `dtype`."""
    from lamina.models.config import LayerSpec, ModelConfig, MoESpec
    from lamina.models.layers.moe import SparseMoE

    torch.manual_seed(seed)
    cfg = ModelConfig(family="t", vocab_size=8, hidden_size=32, intermediate_size=16, num_heads=2, num_kv_heads=2,
                      head_dim=16, layers=[LayerSpec("attention", "moe")],
                      moe=MoESpec(num_experts=12, top_k=3, intermediate_size=16, renormalize=True,
                                  shared_intermediate_size=16))
    with torch.device("meta"):
        layer = SparseMoE(cfg)
    layer.to_empty(device="cpu")
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return layer.to(dtype)
