"""Skinny FP8 weight-only GEMM for decode (M = 1..16 rows): y [M, N] = x [M, K] @ (q [N, K] * scale)^T (+ bias).

Why a second kernel next to triton_fp8_gemv.py: that file's "dot" tile multiplies x [16, BK] by a converted
weight tile transposed, so on sm90 the converted weight has to go back through shared memory to feed the
tensor cores, and its 16-row tiles stream ~2 KB per step. The H200 sweep of 2026-12-02 had it at 0.53-0.65x
bf16 from M = 4 on narrow N (qkv, o, down), while bf16 itself does not slow down with M at all.

Here the product is computed transposed ("swap AB"): acc [BLOCK_N, 16] = w [BLOCK_N, BK] @ x^T [BK, 16], so
the weight is the A operand, which the tensor cores (wgmma on sm90: 64 rows per warpgroup) take straight from
registers after the upcast (TTGIR: a dot_op opIdx 0 operand, m64n16k16 wgmma), and x^T (16 columns, rows
padded/masked) is the small B operand.
Every weight byte is read once for all M rows. The weight is upcast exactly (every e4m3 value is a bf16 and
an fp16 value), products accumulate in fp32, and the scale multiplies each BK step's partial (block scales:
BK divides the block's width) or the output (row scales). Activations are never rounded to FP8. Two
operand types (compiled for sm_90 on the CPU, ptxas/cuobjdump, 64x128 step, 4 warps, per thread):
- "tc" (bf16 x): bf16 operands; Triton upcasts e4m3 -> f16x2 (packed cvt, F2FP) then each value f16 -> bf16
  (F2F, a quarter-rate conversion): 36 F2FP + 64 F2F per step, the suspected limit of the old "dot" tile;
- "tc16": fp16 operands, one packed cvt.rn.f16x2.e4m3x2 per two weights (32 F2FP, no F2F). Each K step's x
  rows are scaled by 2^(14 - exponent of the row's max) before the (then exact) bf16 -> fp16 rounding and
  the partial unscaled by the inverse power of two, so nothing overflows fp16; values below ~2^-28 of their
  row's max in that step lose bits (fp16 subnormals), far under the bf16 output's rounding.

Narrow N (o_proj 4096, qkv 6144, down 4096 with K 12288) gives only 32-96 tiles of 64-128 rows for 132 SMs,
so K is split: SPLIT_K programs per N tile each write an fp32 partial to a workspace and bump a per-tile
counter; the last to arrive sums the partials, adds the bias, stores y and resets its counter (the same
protocol as triton_gemv.py's split-K, so a workspace can be captured in a CUDA graph and reused).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

# The interpreter's bf16/fp16 dots are wrong (raw bits): there the tiles are multiplied in fp32 instead.
_DOT_F32 = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_M = 16  # tensor-core minimum for the x^T operand: 1..16 rows, the rest masked


@triton.jit
def _fp8_skinny_kernel(x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, part_ptr, cnt_ptr, M, N, K, stride_xm, stride_wn,
                       stride_sn, stride_sk, stride_ym, group_n, k_per_split, GROUP_K: tl.constexpr,
                       ROW_SCALE: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                       DOT_F32: tl.constexpr, F16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k_lo + offs_k)[None, :]
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + (k_lo + offs_k)[:, None]  # x^T tile [BLOCK_K, BLOCK_M]
    s_rows = s_ptr + (offs_n // group_n) * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:  # no mask along K: the weight loads stay 16-byte vectors
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)
            xt = tl.load(x_ptrs, mask=m_ok[None, :], other=0.0)
        else:
            k_ok = (k0 + offs_k) < k_hi
            w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            xt = tl.load(x_ptrs, mask=m_ok[None, :] & k_ok[:, None], other=0.0)
        if F16:  # see the module docstring: rows scaled by 2^(14 - exponent of their max), fp16 operands
            xf = xt.to(tl.float32)
            e = (tl.max(tl.abs(xf), axis=0).to(tl.int32, bitcast=True) >> 23) & 0xFF  # [BLOCK_M] biased exps
            up = (tl.minimum(tl.where(e > 0, 268 - e, 127), 254) << 23).to(tl.float32, bitcast=True)  # 2^(14 - exp)
            xh = (xf * up[None, :]).to(tl.float16)
            wh = w.to(tl.float16)  # e4m3 -> f16 is one packed cvt per two values
            if DOT_F32:
                part = tl.dot(wh.to(tl.float32), xh.to(tl.float32))
            else:
                part = tl.dot(wh, xh)
            part = part * (1.0 / up)[None, :]
        elif DOT_F32:
            part = tl.dot(w.to(tl.float32), xt.to(tl.float32))
        else:
            part = tl.dot(w.to(xt.dtype), xt)
        if ROW_SCALE:
            acc += part
        else:  # BLOCK_K divides GROUP_K (a power of two): one scale column per step
            acc += part * tl.load(s_rows + (k0 // GROUP_K) * stride_sk, mask=n_ok, other=0.0)[:, None]
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    if ROW_SCALE:
        acc = acc * tl.load(s_ptr + offs_n * stride_sn, mask=n_ok, other=0.0)[:, None]
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    y_mask = n_ok[:, None] & m_ok[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        tile = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + offs_m[None, :]
        n_blocks = tl.num_programs(0)
        tl.store(part_ptr + (pid_k * n_blocks + pid_n).to(tl.int64) * (BLOCK_M * BLOCK_N) + tile, acc)
        tl.debug_barrier()  # every thread's partial is issued before the counter is released
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:  # the last split of this N tile reduces
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(part_ptr + (s * n_blocks + pid_n).to(tl.int64) * (BLOCK_M * BLOCK_N) + tile,
                                 cache_modifier=".cg")
            if HAS_BIAS:
                total += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_mask)


@dataclass(frozen=True)
class SkinnyConfig:
    """One launch: BLOCK_N weight rows (64 per 4 warps feed one wgmma), BLOCK_K columns per step (a block
    scale's width or a divisor of it), SPLIT_K programs along K, pipeline stages."""

    variant: str = "tc16"  # or "tc" (bf16 operands)
    block_n: int = 64
    block_k: int = 128
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def label(self) -> str:
        return f"{self.variant}/n{self.block_n}/k{self.block_k}/s{self.split_k}/w{self.num_warps}/st{self.num_stages}"


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # an H200's count: interpreter runs pick the GPU's configs
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


def auto_split(n: int, k: int, block_n: int, block_k: int, sms: int, waves: float = 2.0) -> int:
    """Power-of-two split of K until the programs cover `waves` x the SMs, keeping >= 4 K steps per program."""
    tiles = triton.cdiv(n, block_n)
    split = 1
    while split < 32 and tiles * split < waves * sms and k // (2 * split) >= 4 * block_k:
        split *= 2
    return split


def default_config(m: int, n: int, k: int, block: tuple[int, int] | None, device: torch.device,
                   variant: str = "tc16") -> SkinnyConfig:
    """Untimed pick (the GPU stage fp8skinny times the alternatives): 64-row tiles, 128-wide K steps (one
    scale column of a 128x128 block), K split until ~2 waves of programs cover the SMs."""
    bk = 128 if block is None else min(128, block[1])
    bk = min(bk, max(16, triton.next_power_of_2(k)))
    return SkinnyConfig(variant, 64, bk, auto_split(n, k, 64, bk, num_sms(device)), 4, 4)


def candidate_configs(m: int, n: int, k: int, block: tuple[int, int] | None, device: torch.device,
                      variant: str = "tc16") -> list[SkinnyConfig]:
    """The configs the GPU sweep times per shape: tiles x splits around default_config's."""
    bk0 = 128 if block is None else min(128, block[1])
    sms = num_sms(device)
    out: list[SkinnyConfig] = []
    for bn, bk, warps, stages in ((64, bk0, 4, 4), (64, bk0, 4, 6), (128, bk0, 8, 4), (64, 2 * bk0, 4, 3)):
        if block is not None and block[1] % bk:
            continue
        base = auto_split(n, k, bn, bk, sms)
        for split in sorted({1, base, 2 * base, max(1, base // 2)}):
            if split == 1 or k // split >= 2 * bk:
                out.append(SkinnyConfig(variant, bn, bk, split, warps, stages))
    return out


_WORKSPACES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def workspace(n: int, config: SkinnyConfig, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 partials, int32 counters) for a split-K launch, one per (device, tiles, split) kept for the
    process: launches of one stream run one after another, every launch leaves the counters zero, and a
    captured graph keeps pointing at the same buffers."""
    tiles = triton.cdiv(n, config.block_n)
    key = (device, tiles, config.block_n, config.split_k)
    ws = _WORKSPACES.get(key)
    if ws is None:
        ws = _WORKSPACES[key] = (
            torch.empty(config.split_k * tiles * config.block_n * BLOCK_M, dtype=torch.float32, device=device),
            torch.zeros(tiles, dtype=torch.int32, device=device))
    return ws


def fp8_skinny(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               bias: torch.Tensor | None = None, config: SkinnyConfig | None = None) -> torch.Tensor:
    """x [M, K] (M <= 16, bf16/fp16/fp32, unit stride on K), weight fp8 [N, K] (unit stride on K), row scales
    [N] or block scales [ceil(N/bn), ceil(K/bk)] (fp32) -> y [M, N] in x's dtype."""
    m, k = x.shape
    n = weight.shape[0]
    if m > BLOCK_M or x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"fp8_skinny takes at most 16 unit-stride rows, got {tuple(x.shape)} strides {x.stride()}")
    if config is None:
        config = default_config(m, n, k, block, x.device)
    if config.variant not in ("tc", "tc16"):
        raise ValueError(f"unknown fp8_skinny variant {config.variant!r}")
    bk = config.block_k
    if block is not None:
        if block[1] & (block[1] - 1) or block[1] % bk:
            raise ValueError(f"K steps of {bk} must divide the scale block's width {block[1]} (a power of two)")
        group_n, group_k, ssn, ssk = block[0], block[1], scale.stride(0), scale.stride(1)
    else:
        group_n, group_k, ssn, ssk = 1, 1, scale.stride(0), 0
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    split = config.split_k
    k_per_split = triton.cdiv(triton.cdiv(k, bk), split) * bk
    split = triton.cdiv(k, k_per_split)  # no empty programs (they would never reach the counter's last value)
    cfg = config if split == config.split_k else replace(config, split_k=split)
    parts, counters = workspace(n, cfg, x.device) if split > 1 else (y, y)
    grid = (triton.cdiv(n, cfg.block_n), split)
    _fp8_skinny_kernel[grid](
        x, weight, scale, bias if bias is not None else y, y, parts, counters, m, n, k, x.stride(0),
        weight.stride(0), ssn, ssk, y.stride(0), group_n, k_per_split, GROUP_K=group_k, ROW_SCALE=block is None,
        HAS_BIAS=bias is not None, EVEN_K=k % bk == 0,
        DOT_F32=_DOT_F32 or x.dtype == torch.float32, F16=cfg.variant == "tc16" and x.dtype != torch.float32,
        BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n, BLOCK_K=bk,
        SPLIT_K=split, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return y
