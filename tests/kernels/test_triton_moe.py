"""Triton fused MoE and top-k routing against the torch references, on fresh random inputs.

Runs on a CUDA machine; on a CPU only under TRITON_INTERPRET=1 (tiny shapes; fp16/fp32 only, Triton 3.6's
interpreter computes bf16 dots on raw bits). Errors are ||out - oracle|| / ||oracle|| against fused_moe_ref
on float64 copies of the inputs.
"""
from __future__ import annotations

import pytest
import torch
from kernel_helpers import CUDA, DEV, INTERPRET, TOL, rel_err

from lamina.kernels.moe import fused_moe_ref, select_experts

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def make_moe(t, e, k, h, i, dtype, gen, experts=None):
    """Random x and weights; routing through softmax top-k, restricted to `experts` when given (so the other
    experts get no tokens and the chosen ones get many)."""
    x = torch.randn(t, h, generator=gen).to(dtype)
    w13 = (torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5).to(dtype)
    w2 = (torch.randn(e, h, i, generator=gen) / i ** 0.5).to(dtype)
    logits = torch.randn(t, e, generator=gen)
    if experts is not None:
        keep = torch.full((e,), float("-inf"))
        keep[list(experts)] = 0.0
        logits = logits + keep
    weights, ids = select_experts(logits, k, renormalize=True)
    return x, w13, w2, weights.to(dtype), ids


def oracle(x, w13, w2, weights, ids):
    return fused_moe_ref(x.double().cpu(), w13.double().cpu(), w2.double().cpu(), weights.double().cpu(), ids.cpu())


# name: (T, E, k, H, I, experts routed to (None: all), align method)
MOE_CASES = {
    "t1_e8_k2": (1, 8, 2, 64, 32, None, None),
    "t5_e8_k2_odd_dims": (5, 8, 2, 80, 48, None, None),
    "empty_experts_multi_block": (24, 16, 2, 64, 32, (1, 4, 9), None),  # 3 experts, ~16 pairs each
    "torch_layout_forced": (24, 16, 2, 64, 32, (1, 4, 9, 11), "torch"),
    "e512_k10_decode": (3, 512, 10, 32, 16, None, None),
    "e512_k10_batch": (12, 512, 10, 32, 16, None, None),
    "above_small_pairs": (2100, 8, 2, 48, 16, None, None),  # 4200 pairs: torch layout, 64-row blocks
    # <= 64 pairs take per-pair GEMVs by default; the grouped GEMMs on them, and GEMVs on more pairs, forced:
    "t5_odd_dims_grouped": (5, 8, 2, 80, 48, None, "kernel"),
    "e512_k10_decode_grouped": (3, 512, 10, 32, 16, None, "kernel"),
    "e512_k10_batch_gemv": (12, 512, 10, 40, 24, None, "gemv"),
}
MOE_PARAMS = [(c, dt) for c in MOE_CASES for dt in DTYPES]


@pytest.mark.parametrize("case,dtype", MOE_PARAMS, ids=[f"{c}-{str(d)[6:]}" for c, d in MOE_PARAMS])
def test_fused_moe(case, dtype):
    from lamina.kernels.triton_moe import fused_moe_triton

    if INTERPRET and dtype == torch.bfloat16:
        pytest.skip("interpreter bf16 dots are wrong")
    t, e, k, h, i, experts, align = MOE_CASES[case]
    gen = torch.Generator().manual_seed(len(case) + 31 * t)
    x, w13, w2, weights, ids = make_moe(t, e, k, h, i, dtype, gen, experts)
    out = fused_moe_triton(x.to(DEV), w13.to(DEV), w2.to(DEV), weights.to(DEV), ids.to(DEV), align=align)
    assert out.shape == x.shape and out.dtype == dtype
    err = rel_err(out, oracle(x, w13, w2, weights, ids))
    assert err < TOL[dtype], err


@pytest.mark.parametrize("t,e,k,block_m,experts", [
    (1, 8, 2, 16, None), (5, 8, 2, 16, None), (3, 512, 10, 16, None), (40, 16, 4, 16, (0, 5, 6, 15)),
    (7, 6, 3, 64, None), (100, 32, 8, 16, (2, 3, 7, 8, 20, 30, 31, 1)),
    (40, 64, 8, 16, None)])  # 84 blocks: six programs share them
