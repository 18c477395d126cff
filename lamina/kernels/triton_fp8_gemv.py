"""Decode GEMV for FP8 weights (M <= 16 rows): y [M, N] = x [M, K] @ (q [N, K] * scale)^T (+ bias).

Memory bound: each program streams BLOCK_N weight rows once, at one byte per element (half of bf16's traffic,
which is where the decode speed-up comes from). The H200 run of 2026-12-02 measured the first kernel ("dot")
at ~1.4 TB/s, 0.77x bf16 on a decode step; the variants below attack the two suspected causes, too few bytes
in flight per SM (grids of 256-384 programs, 2 KB per program per step) and the fp8 -> bf16 conversion (no
single sm90 instruction; e4m3 -> fp16 is one cvt per two values):
- "dot": upcast the tile to x's dtype and multiply on the tensor cores (rows padded to 16), fp32 accumulator;
- "dot16": the same with both operands in fp16 (the cheap conversion; x must fit fp16's +-65504);
- "fma": no tensor cores: w widened to fp32 and multiplied into a [BLOCK_M, BLOCK_N, BLOCK_K] fp32
  accumulator reduced once after the loop (wide BLOCK_K tiles: 8-16 KB of weight per program per step). Block scales
  multiply x (one scale row per program: BLOCK_N divides bn), row scales the output.
`fp8_gemv`'s heuristic picks a variant and tiles; the bench (scripts/fp8_gpu_bench.py --sweep) times them all.
Activations are never rounded to FP8 (weight-only).

Scales are addressed generically: element (n, k) uses scale[(n // group_n) * stride_sn + (k // group_k) *
stride_sk], which covers row scales (group_n 1, stride_sk 0) and block scales (group (bn, bk)).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

# The interpreter's bf16/fp16 dots are wrong (raw bits): there the tiles are multiplied in fp32 instead.
_DOT_F32 = os.environ.get("TRITON_INTERPRET") == "1"
VARIANTS = ("dot", "dot16", "fma", "fmasum")
# LAMINA_FP8_GEMV=fmasum makes "fmasum" (2-D accumulator, reduced over K every step) the M <= 16 default;
# unset: the measured defaults below. Not yet timed on the H200.
GEMV_ENV = "LAMINA_FP8_GEMV"


@triton.jit
def _fp8_gemv_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_sk,
                     stride_ym, group_n, group_k, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr,
                     F16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
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
        elif F16:
            part = tl.dot(x.to(tl.float16), tl.trans(w.to(tl.float16)))
        else:
            part = tl.dot(x, tl.trans(w.to(x.dtype)))
        acc += part * s[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _fp8_gemv_fma_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_sk,
                         stride_ym, group_n, HAS_BIAS: tl.constexpr, ROW_SCALE: tl.constexpr,
                         GROUP_K: tl.constexpr, EVEN_K: tl.constexpr, SUM_EACH: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    w_rows = w_ptr + offs_n[:, None] * stride_wn
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    s_row = s_ptr + ((pid * BLOCK_N) // group_n) * stride_sn  # block scales: BLOCK_N divides bn
    # SUM_EACH: reduce over K every step into [BLOCK_M, BLOCK_N] (registers no longer grow with M x BLOCK_K)
    if SUM_EACH:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        if EVEN_K:  # no mask along K: the loads stay 16-byte vectors
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None], other=0.0)
            x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0.0).to(tl.float32)
        else:
            k_ok = kk < K
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        if not ROW_SCALE:
            # GROUP_K is a constexpr power of two: a shift per column, not an integer division
            x = x * tl.load(s_row + (kk // GROUP_K) * stride_sk, mask=kk < K, other=0.0)[None, :]
        if SUM_EACH:
            acc += tl.sum(w.to(tl.float32)[None, :, :] * x[:, None, :], axis=2)
        else:
            acc += w.to(tl.float32)[None, :, :] * x[:, None, :]
    if SUM_EACH:
        y = acc
    else:
        y = tl.sum(acc, axis=2)
    if ROW_SCALE:
        y = y * tl.load(s_ptr + offs_n * stride_sn, mask=n_ok, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class GemvConfig:
    """One launch of the GEMV: the variant and its tiles (block_k None: the variant's default)."""

    variant: str = "dot"
    block_n: int = 16
    block_k: int | None = None
    num_warps: int = 4


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 2
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def _block_n(n: int, device: torch.device) -> int:
    """Widest dot tile that still gives every SM about two programs (decode N can be as small as 1024)."""
    for bn in (64, 32):
        if triton.cdiv(n, bn) >= 2 * _sms(device):
            return bn
    return 16


def default_config(m: int, n: int, k: int, block: tuple[int, int] | None, device: torch.device) -> GemvConfig:
    """Measured on the H200 (scripts/fp8_gpu_bench.py --sweep, 2026-12-02; raw
    benchmarks/results/2026-12-02b/kernels/fp8_gpu_bench.json). At M = 1, "fma" with 8 rows x 1024 columns at
    4 warps was the fastest or within 1% on every Qwen3-8B shape (qkv 14.0, o 9.2, gate_up 41.0, down 22.7 us
    against bf16's 15.9 / 13.0 / 51.0 / 31.9), while the first guess (16 KB tiles at 8 warps) lost 5-25% and
    the tensor-core "dot" streamed at 0.9-2.2 TB/s. At M = 4 the fp32 [M, BLOCK_N, BLOCK_K] accumulator makes
    "fma" lose to "dot" on qkv and gate_up, and neither beats bf16 there: "dot" from M = 3 on."""
    if os.environ.get(GEMV_ENV) == "fmasum":
        bn = 8 if block is None else min(8, block[0])
        return GemvConfig("fmasum", bn, 512, 4)
    if m > 2:
        return GemvConfig("dot", _block_n(n, device))
    bn = 8 if block is None else min(8, block[0])
    return GemvConfig("fma", bn, 1024 // triton.next_power_of_2(m), 4)


def scale_addressing(scale: torch.Tensor, block: tuple[int, int] | None, k: int) -> tuple[int, int, int, int]:
    """(group_n, group_k, stride_sn, stride_sk) of row scales [N] or block scales [nb, kb]."""
    if block is None:
        return 1, max(k, 1), scale.stride(0), 0
    return block[0], block[1], scale.stride(0), scale.stride(1)


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
             bias: torch.Tensor | None = None, block_n: int | None = None,
             config: GemvConfig | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16, bf16/fp16/fp32, unit stride along K), weight fp8 [N, K] (contiguous rows), row
    scales [N] or block scales [ceil(N/bn), ceil(K/bk)] (fp32) -> y [M, N] in x's dtype. block_n alone keeps
    the "dot" variant (its tile sweep); config picks any variant."""
    m, k = x.shape
    n = weight.shape[0]
    if m > 16 or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"fp8_gemv takes at most 16 unit-stride rows, got {tuple(x.shape)} strides {x.stride()}")
    if config is None:
        config = GemvConfig("dot", block_n) if block_n else default_config(m, n, k, block, x.device)
    if config.variant not in VARIANTS:
        raise ValueError(f"unknown fp8_gemv variant {config.variant!r}; one of {VARIANTS}")
    group_n, group_k, ssn, ssk = scale_addressing(scale, block, k)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    common = (x, weight, scale, bias if bias is not None else y, y, m, n, k, x.stride(0), weight.stride(0), ssn, ssk,
              y.stride(0), group_n)
    bn = config.block_n
    if config.variant in ("fma", "fmasum"):
        if block is not None and (bn > block[0] or block[0] % bn):
            raise ValueError(f"fma tiles of {bn} rows must divide the scale block's {block[0]} rows")
        bk = config.block_k or 256
        _fp8_gemv_fma_kernel[(triton.cdiv(n, bn),)](
            *common, HAS_BIAS=bias is not None, ROW_SCALE=block is None, GROUP_K=1 if block is None else block[1],
            EVEN_K=k % bk == 0, SUM_EACH=config.variant == "fmasum",
            BLOCK_M=max(1, triton.next_power_of_2(m)), BLOCK_N=bn, BLOCK_K=bk, num_warps=config.num_warps)
        return y
    bk = config.block_k or 128
    if block is not None:
        bk = min(bk, block[1])
        if block[1] % bk:
            raise ValueError(f"block width {block[1]} must be a multiple of {bk} or a power of two below it")
    _fp8_gemv_kernel[(triton.cdiv(n, bn),)](
        *common, group_k, HAS_BIAS=bias is not None, DOT_F32=_DOT_F32 or x.dtype == torch.float32,
        F16=config.variant == "dot16", BLOCK_M=16, BLOCK_N=bn, BLOCK_K=bk, num_warps=config.num_warps)
    return y
