"""Batch-1 decode GEMV for 4-bit weights in a layout repacked at load ("kn"): y = x W^T, M = 1..16.

Why a second layout (the [N, K/2] GEMV of triton_wq_matmul.py streams only ~1.1 TB/s on the H200):
- Weights: int32 [K/8, N]; word (kw, n) holds the 8 nibbles of row n at k = 8 kw .. 8 kw + 7, nibble i in
  bits 4i..4i+3, so the repack is the old layout's bytes viewed as int32 and transposed. A [BLOCK_KW,
  BLOCK_N] tile is contiguous along N: every thread loads 16 B (4 rows at one kw), a warp 512 contiguous
  bytes, and all threads of a warp need the same 8 activations (one broadcast load each, where the [N, K/2]
  tile had 32 threads reading 32 different stretches of x: 16 L1 wavefronts per x load).
- Scales and offsets: fp16 [K/group, N], coalesced the same way.
- Nibble -> fp32 with one shift per two nibbles and one LOP3 per nibble: the word is shifted so nibble 2t
  sits at bits 15..18 and nibble 2t + 1 at bits 19..22, and OR-ing exponents in gives the floats 256 + q
  and 16 + q exactly. The biases are not subtracted per nibble: sum_j (B_j + q_j) x_j - (256 sum_even x +
  16 sum_odd x) is computed per word, the correction from the activations alone (per kw, shared by every
  row a thread holds). Small biases keep the fp32 cancellation harmless (~2^-20 relative per product).
  Per nibble that is ~0.5 SHF + 1 LOP3 + 1 FFMA, against ~5 ops plus a private x load in the old GEMV.
- Scale and offset apply once per word: acc += s * (dot8 - c) + o * sum(x).
- Split-K without a memset or a cast launch: each split writes an fp32 partial to a workspace, counts
  itself in a per-(row, tile) semaphore, and the last one sums the partials, writes y in x's dtype and
  resets the semaphore (the semaphores live with the weight, `KnWeight.locks`, zeroed once at repack).
  An 8B model's o projection is only 32 tiles of 128 columns: without splitting K, 1/4 of the SMs stream.
Grids depend on host shapes only (CUDA-graph safe).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

MAX_ROWS = 16  # rows of x the semaphores are sized for (decode batches above this take the GEMM path)


@dataclass
class KnWeight:
    """A 4-bit weight repacked for the decode GEMV (see the module docstring)."""

    q: torch.Tensor  # int32 [K/8, N]
    scales: torch.Tensor  # fp16 [K/group, N]
    offsets: torch.Tensor  # fp16 [K/group, N]
    locks: torch.Tensor  # int32 [MAX_ROWS * cdiv(N, 16)], zero between calls
    group: int

    @classmethod
    def build(cls, qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor) -> KnWeight:
        """From the [N, K/2] uint8 layout of wq_matmul.py (little-endian bytes: byte 4 kw + b of a row
        holds k = 8 kw + 2b in its low nibble, so the int32 view puts k = 8 kw + i at bits 4i)."""
        n, half_k = qweight.shape
        group = 2 * half_k // max(1, scales.shape[1])
        if half_k % 4 or group % 8 or group * scales.shape[1] != 2 * half_k:
            raise ValueError(f"the kn layout needs K % 8 == 0 and groups of 8k columns (K = {2 * half_k}, "
                             f"{scales.shape[1]} groups)")
        q = qweight.contiguous().view(torch.int32).t().contiguous()
        locks = torch.zeros(MAX_ROWS * triton.cdiv(n, 16), dtype=torch.int32, device=qweight.device)
        return cls(q, scales.t().contiguous(), offsets.t().contiguous(), locks, group)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.q, self.scales, self.offsets, self.locks))


def kn_dequantize(w: KnWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The [N, K] weight (the reference: it reads only the kn tensors)."""
    kw, n = w.q.shape
    shifts = torch.arange(0, 32, 4, device=w.q.device, dtype=torch.int32)
    q = ((w.q[:, :, None] >> shifts) & 0xF).permute(1, 0, 2).reshape(n, 8 * kw).float()
    s = w.scales.t().float().repeat_interleave(w.group, dim=1)
    o = w.offsets.t().float().repeat_interleave(w.group, dim=1)
    return (q * s + o).to(dtype)


