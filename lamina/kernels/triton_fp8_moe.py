"""FP8 expert stacks in the MoE decode path: per-(token, slot) GEMVs that read e4m3 weights and their scales.

The layout and the work split are triton_moe.py's decode GEMVs (a handful of tokens: each pair streams its
expert's rows, no grouping by expert), with the weights at one byte per element. Scales are gathered per
element through generic addressing, scale[e, row // group_n, k // group_k] with strides (stride_sk 0 for row
scales), so one kernel serves row and block scales; they are tiny and stay in L1. Accumulation in fp32,
activations unrounded (weight-only).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fp8_gemv1_kernel(x_ptr, w_ptr, s_ptr, out_ptr, ids_ptr, top_k, N, K, stride_xm, stride_we, stride_wn,
                      stride_se, stride_sn, stride_sk, group_n, group_k, stride_om,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """inter[pair, n] = silu(x[tok] . Wg[e, n]) * (x[tok] . Wu[e, n]), W = q * scale, rows n and N + n."""
    pair = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    e = tl.load(ids_ptr + pair).to(tl.int64)
    tok = (pair // top_k).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    rows_g = offs_n.to(tl.int64)
    rows_u = rows_g + N
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        m = n_ok[:, None] & k_ok[None, :]
        xv = tl.load(x_ptr + tok * stride_xm + kk, mask=k_ok, other=0.0).to(tl.float32)
        s_k = (kk // group_k)[None, :] * stride_sk
        wg = tl.load(w_ptr + e * stride_we + rows_g[:, None] * stride_wn + kk[None, :], mask=m, other=0.0)
        sg = tl.load(s_ptr + e * stride_se + (rows_g // group_n)[:, None] * stride_sn + s_k, mask=m, other=0.0)
        wu = tl.load(w_ptr + e * stride_we + rows_u[:, None] * stride_wn + kk[None, :], mask=m, other=0.0)
        su = tl.load(s_ptr + e * stride_se + (rows_u // group_n)[:, None] * stride_sn + s_k, mask=m, other=0.0)
        acc_g += tl.sum(wg.to(tl.float32) * sg * xv[None, :], 1)
        acc_u += tl.sum(wu.to(tl.float32) * su * xv[None, :], 1)
    y = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _fp8_gemv2_kernel(a_ptr, w_ptr, s_ptr, out_ptr, ids_ptr, topk_w_ptr, N, K, stride_am, stride_we, stride_wn,
                      stride_se, stride_sn, stride_sk, group_n, group_k, stride_om,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out_pairs[pair, n] = weight[pair] * (inter[pair] . W2[e, n]), W2 = q * scale."""
    pair = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    e = tl.load(ids_ptr + pair).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    rows = offs_n.to(tl.int64)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        m = n_ok[:, None] & k_ok[None, :]
        av = tl.load(a_ptr + pair.to(tl.int64) * stride_am + kk, mask=k_ok, other=0.0).to(tl.float32)
        wv = tl.load(w_ptr + e * stride_we + rows[:, None] * stride_wn + kk[None, :], mask=m, other=0.0)
        sv = tl.load(s_ptr + e * stride_se + (rows // group_n)[:, None] * stride_sn +
                     (kk // group_k)[None, :] * stride_sk, mask=m, other=0.0)
        acc += tl.sum(wv.to(tl.float32) * sv * av[None, :], 1)
    acc = acc * tl.load(topk_w_ptr + pair).to(tl.float32)
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


def _addressing(scale: torch.Tensor, block: tuple[int, int] | None) -> tuple[int, int, int, int, int]:
    """(stride_se, stride_sn, stride_sk, group_n, group_k) of row scales [E, N] or block scales [E, nb, kb]."""
    if block is None:
        return scale.stride(0), scale.stride(1), 0, 1, 1
    return scale.stride(0), scale.stride(1), scale.stride(2), block[0], block[1]


def fp8_moe_gemv(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                 block: tuple[int, int] | None, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 block_k: int | None = None) -> torch.Tensor:
    """x [T, H] (unit stride along H), w13 fp8 [E, 2I, H], w2 fp8 [E, H, I] with row scales [E, 2I] / [E, H] or
    block scales [E, ceil(2I/bn), ceil(H/bk)] / [E, ceil(H/bn), ceil(I/bk)] -> [T, H] in x's dtype."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, h = x.shape
    inter_size = w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    p = t * top_k
    if p == 0:
        return torch.zeros_like(x)
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    inter = torch.empty(p, inter_size, dtype=x.dtype, device=x.device)
    # Whole rows in one load (as the dense GEMVs: every program has its bytes in flight at once), capped so
    # that the gathered scales do not spill.
    bk1 = block_k or min(triton.next_power_of_2(h), 4096)
    bn1 = max(1, min(16, 16384 // bk1))
    _fp8_gemv1_kernel[(p, triton.cdiv(inter_size, bn1))](
        x, w13, s13, inter, ids, top_k, inter_size, h, x.stride(0), w13.stride(0), w13.stride(1),
        *_addressing(s13, block), inter.stride(0), BLOCK_N=bn1, BLOCK_K=bk1, num_warps=8)
    out_pairs = torch.empty(p, h, dtype=x.dtype, device=x.device)
    bk2 = block_k or min(triton.next_power_of_2(inter_size), 4096)
    bn2 = max(1, min(32, 8192 // bk2))
    _fp8_gemv2_kernel[(p, triton.cdiv(h, bn2))](
        inter, w2, s2, out_pairs, ids, weights, h, inter_size, inter.stride(0), w2.stride(0), w2.stride(1),
        *_addressing(s2, block), out_pairs.stride(0), BLOCK_N=bn2, BLOCK_K=bk2, num_warps=4)
    return out_pairs.view(t, top_k, h).sum(dim=1)
