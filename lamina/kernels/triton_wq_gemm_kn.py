"""Tensor-core matmul (M > 4: decode batches, prefill) on the repacked 4-bit layout of triton_wq_gemv_kn.py,
so that one copy of a 4-bit weight could serve every M (today the old [N, K/2] copy is kept beside it).

The K order inside a word is never re-interleaved: nibble plane j of a [BLOCK_KW, BLOCK_N] word tile is
W^T at k = 8 kw + j, and sum_k x_k W[n, k] = sum_j sum_kw x[8 kw + j] plane_j[kw, n], so each K step is
8 dots of x's columns j, j + 8, ... (a strided gather of x) with plane j. First version: correctness and a
GPU measurement against the old dot path (scripts/gpu_wq_kn_bench.py); not dispatched yet.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels.triton_wq_gemv_kn import KnWeight


@triton.jit
def _kn_dot_kernel(x_ptr, q_ptr, s_ptr, o_ptr, y_ptr, M, N, KW, stride_xm, stride_qk, stride_sg, stride_ym,
                   GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
                   IEEE: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    dt = x_ptr.dtype.element_ty
    PREC: tl.constexpr = "ieee" if IEEE else "tf32"
    for kw0 in range(0, KW, BLOCK_KW):
        kw = kw0 + tl.arange(0, BLOCK_KW)
        mask_k = kw < KW
        m2 = mask_k[:, None] & mask_n[None, :]
        words = tl.load(q_ptr + kw[:, None] * stride_qk + offs_n[None, :], mask=m2, other=0)
        sp = ((kw * 8) // GROUP)[:, None] * stride_sg + offs_n[None, :]
        s = tl.load(s_ptr + sp, mask=m2, other=0.0).to(tl.float32)
        o = tl.load(o_ptr + sp, mask=m2, other=0.0).to(tl.float32)
        xp = x_ptr + offs_m[:, None] * stride_xm + kw[None, :] * 8
        xm = mask_m[:, None] & mask_k[None, :]
        for j in tl.static_range(8):
            plane = ((words >> (4 * j)) & 0xF).to(tl.float32) * s + o
            xj = tl.load(xp + j, mask=xm, other=0.0)
            acc = tl.dot(xj, plane.to(dt), acc, input_precision=PREC)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


def kn_matmul(x: torch.Tensor, w: KnWeight, block_m: int = 0, block_n: int = 128, block_kw: int = 16,
              num_warps: int = 0, num_stages: int = 3) -> torch.Tensor:
    """x [M, K] (fp16 / bf16 / fp32) -> [M, N] in x's dtype (block_kw >= 16: tl.dot's minimum K)."""
    m, k = x.shape
    kw, n = w.q.shape
    if k != 8 * kw:
        raise ValueError(f"kn_matmul: x {tuple(x.shape)} against a [{8 * kw}, {n}] weight")
    if x.stride(-1) != 1:
        x = x.contiguous()
    block_m = block_m or (16 if m <= 16 else 64 if m <= 64 else 128)
    num_warps = num_warps or (8 if block_m * block_n >= 128 * 128 else 4)
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    _kn_dot_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n))](
        x, w.q, w.scales, w.offsets, y, m, n, kw, x.stride(0), w.q.stride(0), w.scales.stride(0), y.stride(0),
        GROUP=w.group, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KW=block_kw, IEEE=x.dtype == torch.float32,
        num_warps=num_warps, num_stages=num_stages)
    return y
