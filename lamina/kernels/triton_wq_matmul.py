"""Triton weight-quantized matmul (the layout of wq_matmul.py): y = x W^T, W dequantized in registers.

Why this shape (the first version measured 0.035x bf16 at batch 1 on the H200): it loaded the 4-bit tile as
[BLOCK_K, BLOCK_N] at q + n * stride + k // 2. Triton's axis analysis sees no contiguity through k // 2, so
every element was its own 1-byte load, each byte fetched twice, with neighbouring threads 2 KB apart (one
weight row each): ~1/32 of every 32-byte sector used. Here every weight load is a [BLOCK_N, BLOCK_K / 2]
uint8 tile contiguous along K (16-byte vector loads per thread, whole sectors used); the nibbles are split
in registers into the even-k and odd-k half-tiles, and x is split to match (x[2j] pairs with the low
nibble of byte j, x[2j+1] with the high one), so no interleave is needed. Scales and offsets are loaded
once per (row, group) and broadcast in registers.

Kernels (WqConfig.kernel):
- "gemv" / "gemv_pf" (decode, M <= 4; _pf loads step i + 1 before step i's math): one x row per
  program, no tensor cores; acc [BLOCK_N, BLOCK_K/2] fp32 takes
  elementwise FMAs and is reduced over K once at the end. Programs of the same weight tile for
  different rows are launched side by side (row is grid axis 0), so the tile is read from HBM once and
  from L2 for the other rows. The nibble -> float conversion is the exponent trick (q | 0x4B000000 read as
  fp32 is 2^23 + q): integer-to-float converts run at 16/clk/SM on Hopper, a quarter of the FP32 rate,
  and at 2 per byte they would cap the kernel near 2 TB/s; MAGIC=False keeps the plain convert (bench A/B).
- "dot" (M > 4): tl.dot of the even/odd x half-tiles with the two dequantized half-tiles (transposed).
- "dot_join" (M > 4, the heuristic's pick): the half-tiles interleaved back (tl.join + reshape) into one
  [BLOCK_N, BLOCK_K] tile and one dot with the contiguous x tile (bench A/B against "dot").
Checked by compiling for sm_90 on a CPU machine (triton.compile with a GPUTarget, SASS via cuobjdump):
gemv: one LDG.E.128 per thread per 16 weight bytes, no I2F (32 per step with MAGIC=False), no spills;
dot_join: weights and x through LDGSTS.128 (cp.async), "dot": the x half-tiles as scalar LDG.U16.
Split-K (atomic adds into fp32) only where the N tiles alone do not fill the GPU: for a batch-1 GEMV it
costs a memset and a cast launch per linear. Grids are sized from host shapes only (CUDA-graph safe).

Bytes loaded per program per K step, 4 bits, BLOCK_N x BLOCK_K (old: BLOCK_N x BLOCK_K one-byte loads
of BLOCK_N x BLOCK_K / 2 distinct bytes, plus BLOCK_N x BLOCK_K scale and offset loads when the group is
smaller than the tile). New: BLOCK_N x BLOCK_K / 2 bytes in 16-byte vectors (K % BLOCK_K == 0, as in all
real shapes; a ragged K masks the tail), plus BLOCK_N x max(1, BLOCK_K / group) x 4 bytes of scales.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _nibbles(b, MAGIC: tl.constexpr):
    """uint8 tile -> (low, high) nibbles as exact fp32."""
    b = b.to(tl.int32)
    if MAGIC:
        lo = ((b & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        hi = ((b >> 4) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    else:
        lo = (b & 0xF).to(tl.float32)
        hi = (b >> 4).to(tl.float32)
    return lo, hi


@triton.jit
def _group_params(s_ptr, o_ptr, offs_n, mask_n, k0, G, stride_sn, GROUP: tl.constexpr, BLOCK_K: tl.constexpr):
    """The scales and offsets of one K step: [BLOCK_N] when the step lies in one group, else [BLOCK_N,
    BLOCK_K / GROUP] (one load per row and group, contiguous along the groups)."""
    if GROUP >= BLOCK_K:
        g = k0 // GROUP
        s = tl.load(s_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0).to(tl.float32)
        o = tl.load(o_ptr + offs_n * stride_sn + g, mask=mask_n, other=0.0).to(tl.float32)
    else:
        offs_g = k0 // GROUP + tl.arange(0, BLOCK_K // GROUP)
        ptrs = offs_n[:, None] * stride_sn + offs_g[None, :]
        gmask = mask_n[:, None] & (offs_g < G)[None, :]
        s = tl.load(s_ptr + ptrs, mask=gmask, other=0.0).to(tl.float32)
        o = tl.load(o_ptr + ptrs, mask=gmask, other=0.0).to(tl.float32)
    return s, o


@triton.jit
def _apply(v, s, o, BLOCK_N: tl.constexpr, WIDTH: tl.constexpr, GROUP_W: tl.constexpr):
    """v [BLOCK_N, WIDTH] integers (fp32) -> v * scale + offset, GROUP_W consecutive columns per group."""
    if GROUP_W >= WIDTH:
        return v * s[:, None] + o[:, None]
    else:
        v3 = tl.reshape(v, (BLOCK_N, WIDTH // GROUP_W, GROUP_W))
        return tl.reshape(v3 * s[:, :, None] + o[:, :, None], (BLOCK_N, WIDTH))


@triton.jit
def _raw_tile(q_ptr, s_ptr, o_ptr, offs_n, mask_n, k0, K, G, stride_qn, stride_sn, GROUP: tl.constexpr,
              BITS: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """The packed bytes of one K step ([BLOCK_N, BLOCK_K / 2] uint8 for 4 bits, [BLOCK_N, BLOCK_K] int8),
    its scales and offsets; mask_n False loads nothing (the gemv's prefetch past the last step)."""
    s, o = _group_params(s_ptr, o_ptr, offs_n, mask_n, k0, G, stride_sn, GROUP, BLOCK_K)
    if BITS == 4:
        offs_b = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        row_bytes = K // 2
    else:
        offs_b = k0 + tl.arange(0, BLOCK_K)
        row_bytes = K
    ptrs = q_ptr + offs_n[:, None] * stride_qn + offs_b[None, :]
    if EVEN_K:
        b = tl.load(ptrs, mask=mask_n[:, None], other=0)
    else:
        b = tl.load(ptrs, mask=mask_n[:, None] & (offs_b < row_bytes)[None, :], other=0)
    return b, s, o


@triton.jit
def _dequant(b, s, o, GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             MAGIC: tl.constexpr):
    """Dequantized fp32 weights of one K step. 4 bits: (even-k, odd-k) half-tiles [BLOCK_N, BLOCK_K / 2];
    8 bits: the tile [BLOCK_N, BLOCK_K] twice."""
    if BITS == 4:
        lo, hi = _nibbles(b, MAGIC)
        w0 = _apply(lo, s, o, BLOCK_N, BLOCK_K // 2, GROUP // 2)
        w1 = _apply(hi, s, o, BLOCK_N, BLOCK_K // 2, GROUP // 2)
    else:
        w0 = _apply(b.to(tl.float32), s, o, BLOCK_N, BLOCK_K, GROUP)
        w1 = w0
    return w0, w1


@triton.jit
def _weight_tile(q_ptr, s_ptr, o_ptr, offs_n, mask_n, k0, K, G, stride_qn, stride_sn, GROUP: tl.constexpr,
                 BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 MAGIC: tl.constexpr):
    b, s, o = _raw_tile(q_ptr, s_ptr, o_ptr, offs_n, mask_n, k0, K, G, stride_qn, stride_sn, GROUP, BITS, BLOCK_K,
                        EVEN_K)
    return _dequant(b, s, o, GROUP, BITS, BLOCK_N, BLOCK_K, MAGIC)


@triton.jit
def _x_mask(mask_m, offs_x, K, EVEN_K: tl.constexpr):
    """No K term when K is whole steps: a mask varying along K would split the x loads into scalars."""
    if EVEN_K:
        return mask_m[:, None]  # tl.load broadcasts it over the tile
    else:
        return mask_m[:, None] & (offs_x < K)[None, :]


@triton.jit
def _k_range(K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    steps = tl.cdiv(K, BLOCK_K)
    per = tl.cdiv(steps, SPLIT_K)
    first = tl.program_id(2) * per
    return first, tl.minimum(first + per, steps)


@triton.jit
def _store(y_ptr, acc, offs_m, offs_n, mask_m, mask_n, stride_ym, SPLIT_K: tl.constexpr):
    ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
    ymask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K > 1:
        tl.atomic_add(ptrs, acc, mask=ymask)
    else:
        tl.store(ptrs, acc.to(y_ptr.dtype.element_ty), mask=ymask)


@triton.jit
def _gemv_step(w0, w1, x_row, k0, K, BITS: tl.constexpr, WIDTH: tl.constexpr):
    """One K step's products w * x, [BLOCK_N, WIDTH] fp32 (summed over K once, after the loop)."""
    if BITS == 4:
        offs_x = k0 + 2 * tl.arange(0, WIDTH)  # x is tiny and L1-resident: strided loads are fine
        xe = tl.load(x_row + offs_x, mask=offs_x < K, other=0.0).to(tl.float32)
        xo = tl.load(x_row + offs_x + 1, mask=offs_x < K, other=0.0).to(tl.float32)
        return w0 * xe[None, :] + w1 * xo[None, :]
    else:
        offs_x = k0 + tl.arange(0, WIDTH)
        return w0 * tl.load(x_row + offs_x, mask=offs_x < K, other=0.0).to(tl.float32)[None, :]


@triton.jit
def _wq_gemv_kernel(x_ptr, q_ptr, s_ptr, o_ptr, y_ptr, M, N, K, G, stride_xm, stride_qn, stride_sn, stride_ym,
                    GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, MAGIC: tl.constexpr, PREFETCH: tl.constexpr):
    row = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    WIDTH: tl.constexpr = BLOCK_K // 2 if BITS == 4 else BLOCK_K
    acc = tl.zeros((BLOCK_N, WIDTH), dtype=tl.float32)
    first, last = _k_range(K, BLOCK_K, SPLIT_K)
    x_row = x_ptr + row * stride_xm
    if PREFETCH:  # the next step's bytes are requested before this step's math: 2 steps in flight
        b, s, o = _raw_tile(q_ptr, s_ptr, o_ptr, offs_n, mask_n & (first < last), first * BLOCK_K, K, G, stride_qn,
                            stride_sn, GROUP, BITS, BLOCK_K, EVEN_K)
    for i in range(first, last):
        k0 = i * BLOCK_K
        if PREFETCH:
            b_next, s_next, o_next = _raw_tile(q_ptr, s_ptr, o_ptr, offs_n, mask_n & (i + 1 < last), k0 + BLOCK_K,
                                               K, G, stride_qn, stride_sn, GROUP, BITS, BLOCK_K, EVEN_K)
            w0, w1 = _dequant(b, s, o, GROUP, BITS, BLOCK_N, BLOCK_K, MAGIC)
            b, s, o = b_next, s_next, o_next
        else:
            w0, w1 = _weight_tile(q_ptr, s_ptr, o_ptr, offs_n, mask_n, k0, K, G, stride_qn, stride_sn, GROUP, BITS,
                                  BLOCK_N, BLOCK_K, EVEN_K, MAGIC)
        acc += _gemv_step(w0, w1, x_row, k0, K, BITS, WIDTH)
    y = tl.sum(acc, axis=1)
    offs_m = row + tl.arange(0, 1)
    _store(y_ptr, y[None, :], offs_m, offs_n, offs_m < M, mask_n, stride_ym, SPLIT_K)


@triton.jit
def _wq_dot_kernel(x_ptr, q_ptr, s_ptr, o_ptr, y_ptr, M, N, K, G, stride_xm, stride_qn, stride_sn, stride_ym,
                   GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr, JOIN: tl.constexpr,
                   IEEE: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    PREC: tl.constexpr = "ieee" if IEEE else "tf32"
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first, last = _k_range(K, BLOCK_K, SPLIT_K)
    x_rows = x_ptr + offs_m[:, None] * stride_xm
    for i in range(first, last):
        k0 = i * BLOCK_K
        w0, w1 = _weight_tile(q_ptr, s_ptr, o_ptr, offs_n, mask_n, k0, K, G, stride_qn, stride_sn, GROUP, BITS,
                              BLOCK_N, BLOCK_K, EVEN_K, True)
        dt = x_ptr.dtype.element_ty
        if BITS == 4 and not JOIN:
            offs_x = k0 + 2 * tl.arange(0, BLOCK_K // 2)
            xmask = _x_mask(mask_m, offs_x, K, EVEN_K)
            xe = tl.load(x_rows + offs_x[None, :], mask=xmask, other=0.0)
            xo = tl.load(x_rows + offs_x[None, :] + 1, mask=xmask, other=0.0)
            acc = tl.dot(xe, tl.trans(w0.to(dt)), acc, input_precision=PREC)
            acc = tl.dot(xo, tl.trans(w1.to(dt)), acc, input_precision=PREC)
        else:
            if BITS == 4:  # back to the layout's order: column 2j from the low nibble, 2j + 1 from the high
                w = tl.reshape(tl.join(w0, w1), (BLOCK_N, BLOCK_K))
            else:
                w = w0
            offs_x = k0 + tl.arange(0, BLOCK_K)
            xmask = _x_mask(mask_m, offs_x, K, EVEN_K)
            xv = tl.load(x_rows + offs_x[None, :], mask=xmask, other=0.0)
            acc = tl.dot(xv, tl.trans(w.to(dt)), acc, input_precision=PREC)
    _store(y_ptr, acc, offs_m, offs_n, mask_m, mask_n, stride_ym, SPLIT_K)


KERNELS = ("gemv", "gemv_pf", "gemv_cvt", "dot", "dot_join")


@dataclass(frozen=True)
class WqConfig:
    kernel: str  # one of KERNELS ("gemv_pf": gemv with a register prefetch; "gemv_cvt": the plain convert)
    block_m: int  # rows of x per program (gemv: always 1)
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def fit_block_k(block_k: int, group: int, k: int, minimum: int) -> int:
    """The largest power of two <= block_k (and >= minimum) that tiles the groups: a K step must lie in
    one group or cover whole groups. 0 when none does (a group that is not a multiple of `minimum`)."""
    bk = block_k
    while bk >= minimum:
        if group % bk == 0 or (bk % group == 0 and (group & (group - 1)) == 0):
            return bk
        bk //= 2
    return 0


def heuristic_config(m: int, n: int, k: int, group: int, sms: int, bits: int = 4) -> WqConfig:
    """Decode (M <= 4): gemv with the widest row tile that still gives >= 3 programs per SM, and K steps of
    ~4 KB of weight bytes per program (8 KB at 32 rows). Why: the gemv's loads are not pipelined (sm_90 SASS:
    plain LDG.E.128, no cp.async), so the bytes in flight per SM are programs x step bytes; ~18 KB per SM
    are needed to cover ~0.7 us of latency at 3.5 TB/s (16 rows x 512 k on a 4096-row matmul is only 256
    programs: ~8 KB). 8 rows x 1024 k: 96 registers, 5 programs per SM fit. Split-K only where even 8-row
    tiles leave SMs idle. M <= 16: one 16-row dot tile. Prefill: 128 x 128 tiles. Both dots use dot_join:
    its x tile streams through cp.async in 16-byte vectors, "dot"'s even/odd x loads are scalar."""
    if m <= 4:
        block_n = next((bn for bn in (32, 16) if triton.cdiv(n, bn) >= 3 * sms), 8)
        step_bytes = 8192 if block_n == 32 else 4096
        block_k = min(step_bytes // block_n * (8 // bits), max(16, triton.next_power_of_2(k)))
        tiles = triton.cdiv(n, block_n)
        split = max(1, min(triton.cdiv(2 * sms, tiles), 8, triton.cdiv(k, block_k))) if tiles < sms else 1
        # The register prefetch doubles the bytes in flight (8 x 1024: 128 registers, 4 programs per SM, 32
        # KB); at 32 rows it would take 255 registers, so the 32-row tile goes without.
        return WqConfig("gemv_pf" if block_n <= 16 else "gemv", 1, block_n, block_k, split, num_warps=4,
                        num_stages=1)
    if m <= 16:
        # 256-wide K steps in 3 stages, split-K only where the tiles leave half the SMs idle: what the tuner
        # picked for qkv, o, gate_up and down of Qwen3-8B at M = 2..16 (H100, 2026-12-07, wqkn): g128 M = 8,
        # 36 layers 3,607 against 3,810 us with 128-wide steps in 4 stages and a split wherever tiles < SMs.
        tiles = triton.cdiv(n, 32)
        split = 1 if 2 * tiles >= sms else max(1, min(triton.cdiv(sms, tiles), 8))
        return WqConfig("dot_join", 16, 32, min(256, max(16, triton.next_power_of_2(k))), split, num_warps=4,
                        num_stages=3)
    block_m = 64 if m <= 64 else 128
    return WqConfig("dot_join", block_m, 128, 64, 1, num_warps=8 if block_m == 128 else 4, num_stages=3)


def wq_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor, bits: int,
              config: WqConfig | None = None) -> torch.Tensor:
    """x [M, K] (fp16 / bf16 / fp32) -> [M, N] in x's dtype."""
    m, k = x.shape
    n = qweight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    groups = scales.shape[1]
    group = k // groups if groups else 0
    if bits not in (4, 8) or group * groups != k or qweight.shape[1] * (8 // bits) != k or group % 2:
        raise ValueError(f"bad quantized weight: bits={bits}, K={k}, qweight {tuple(qweight.shape)}, "
                         f"scales {tuple(scales.shape)}")
    sms = _num_sms(x.device.index or 0) if x.is_cuda else 8
    cfg = config or heuristic_config(m, n, k, group, sms, bits)
    gemv = cfg.kernel.startswith("gemv")
    # tl.dot needs K >= 16 per operand (the 4-bit half-tile is BLOCK_K / 2 wide); the 4-bit gemv needs a
    # half-group of >= 1 column pair in the reshape, i.e. an even group.
    block_k = fit_block_k(cfg.block_k, group, k, 16 if gemv else (32 if bits == 4 else 16))
    if block_k == 0:  # an exotic group size no tile fits: the reference path
        from lamina.kernels.wq_matmul import dequantize

        return x @ dequantize(qweight, scales, offsets, bits, x.dtype).t()
    out = torch.zeros((m, n), device=x.device, dtype=torch.float32) if cfg.split_k > 1 else \
        torch.empty((m, n), device=x.device, dtype=x.dtype)
    common = dict(GROUP=group, BITS=bits, BLOCK_N=cfg.block_n, BLOCK_K=block_k, SPLIT_K=cfg.split_k,
                  EVEN_K=k % block_k == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    args = (x, qweight, scales, offsets, out, m, n, k, groups, x.stride(0), qweight.stride(0), scales.stride(0),
            out.stride(0))
    if gemv:
        _wq_gemv_kernel[(m, triton.cdiv(n, cfg.block_n), cfg.split_k)](*args, MAGIC=cfg.kernel != "gemv_cvt",
                                                                        PREFETCH=cfg.kernel == "gemv_pf",
                                                                        **common)
    else:
        grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), cfg.split_k)
        _wq_dot_kernel[grid](*args, BLOCK_M=cfg.block_m, JOIN=cfg.kernel == "dot_join",
                             IEEE=x.dtype == torch.float32, **common)
    return out.to(x.dtype) if cfg.split_k > 1 else out
