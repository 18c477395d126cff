"""Expert parallelism's local ids: id E (one past the local stack) marks a pair routed to another rank's
expert. Every fused-MoE path (torch reference, per-pair GEMVs, grouped GEMMs over either layout builder) must
give exactly the output of the local pairs alone (oracle: the reference with the remote pairs' weights 0 and
their ids pointed at a real expert)."""
from __future__ import annotations

import pytest
import torch
from kernel_helpers import DEV, TOL, rel_err

from lamina.kernels.moe import fused_moe_ref


def _case(t, e, k, h, i, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=gen).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) / i ** 0.5).to(dtype)
    ids = torch.stack([torch.randperm(2 * e, generator=gen)[:k] for _ in range(t)])  # half the ids are remote
    ids = torch.where(ids < e, ids, e)
    weights = torch.rand(t, k, generator=gen).to(dtype)
    return x, w13, w2, weights, ids


def _oracle(x, w13, w2, weights, ids):
    e = w13.shape[0]
    remote = ids == e
    return fused_moe_ref(x.double(), w13.double(), w2.double(), weights.double().masked_fill(remote, 0),
                         ids.masked_fill(remote, 0))


def test_reference_skips_remote_pairs():
    x, w13, w2, weights, ids = _case(9, 4, 3, 16, 8, torch.float64, 1)
    assert (ids == 4).any() and (ids < 4).any()
    assert torch.allclose(fused_moe_ref(x, w13, w2, weights, ids), _oracle(x, w13, w2, weights, ids))


@pytest.mark.parametrize("align", ["gemv", "kernel", "torch"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=lambda d: str(d)[6:])
def test_triton_paths_skip_remote_pairs(align, dtype):
    from lamina.kernels.triton_moe import fused_moe_triton

    x, w13, w2, weights, ids = _case(6, 8, 3, 32, 16, dtype, 7)
    out = fused_moe_triton(x.to(DEV), w13.to(DEV), w2.to(DEV), weights.to(DEV), ids.to(DEV), align=align,
                           remote_pairs=True)
    assert torch.isfinite(out).all()
    assert rel_err(out, _oracle(x, w13, w2, weights, ids)) < TOL[dtype]


def test_layouts_agree_with_remote_pairs():
    """Both layout builders leave the remote pairs out of every block, and agree on the rest."""
    from lamina.kernels.triton_moe import moe_align

    _, _, _, _, ids = _case(10, 8, 4, 8, 8, torch.float32, 3)
    s_k, b_k = moe_align(ids.to(DEV), 8, 16, "kernel")
    s_t, b_t = moe_align(ids.to(DEV), 8, 16, "torch")
    assert torch.equal(s_k, s_t) and torch.equal(b_k, b_t)
    p, flat = ids.numel(), ids.reshape(-1)
    placed = s_k.cpu().long()
    placed = placed[placed < p]
    assert torch.equal(placed.sort().values, torch.nonzero(flat < 8).flatten())


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU tensors through Triton's interpreter (CI); on CUDA the real "
                    "backend refuses CPU tensors")
def test_ep_layer_fused_decode_routes_like_the_unfused_path(monkeypatch):
    """A SparseMoE whose experts are rank 1's half (EPExperts): the fused decode path's routing kernel feeds the
    format the same ids and weights as the unfused router + select_experts (the all-reduce is stubbed)."""
    from lamina.models import layers
    from lamina.models.config import LayerSpec, ModelConfig, MoESpec
    from lamina.models.layers.moe import SparseMoE
    from lamina.parallel.context import ParallelContext
    from lamina.parallel.expert_parallel import EPExperts

    class NoGroup(ParallelContext):
        def all_reduce(self, x):
            return x

    torch.manual_seed(3)
    cfg = ModelConfig(family="t", vocab_size=8, hidden_size=32, intermediate_size=16, num_heads=2, num_kv_heads=2,
                      head_dim=16, layers=[LayerSpec("attention", "moe")],
                      moe=MoESpec(num_experts=8, top_k=3, intermediate_size=16, renormalize=True))
    with torch.device("meta"):
        layer = SparseMoE(cfg)
        layer.experts.set_format(EPExperts(NoGroup(1, 2)), torch.float32)
    layer.to_empty(device="cpu")
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.2)
    assert layer.experts.gate_up_proj.shape[0] == 4
    x = torch.randn(5, 32)
    want = layer(x)  # CPU: the unfused path
    monkeypatch.setattr(layers.moe_decode_path, "use_triton", lambda t: True)
    got = layers.moe_decode_path.fused_decode(layer, x)
    assert got is not None and rel_err(got, want.double()) < 1e-5
