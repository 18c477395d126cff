"""Decode GEMV for FP8 weights (M <= 16 rows): y [M, N] = x [M, K] @ (q [N, K] * scale)^T (+ bias).

Memory bound: each program streams BLOCK_N weight rows once, at one byte per element (half of bf16's traffic,
which is where the decode speed-up comes from). FP8 values are exact in bf16/fp16, so the tile is upcast in
registers and multiplied on the tensor cores (rows padded to 16) with an fp32 accumulator; each BLOCK_K tile
lies inside one scale group (BLOCK_K divides the block's bk), so its partial product is scaled once per
output column before accumulating. Activations are not rounded to FP8 (weight-only).

Scales are addressed generically: element (n, k) uses scale[(n // group_n) * stride_sn + (k // group_k) *
stride_sk], which covers row scales (group_n 1, stride_sk 0) and block scales (group (bn, bk)).
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# The interpreter's bf16/fp16 dots are wrong (raw bits): there the tiles are multiplied in fp32 instead.
_DOT_F32 = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_sk,
                     stride_ym, group_n, group_k, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    s_rows = s_ptr + (offs_n // group_n) * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptr + offs_n[:, None] * stride_wn + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        s = tl.load(s_rows + (k0 // group_k) * stride_sk, mask=n_ok, other=0.0)
        if DOT_F32:
            part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)))
        else:
            part = tl.dot(x, tl.trans(w.to(x.dtype)))
        acc += part * s[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _block_n(n: int, device: torch.device) -> int:
    """Widest tile that still gives every SM about two programs (decode N can be as small as 1024)."""
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 2
    for bn in (64, 32):
        if triton.cdiv(n, bn) >= 2 * sms:
            return bn
    return 16


def scale_addressing(scale: torch.Tensor, block: tuple[int, int] | None, k: int) -> tuple[int, int, int, int]:
    """(group_n, group_k, stride_sn, stride_sk) of row scales [N] or block scales [nb, kb]."""
    if block is None:
        return 1, max(k, 1), scale.stride(0), 0
    return block[0], block[1], scale.stride(0), scale.stride(1)


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
             bias: torch.Tensor | None = None, block_n: int | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16, bf16/fp16/fp32, unit stride along K), weight fp8 [N, K] (contiguous rows), row
    scales [N] or block scales [ceil(N/bn), ceil(K/bk)] (fp32) -> y [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    if m > 16 or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"fp8_gemv takes at most 16 unit-stride rows, got {tuple(x.shape)} strides {x.stride()}")
    group_n, group_k, ssn, ssk = scale_addressing(scale, block, k)
    block_k = 128 if block is None else min(128, block[1])
    if block is not None and block[1] % block_k:
        raise ValueError(f"block width {block[1]} must be a multiple of {block_k} or a power of two below it")
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bn = block_n or _block_n(n, x.device)
    _fp8_gemv_kernel[(triton.cdiv(n, bn),)](
        x, weight, scale, bias if bias is not None else y, y, m, n, k, x.stride(0), weight.stride(0), ssn, ssk,
        y.stride(0), group_n, group_k, HAS_BIAS=bias is not None, DOT_F32=_DOT_F32 or x.dtype == torch.float32,
        BLOCK_M=16, BLOCK_N=bn, BLOCK_K=block_k, num_warps=4)
    return y