@triton.jit
def _pair(words, SHIFT: tl.constexpr, ASM: tl.constexpr):
    """Nibbles 2t, 2t + 1 of every word as fp32 256 + q and 16 + q (SHIFT = 15 - 8t; the words are uint32,
    so a right shift brings in zeros). ASM: one LOP3 per nibble ((c & mask) | exponent); written as & then
    |, LLVM and ptxas keep two LOP3s (two immediates). The interpreter runs ASM=False."""
    if SHIFT >= 0:
        c = words << SHIFT
    else:
        c = words >> (-SHIFT)
    if ASM:
        lo, hi = tl.inline_asm_elementwise(
            "lop3.b32 $0, $2, 0x78000, 0x43800000, 0xea;\n\tlop3.b32 $1, $2, 0x780000, 0x41800000, 0xea;",
            "=r,=r,r", [c], dtype=(tl.uint32, tl.uint32), is_pure=True, pack=1)
    else:
        lo = (c & 0x78000) | 0x43800000  # exponent 135: 2^8 (1 + q 2^15 / 2^23) = 256 + q
        hi = (c & 0x780000) | 0x41800000  # exponent 131: 2^4 (1 + q 2^19 / 2^23) = 16 + q
    return lo.to(tl.float32, bitcast=True), hi.to(tl.float32, bitcast=True)


