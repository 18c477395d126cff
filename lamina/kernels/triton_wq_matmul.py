"""Triton weight-quantized matmul (the layout of wq_matmul.py): y = x W^T, W dequantized in registers.

One kernel for decode (M <= 16: one 16-row tile, K split across programs so that a batch-1 GEMV still
fills the GPU; the partial sums meet in an fp32 buffer through atomic adds) and prefill (64/128-row tiles,
no split). Each program walks its K range in BLOCK_K steps: it loads the packed weight tile [BLOCK_K,
BLOCK_N] (for 4 bits each byte serves two neighbouring k), the group's scale and offset, forms
q * scale + offset in fp32, rounds it to the activations' dtype and feeds tl.dot, accumulating in fp32.
Grids are sized from host shapes only (CUDA-graph safe); the split-K buffer is allocated per call (from
the graph's pool under capture).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _wq_matmul_kernel(x_ptr, q_ptr, s_ptr, o_ptr, y_ptr, M, N, K, stride_xm, stride_qn, stride_sn, stride_ym,
                      GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_span = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_begin = pid_k * k_span
    k_end = tl.minimum(k_begin + k_span, K)
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        wmask = mask_k[:, None] & mask_n[None, :]
        if BITS == 4:
            b = tl.load(q_ptr + offs_n[None, :] * stride_qn + offs_k[:, None] // 2, mask=wmask, other=0)
            q = (b.to(tl.int32) >> ((offs_k[:, None] & 1) * 4)) & 0xF
        else:
            q = tl.load(q_ptr + offs_n[None, :] * stride_qn + offs_k[:, None], mask=wmask, other=0).to(tl.int32)
        if GROUP % BLOCK_K == 0:  # the whole tile is one group: one scale per column
            g = k0 // GROUP
            s = tl.load(s_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0).to(tl.float32)[None, :]
            o = tl.load(o_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        else:
            g = offs_k[:, None] // GROUP
            s = tl.load(s_ptr + offs_n[None, :] * stride_sn + g, mask=wmask, other=0.0).to(tl.float32)
            o = tl.load(o_ptr + offs_n[None, :] * stride_sn + g, mask=wmask, other=0.0).to(tl.float32)
        w = (q.to(tl.float32) * s + o).to(x.dtype)
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    ymask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K > 1:
        tl.atomic_add(y_ptrs, acc, mask=ymask)
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=ymask)


@dataclass(frozen=True)
class WqConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def heuristic_config(m: int, n: int, k: int, group: int, sms: int) -> WqConfig:
    """Decode: 16-row tiles and enough K splits for ~2 programs per SM; prefill: large tiles, no split."""
    if m <= 16:
        block_n, block_k = 64, 128 if group % 128 == 0 else 64
        tiles = triton.cdiv(n, block_n)
        split = max(1, min(triton.cdiv(k, block_k), triton.cdiv(2 * sms, tiles), 16))
        return WqConfig(16, block_n, block_k, split)
    block_m = 64 if m <= 64 else 128
    return WqConfig(block_m, 128, 64 if group % 64 == 0 else 32, 1, num_warps=8 if block_m == 128 else 4)


def wq_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int,
              config: WqConfig | None = None) -> torch.Tensor:
    """x [M, K] (fp16 / bf16 / fp32) -> [M, N] in x's dtype."""
    m, k = x.shape
    n = qweight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    groups = scales.shape[1]
    group = k // groups
    if bits not in (4, 8) or group * groups != k or qweight.shape[1] * (8 // bits) != k:
        raise ValueError(f"bad quantized weight: bits={bits}, K={k}, qweight {tuple(qweight.shape)}, "
                         f"scales {tuple(scales.shape)}")
    sms = _num_sms(x.device.index or 0) if x.is_cuda else 8
    cfg = config or heuristic_config(m, n, k, group, sms)
    out = torch.zeros((m, n), device=x.device, dtype=torch.float32) if cfg.split_k > 1 else \
        torch.empty((m, n), device=x.device, dtype=x.dtype)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), cfg.split_k)
    _wq_matmul_kernel[grid](x, qweight, scales, offsets, out, m, n, k, x.stride(0), qweight.stride(0),
                            scales.stride(0), out.stride(0), GROUP=group, BITS=bits, BLOCK_M=cfg.block_m,
                            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k,
                            IEEE=x.dtype == torch.float32, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out.to(x.dtype) if cfg.split_k > 1 else out
