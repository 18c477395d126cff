"""Activation quantization to FP8 in one Triton kernel (kernels.fp8.quantize_tokens is its torch reference).

x [M, K] -> q fp8 [M_pad, K] and fp32 scales, per token ([M_pad, 1]), per token and `group`-wide column
group ([M_pad, ceil(K/group)]), or one static scale. The torch reference costs six passes over an fp32 copy
of x (float, abs, amax, divide, clamp, cast): on the H200 the 8k-token prefill GEMMs spent 40-55% of their
time there (block GEMM 506 TFLOP/s alone, 330 with quantization). One program per token reads its row once
per pass (twice for per-token amax: the second read hits L1/L2) and writes q and its scales.

Rows M..M_pad (padding for GEMMs that want M a multiple of 16) are written as zeros with the tiny scale, so
the padded operands are well defined. The scale tensor can be written M-major (scales_m_major) for GEMMs that
want it so; that is a stride, not a copy.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_TINY = 1e-12  # as kernels.fp8: an all-zero token or group gets this scale instead of 0


@triton.jit
def _quant_groups_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, stride_sg,
                         GROUP: tl.constexpr, GROUPS: tl.constexpr):
    """One token; GROUPS groups of GROUP columns per step, each with its own scale."""
    row = tl.program_id(0)
    offs_g = tl.arange(0, GROUPS)
    offs_c = tl.arange(0, GROUP)
    row_ok = row < M
    for k0 in range(0, K, GROUPS * GROUP):
        kk = k0 + offs_g[:, None] * GROUP + offs_c[None, :]
        ok = (kk < K) & row_ok
        x = tl.load(x_ptr + row * stride_xm + kk, mask=ok, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=1) / 448.0, 1e-12)
        q = tl.clamp(x / scale[:, None], -448.0, 448.0)
        tl.store(q_ptr + row * stride_qm + kk, q.to(q_ptr.dtype.element_ty), mask=kk < K)
        g = k0 // GROUP + offs_g
        tl.store(s_ptr + row * stride_sm + g * stride_sg, scale, mask=g * GROUP < K)


@triton.jit
def _quant_tokens_kernel(x_ptr, q_ptr, s_ptr, static_ptr, M, K, stride_xm, stride_qm, stride_sm,
                         STATIC: tl.constexpr, BLOCK: tl.constexpr):
    """One token, one scale: its amax (or the static scale), then the scaled cast."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    row_ok = row < M
    if STATIC:
        scale = tl.load(static_ptr).to(tl.float32)
    else:
        amax = tl.zeros((BLOCK,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK):
            x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=(k0 + offs < K) & row_ok, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        scale = tl.maximum(tl.max(amax, axis=0) / 448.0, 1e-12)
    for k0 in range(0, K, BLOCK):
        x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=(k0 + offs < K) & row_ok, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -448.0, 448.0)
        tl.store(q_ptr + row * stride_qm + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=k0 + offs < K)
    tl.store(s_ptr + row * stride_sm, scale)


def quantize_tokens_triton(x: torch.Tensor, group: int | None = None, static_scale: torch.Tensor | None = None,
                           pad_m: int = 1, scales_m_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (unit stride along K) -> (q fp8 [M_pad, K], scale fp32 [M_pad, 1 or ceil(K/group)]) with
    M_pad = M rounded up to pad_m; same values as kernels.fp8.quantize_tokens on the first M rows (up to the
    rounding of fp32 division at e4m3 rounding boundaries). group: a power of two >= 16."""
    m, k = x.shape
    if x.stride(1) != 1:
        raise ValueError(f"quantize_tokens_triton wants unit stride along K, got strides {x.stride()}")
    if group is not None and (group < 16 or group & (group - 1)):
        raise ValueError(f"quantization group {group} must be a power of two >= 16")
    m_pad = -(-m // pad_m) * pad_m
    q = torch.empty(m_pad, k, dtype=FP8, device=x.device)
    cols = 1 if group is None or static_scale is not None else -(-k // group)
    s = torch.empty(cols, m_pad, dtype=torch.float32, device=x.device).t() if scales_m_major else \
        torch.empty(m_pad, cols, dtype=torch.float32, device=x.device)
    if m_pad == 0:
        return q, s
    if cols == 1:
        block = min(4096, triton.next_power_of_2(max(k, 16)))
        _quant_tokens_kernel[(m_pad,)](x, q, s, static_scale if static_scale is not None else s, m, k, x.stride(0),
                                       q.stride(0), s.stride(0), STATIC=static_scale is not None, BLOCK=block,
                                       num_warps=4)
    else:
        groups = max(1, min(16, 2048 // group, triton.next_power_of_2(cols)))
        _quant_groups_kernel[(m_pad,)](x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), s.stride(1),
                                       GROUP=group, GROUPS=groups, num_warps=4)
    return q, s