@triton.jit
def _x8(x_row, kw, mask_k):
    """The 8 activations of each word position (fp32 [BLOCK_KW] each; broadcast loads within a warp)."""
    base = x_row + kw * 8
    x0 = tl.load(base + 0, mask=mask_k, other=0.0).to(tl.float32)
    x1 = tl.load(base + 1, mask=mask_k, other=0.0).to(tl.float32)
    x2 = tl.load(base + 2, mask=mask_k, other=0.0).to(tl.float32)
    x3 = tl.load(base + 3, mask=mask_k, other=0.0).to(tl.float32)
    x4 = tl.load(base + 4, mask=mask_k, other=0.0).to(tl.float32)
    x5 = tl.load(base + 5, mask=mask_k, other=0.0).to(tl.float32)
    x6 = tl.load(base + 6, mask=mask_k, other=0.0).to(tl.float32)
    x7 = tl.load(base + 7, mask=mask_k, other=0.0).to(tl.float32)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _step(q_ptr, s_ptr, o_ptr, x_row, kw0, offs_n, mask_n, KW, stride_qk, stride_sg, GROUP: tl.constexpr,
          BLOCK_KW: tl.constexpr, ASM: tl.constexpr):
    """One K step: per word the bias-corrected sum_j q_j x_j [BLOCK_KW, BLOCK_N], the scales and offsets
    (fp32, broadcastable) and sum_j x_j [BLOCK_KW]."""
    kw = kw0 + tl.arange(0, BLOCK_KW)
    mask_k = kw < KW  # along kw only: the 16-byte loads along N stay vectorized
    m2 = mask_k[:, None] & mask_n[None, :]
    words = tl.load(q_ptr + kw[:, None] * stride_qk + offs_n[None, :], mask=m2, other=0).to(tl.uint32,
                                                                                              bitcast=True)
    # [BLOCK_KW, BLOCK_N] scales even where a step lies in one group: a [BLOCK_N] load broadcast over kw led
    # the layout pass to 4 columns x 8 kw per thread (twice the x loads, 255 registers: sm_90 SASS)
    sp = ((kw * 8) // GROUP)[:, None] * stride_sg + offs_n[None, :]
    s = tl.load(s_ptr + sp, mask=m2, other=0.0).to(tl.float32)
    o = tl.load(o_ptr + sp, mask=m2, other=0.0).to(tl.float32)
    x0, x1, x2, x3, x4, x5, x6, x7 = _x8(x_row, kw, mask_k)
    even = x0 + x2 + x4 + x6
    odd = x1 + x3 + x5 + x7
    # one FFMA per nibble: the chain starts from -bias (written as a sum of pairs it took 11 ops per word)
    d = -(256.0 * even + 16.0 * odd)[:, None]
    a0, a1 = _pair(words, 15, ASM)
    d = d + a0 * x0[:, None]
    d = d + a1 * x1[:, None]
    a2, a3 = _pair(words, 7, ASM)
    d = d + a2 * x2[:, None]
    d = d + a3 * x3[:, None]
    a4, a5 = _pair(words, -1, ASM)
    d = d + a4 * x4[:, None]
    d = d + a5 * x5[:, None]
    a6, a7 = _pair(words, -9, ASM)
    d = d + a6 * x6[:, None]
    d = d + a7 * x7[:, None]
    return d, s, o, even + odd


@triton.jit
def _kn_gemv_kernel(x_ptr, q_ptr, s_ptr, o_ptr, y_ptr, ws_ptr, lock_ptr, M, N, KW, stride_xm, stride_qk,
                    stride_sg, stride_ym, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
                    STEPS: tl.constexpr, SPLIT_K, SPLIT_P2: tl.constexpr, ASM: tl.constexpr):
    row = tl.program_id(0)
    tile = tl.program_id(1)
    split = tl.program_id(2)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    x_row = x_ptr + row * stride_xm
    acc = tl.zeros((BLOCK_KW, BLOCK_N), dtype=tl.float32)
    # STEPS is a constexpr: at 1 step (the o projection's 32 splits) the loop goes and so do ~80 registers
    for i in range(split * STEPS, split * STEPS + STEPS):  # the host sized SPLIT_K x STEPS to cover K
        d, s, o, xs = _step(q_ptr, s_ptr, o_ptr, x_row, i * BLOCK_KW, offs_n, mask_n, KW, stride_qk, stride_sg,
                            GROUP, BLOCK_KW, ASM)
        acc = acc + s * d  # two FFMAs per word
        acc = acc + o * xs[:, None]
    y = tl.sum(acc, axis=0)
    if SPLIT_P2 == 1:  # one split
        tl.store(y_ptr + row * stride_ym + offs_n, y.to(y_ptr.dtype.element_ty), mask=mask_n)
    else:
        slot = (row * tl.num_programs(1) + tile) * SPLIT_K
        tl.store(ws_ptr + (slot + split) * BLOCK_N + tl.arange(0, BLOCK_N), y, cache_modifier=".cg")
        tl.debug_barrier()  # every thread's partial is written before the count is released
        done = tl.atomic_add(lock_ptr + row * tl.num_programs(1) + tile, 1, sem="acq_rel")
        if done == SPLIT_K - 1:  # the last split of this tile: sum the partials in split order
            # one [SPLIT_P2, BLOCK_N] load (all partials in flight at once, not a loop of dependent waits)
            offs_j = tl.arange(0, SPLIT_P2)
            parts = tl.load(ws_ptr + (slot + offs_j)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :],
                            mask=(offs_j < SPLIT_K)[:, None], other=0.0, cache_modifier=".cg")
            total = tl.sum(parts, axis=0)
            tl.store(y_ptr + row * stride_ym + offs_n, total.to(y_ptr.dtype.element_ty), mask=mask_n)
            tl.atomic_xchg(lock_ptr + row * tl.num_programs(1) + tile, 0)