def test_align_kernel_matches_torch_layout(t, e, k, block_m, experts):
    """Both layout builders give the same padded layout: every pair once, grouped by expert in pair order."""
    from lamina.kernels.triton_moe import moe_align

    gen = torch.Generator().manual_seed(t * e + k)
    pool = torch.tensor(experts) if experts is not None else torch.arange(e)
    ids = torch.stack([pool[torch.randperm(len(pool), generator=gen)[:k]] for _ in range(t)]).to(DEV)
    s_k, b_k = moe_align(ids, e, block_m, "kernel")
    s_t, b_t = moe_align(ids, e, block_m, "torch")
    assert torch.equal(s_k, s_t) and torch.equal(b_k, b_t)
    p = t * k
    s, b, flat = s_k.cpu().long(), b_k.cpu().long(), ids.cpu().reshape(-1)
    real = s[s < p]
    assert torch.equal(real.sort().values, torch.arange(p))  # every pair exactly once
    blk = torch.arange(len(s)) // block_m
    assert torch.equal(flat[real], b[blk[s < p]])  # in a block of its expert
    assert torch.equal(real, torch.sort(flat * p + torch.arange(p)).indices)  # expert order, pair order inside
    used = b < e
    assert torch.equal(used, torch.arange(len(b)) < used.sum()) and (b[used].diff() >= 0).all()  # unused last


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("t,e,k,renorm", [(7, 8, 2, True), (5, 60, 4, False), (9, 512, 10, True),
                                          (3, 128, 1, False)])
def test_select_experts(t, e, k, renorm, dtype):
    from lamina.kernels.triton_moe import select_experts_triton

    gen = torch.Generator().manual_seed(e + k)
    # Distinct logits, exact in every dtype (multiples of 1/32 under 8 significant bits): no ties to order.
    logits = torch.stack([(torch.randperm(e, generator=gen) - e // 2) / 32 for _ in range(t)]).to(dtype)
    w_ref, id_ref = select_experts(logits, k, renorm)  # CPU tensor: the torch reference
    w, ids = select_experts_triton(logits.to(DEV), k, renorm)
    assert ids.dtype == torch.int64 and w.dtype == dtype and w.shape == (t, k)
    assert torch.equal(ids.cpu(), id_ref)
    torch.testing.assert_close(w.cpu(), w_ref, rtol=TOL[dtype], atol=1e-6)
    # A folded-in shared expert: one more logit column, appended as expert e with weight sigmoid(logit).
    with_shared = torch.cat([logits, torch.randn(t, 1, generator=gen).to(dtype)], dim=1)
    w_ref, id_ref = select_experts(with_shared, k, renorm, shared=True)
    w, ids = select_experts_triton(with_shared.to(DEV), k, renorm, shared=True)
    assert w.shape == (t, k + 1) and torch.equal(ids.cpu(), id_ref) and (id_ref[:, -1] == e).all()
    torch.testing.assert_close(w.cpu(), w_ref, rtol=TOL[dtype], atol=1e-6)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("t", [32, 1100])  # align kernel path; torch layout path (4400 pairs)
def test_fused_moe_cuda_graph_replays_other_routings(t):
    from lamina.kernels.triton_moe import fused_moe_triton

    e, k, h, i, dtype = 64, 4, 256, 128, torch.bfloat16
    gen = torch.Generator().manual_seed(t)
    x, w13, w2, weights, ids = (a.to(DEV) for a in make_moe(t, e, k, h, i, dtype, gen))
    fused_moe_triton(x, w13, w2, weights, ids)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe_triton(x, w13, w2, weights, ids)
    for experts in (None, (0, 1, 2, 3), (5, 17, 40, 63, 2, 9)):  # all; 4 experts get every token; skewed
        x2, _, _, w_new, id_new = make_moe(t, e, k, h, i, dtype, gen, experts)
        x.copy_(x2)
        weights.copy_(w_new)
        ids.copy_(id_new)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, oracle(x, w13, w2, weights, ids)) < TOL[dtype], experts


@pytest.mark.skipif(not CUDA, reason="dispatch picks Triton only for CUDA tensors")
def test_dispatch_uses_triton():
    from lamina.kernels import moe
    from lamina.kernels.dispatch import triton_available

    assert triton_available()
    gen = torch.Generator().manual_seed(3)
    x, w13, w2, _, _ = make_moe(6, 16, 2, 128, 64, torch.float16, gen)
    logits = torch.randn(6, 16, generator=gen).half()
    w, ids = moe.select_experts(logits.to(DEV), 2, True)
    w_ref, id_ref = select_experts(logits, 2, True)
    assert torch.equal(ids.cpu(), id_ref)
    out = moe.fused_moe(x.to(DEV), w13.to(DEV), w2.to(DEV), w, ids)
    assert rel_err(out, oracle(x, w13, w2, w_ref, id_ref)) < TOL[torch.float16]
