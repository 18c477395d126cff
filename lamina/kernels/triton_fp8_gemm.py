"""Block-scaled FP8 GEMM for prefill: C [M, N] = (A [M, K] * a_scale) @ (B [N, K] * b_scale)^T (+ bias).

A is the activations quantized per token and per bk-wide group (a_scale [M, ceil(K/bk)]), B the weight with
(bn x bk) block scales (b_scale [ceil(N/bn), ceil(K/bk)]). Each BLOCK_K tile lies inside one scale group
(BLOCK_K divides bk), so the FP8 tensor-core product of a tile is exact up to fp32 accumulation and is
scaled once by a_scale[m] * b_scale[n] before it is added. Programs are ordered in GROUP_M-tall bands so
neighbouring programs reuse the same B tiles from L2.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _fp8_block_gemm_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, bias_ptr, c_ptr, M, N, K, stride_am, stride_asm,
                           stride_ask, stride_bn, stride_bsn, stride_bsk, stride_cm, group_n, group_k,
                           HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    pid = tl.program_id(0)
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    band = GROUP_M * grid_n
    first_m = (pid // band) * GROUP_M
    rows = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % band) % rows
    pid_n = (pid % band) // rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_rows = a_ptr + offs_m[:, None] * stride_am
    b_rows = b_ptr + offs_n[:, None] * stride_bn
    as_rows = as_ptr + offs_m * stride_asm
    bs_rows = bs_ptr + (offs_n // group_n) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        a = tl.load(a_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        g = k0 // group_k
        sa = tl.load(as_rows + g * stride_ask, mask=m_ok, other=0.0)
        sb = tl.load(bs_rows + g * stride_bsk, mask=n_ok, other=0.0)
        acc += tl.dot(a, tl.trans(b)) * sa[:, None] * sb[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def default_tiles(m: int, n: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, GROUP_M, num_warps, num_stages): H100/H200-sized tiles for long prefills, smaller
    ones when M is short (fewer wasted rows). Tiny under the interpreter (it is slow per element)."""
    if _INTERPRET:
        return 16, 32, 2, 4, 1
    if m <= 64:
        return 64, 128, 8, 4, 4
    return 128, 128, 8, 8, 3


MIN_BLOCK_K = 32


def fp8_block_gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                   block: tuple[int, int], out_dtype: torch.dtype, bias: torch.Tensor | None = None,
                   tiles: tuple[int, int, int, int, int] | None = None) -> torch.Tensor:
    """a fp8 [M, K], a_scale fp32 [M, ceil(K/bk)], b fp8 [N, K], b_scale fp32 [ceil(N/bn), ceil(K/bk)],
    both with unit stride along K -> C [M, N] in out_dtype. bk must be a power of two >= 32: FP8 tensor-core
    dots take K tiles of at least 32 (Triton 3.6 refused 16 on the H200; fp8_linear routes smaller blocks to
    the dequantized matmul)."""
    m, k = a.shape
    n = b.shape[0]
    bn, bk = block
    if bk < MIN_BLOCK_K:
        raise ValueError(f"fp8_block_gemm: scale blocks {block} are narrower than {MIN_BLOCK_K} along K")
    if a.stride(1) != 1 or b.stride(1) != 1 or b.shape[1] != k:
        raise ValueError(f"fp8_block_gemm: A {tuple(a.shape)} and B {tuple(b.shape)} need unit stride along K")
    block_m, block_n, group_m, warps, stages = tiles or default_tiles(m, n)
    block_k = min(128, bk)
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _fp8_block_gemm_kernel[grid](
        a, a_scale, b, b_scale, bias if bias is not None else c, c, m, n, k, a.stride(0), a_scale.stride(0),
        a_scale.stride(1), b.stride(0), b_scale.stride(0), b_scale.stride(1), c.stride(0), bn, bk,
        HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=group_m,
        num_warps=warps, num_stages=stages)
    return c