@triton.jit
def _kn_rows_kernel(x_ptr, q_ptr, s_ptr, o_ptr, y_ptr, ws_ptr, lock_ptr, M, N, KW, stride_xm, stride_qk,
                    stride_sg, stride_ym, GROUP: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_KW: tl.constexpr, STEPS: tl.constexpr, SPLIT_K, SPLIT_P2: tl.constexpr,
                    ASM: tl.constexpr):
    """ROWS rows of x per program (M = 2..16): each word is loaded and turned into floats once and used by
    every row (the one-row kernel launches a program per row, each re-reading the tile from L2 and redoing
    the nibble math: at M = 4 it ran at 0.36 TB/s on the qkv shape). Per nibble: ~1.5 ops shared + ROWS
    FFMAs. The accumulators are [ROWS, BLOCK_KW, BLOCK_N]: the config keeps ROWS x BLOCK_KW x BLOCK_N small."""
    group = tl.program_id(0)
    tile = tl.program_id(1)
    split = tl.program_id(2)
    offs_r = group * ROWS + tl.arange(0, ROWS)
    mask_r = offs_r < M
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    # Every tensor is 3-D [ROWS, BLOCK_KW, BLOCK_N] (size 1 where broadcast), loads included: with 2-D word
    # loads broadcast into 3-D, the layout pass gave the loads and the products different layouts and moved
    # every plane through shared memory (8 convert_layouts per step, spills: sm_90 TTGIR / ptxas).
    n3 = offs_n[None, None, :]
    x_rows = x_ptr + offs_r[:, None, None] * stride_xm  # [ROWS, 1, 1]
    acc = tl.zeros((ROWS, BLOCK_KW, BLOCK_N), dtype=tl.float32)
    for i in range(split * STEPS, split * STEPS + STEPS):
        kw = (i * BLOCK_KW + tl.arange(0, BLOCK_KW))[None, :, None]  # [1, BLOCK_KW, 1]
        mask_k = kw < KW
        m3 = mask_k & mask_n[None, None, :]
        words = tl.load(q_ptr + kw * stride_qk + n3, mask=m3, other=0).to(tl.uint32, bitcast=True)
        sp = ((kw * 8) // GROUP) * stride_sg + n3
        s = tl.load(s_ptr + sp, mask=m3, other=0.0).to(tl.float32)
        o = tl.load(o_ptr + sp, mask=m3, other=0.0).to(tl.float32)
        xb = x_rows + kw * 8  # [ROWS, BLOCK_KW, 1]
        xm = mask_r[:, None, None] & mask_k
        x0 = tl.load(xb + 0, mask=xm, other=0.0).to(tl.float32)
        x1 = tl.load(xb + 1, mask=xm, other=0.0).to(tl.float32)
        x2 = tl.load(xb + 2, mask=xm, other=0.0).to(tl.float32)
        x3 = tl.load(xb + 3, mask=xm, other=0.0).to(tl.float32)
        x4 = tl.load(xb + 4, mask=xm, other=0.0).to(tl.float32)
        x5 = tl.load(xb + 5, mask=xm, other=0.0).to(tl.float32)
        x6 = tl.load(xb + 6, mask=xm, other=0.0).to(tl.float32)
        x7 = tl.load(xb + 7, mask=xm, other=0.0).to(tl.float32)
        even = x0 + x2 + x4 + x6
        odd = x1 + x3 + x5 + x7
        d = -(256.0 * even + 16.0 * odd)  # the biases of _pair, per row (see _step)
        a0, a1 = _pair(words, 15, ASM)
        d = d + a0 * x0
        d = d + a1 * x1
        a2, a3 = _pair(words, 7, ASM)
        d = d + a2 * x2
        d = d + a3 * x3
        a4, a5 = _pair(words, -1, ASM)
        d = d + a4 * x4
        d = d + a5 * x5
        a6, a7 = _pair(words, -9, ASM)
        d = d + a6 * x6
        d = d + a7 * x7
        acc = acc + s * d
        acc = acc + o * (even + odd)
    y = tl.sum(acc, axis=1)  # [ROWS, BLOCK_N]
    y_ptrs = y_ptr + offs_r[:, None] * stride_ym + offs_n[None, :]
    ymask = mask_r[:, None] & mask_n[None, :]
    if SPLIT_P2 == 1:
        tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=ymask)
    else:  # the one-row kernel's semaphore reduction, a [ROWS, BLOCK_N] partial per split
        lock = lock_ptr + group * tl.num_programs(1) + tile
        slot = (group * tl.num_programs(1) + tile) * SPLIT_K
        part = tl.arange(0, ROWS)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(ws_ptr + (slot + split) * (ROWS * BLOCK_N) + part, y, cache_modifier=".cg")
        tl.debug_barrier()
        done = tl.atomic_add(lock, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            offs_j = tl.arange(0, SPLIT_P2)
            parts = tl.load(ws_ptr + (slot + offs_j)[:, None, None] * (ROWS * BLOCK_N) + part[None, :, :],
                            mask=(offs_j < SPLIT_K)[:, None, None], other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, tl.sum(parts, axis=0).to(y_ptr.dtype.element_ty), mask=ymask)
            tl.atomic_xchg(lock, 0)


@dataclass(frozen=True)
class KnConfig:
    block_n: int = 256
    block_kw: int = 16
    split_k: int = 0  # 0: sized by the heuristic (about `waves` programs per SM)
    num_warps: int = 4
    waves: int = 4
    asm: bool = True  # the one-LOP3 nibble (CUDA only; False: the & | pair, for A/B)
    rows: int = 1  # rows of x per program (power of two): 1 the one-row kernel, > 1 _kn_rows_kernel


def plan(n: int, kw: int, sms: int, cfg: KnConfig, row_groups: int = 1) -> tuple[int, int, int]:
    """(block_kw, steps per split, splits): splits chosen for ~cfg.waves programs per SM, then trimmed so
    that every split has work (each must count itself in the semaphore). row_groups: programs along M (the
    multi-row kernel's; the one-row kernel's plan ignores M, as it was measured)."""
    block_kw = min(cfg.block_kw, triton.next_power_of_2(kw))
    steps = triton.cdiv(kw, block_kw)
    tiles = triton.cdiv(n, cfg.block_n) * row_groups
    # floor: a multi-step program holds ~165 registers (3 per SM), so rounding up can spill into a tail wave
    want = cfg.split_k or max(1, min(steps, cfg.waves * sms // tiles))
    per = triton.cdiv(steps, want)
    return block_kw, per, triton.cdiv(steps, per)


def kn_gemv(x: torch.Tensor, w: KnWeight, cfg: KnConfig | None = None, sms: int | None = None) -> torch.Tensor:
    """x [M, K] (fp16 / bf16 / fp32, M <= MAX_ROWS) -> [M, N] in x's dtype."""
    cfg = cfg or KnConfig()
    m, k = x.shape
    kw, n = w.q.shape
    if k != 8 * kw or m > MAX_ROWS or cfg.block_n < 16 or cfg.rows & (cfg.rows - 1):
        raise ValueError(f"kn_gemv: x {tuple(x.shape)} against a [{8 * kw}, {n}] weight (M <= {MAX_ROWS})")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if sms is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 8
    rows = max(1, cfg.rows)
    groups = triton.cdiv(m, rows)
    block_kw, steps, splits = plan(n, kw, sms, cfg, groups if rows > 1 else 1)
    tiles = triton.cdiv(n, cfg.block_n)
    y = torch.empty((m, n), device=x.device, dtype=x.dtype)
    ws = torch.empty((groups * rows * tiles * splits * cfg.block_n,) if splits > 1 else (1,), device=x.device,
                     dtype=torch.float32)
    args = (x, w.q, w.scales, w.offsets, y, ws, w.locks, m, n, kw, x.stride(0), w.q.stride(0), w.scales.stride(0),
            y.stride(0))
    meta = dict(GROUP=w.group, BLOCK_N=cfg.block_n, BLOCK_KW=block_kw, STEPS=steps, SPLIT_K=splits,
                SPLIT_P2=triton.next_power_of_2(splits), ASM=cfg.asm and x.is_cuda, num_warps=cfg.num_warps,
                num_stages=1)
    if rows > 1:
        _kn_rows_kernel[(groups, tiles, splits)](*args, ROWS=rows, **meta)
    else:
        _kn_gemv_kernel[(m, tiles, splits)](*args, **meta)
    return y
