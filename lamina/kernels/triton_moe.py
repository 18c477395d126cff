"""Triton fused MoE: the experts' SwiGLU as two grouped GEMMs (the reference is fused_moe_ref; the top-k routing
kernel is in triton_router.py, re-exported here).

Layout. The P = T*k (token, slot) pairs, pair p = token*k + slot, are grouped by expert in pair order and each
expert's group is padded to a multiple of BLOCK_M: `sorted_ids[num_blocks_max * BLOCK_M]` holds pair indices
(sentinel P in padding rows) and `block_expert[num_blocks_max]` the expert of each M-block (E for unused
blocks). num_blocks_max = min(P, E) + ceil(P / BLOCK_M) bounds the blocks any routing can need, so every grid
comes from host shapes; programs of unused blocks read E and exit. The layout is built on the device: for
P <= SMALL_PAIRS by one kernel (`_align_kernel`: tl.histogram, cumsums, a stable tl.sort of
expert*BLOCK_P + pair, then each block's rows gathered from the sorted pairs; up to ALIGN_PROGRAMS programs
share the blocks), above that by a few torch ops (stable argsort, scatter_add histogram, cumsum, searchsorted;
no bincount, which syncs). No host syncs anywhere, so decode can be captured in a CUDA graph and replayed with
other routings.

GEMM 1 (`_gemm1_kernel`, program = M-block x BLOCK_N columns of I): gathers the block's token rows of x and
accumulates the gate and up tiles (two fp32 accumulators over K = H), writes silu(gate) * up rounded to x's
dtype into inter[P, I] at the pairs' rows. GEMM 2 (`_gemm2_kernel`, M-block x BLOCK_N columns of H, K = I):
gathers inter rows, scales by the pair's routing weight in fp32, writes out_pairs[P, H] in x's dtype; a torch
`.view(T, k, H).sum(1)` (fp32 accumulation) adds a token's k slots. Padding rows are masked on every load and
store. Decode is weight-bandwidth bound: BLOCK_M = 16 (mma.sync), each expert's weights are read once per
M-block, and BLOCK_N is small enough for a few hundred programs; prefill uses 64-row tiles (wgmma).
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from lamina.kernels.triton_router import select_experts_triton as select_experts_triton  # re-export: moe.py, tests

SMALL_PAIRS = 4096  # at most this many (token, slot) pairs: the align kernel builds the layout
# The align kernel's loop over M-blocks is shared by up to this many programs, each repeating the histogram
# and sort (cheap next to the loop): one program took ~60 us per layer for a 64-token decode step of the
# Qwen3-Next shape (704 pairs, 557 blocks; H200 profile), 1.4 ms of an 18 ms step over 24 layers.
ALIGN_PROGRAMS = 16


@triton.jit(do_not_specialize=["num_pairs", "num_blocks"])
def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, num_pairs, num_experts, num_blocks,
                  BLOCK_P: tl.constexpr, NUM_BINS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_B: tl.constexpr):
    p = tl.arange(0, BLOCK_P)
    ids = tl.load(ids_ptr + p, mask=p < num_pairs, other=num_experts).to(tl.int32)  # padding -> bin E
    e = tl.arange(0, NUM_BINS)
    counts = tl.where(e < num_experts, tl.histogram(ids, NUM_BINS), 0)
    nblk = (counts + BLOCK_M - 1) // BLOCK_M
    blk_end = tl.cumsum(nblk, 0)
    blk_start = blk_end - nblk
    total = tl.sum(nblk, 0)
    c_start = tl.cumsum(counts, 0) - counts
    # Pairs grouped by expert, in pair order within an expert (keys are distinct, so the order is stable).
    sorted_pair = tl.sort(ids * BLOCK_P + p) % BLOCK_P
    b_loc = tl.arange(0, BLOCK_B)
    r_loc = tl.arange(0, BLOCK_M)
    for b0 in range(tl.program_id(0) * BLOCK_B, num_blocks, tl.num_programs(0) * BLOCK_B):
        b = b0 + b_loc
        used = b < total
        # expert of block b = number of experts whose blocks all end at or before b (blk_end is nondecreasing)
        ex = tl.sum((blk_end[None, :] <= b[:, None]).to(tl.int32), axis=1)
        tl.store(block_expert_ptr + b, tl.where(used, ex, num_experts), mask=b < num_blocks)
        exc = tl.where(used, ex, 0)
        rank = (b - tl.gather(blk_start, exc, 0))[:, None] * BLOCK_M + r_loc[None, :]  # [BLOCK_B, BLOCK_M]
        ok = used[:, None] & (rank < tl.gather(counts, exc, 0)[:, None])
        src = tl.where(ok, tl.gather(c_start, exc, 0)[:, None] + rank, 0)
        pair = tl.reshape(tl.gather(sorted_pair, tl.reshape(src, [BLOCK_B * BLOCK_M]), 0), [BLOCK_B, BLOCK_M])
        tl.store(sorted_ptr + b[:, None] * BLOCK_M + r_loc[None, :], tl.where(ok, pair, num_pairs),
                 mask=(b < num_blocks)[:, None])


@triton.jit(do_not_specialize=["num_pairs"])
def _gemm1_kernel(x_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_pairs, top_k, num_experts, N, K,
                  stride_xm, stride_we, stride_wn, stride_om,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                  DOT_PREC: tl.constexpr):
    """inter[pair, n] = silu(x[tok] . w[e, n]) * (x[tok] . w[e, N + n]) for the block's pairs (N = I, K = H)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    e = tl.load(block_expert_ptr + pid_m)
    if e >= num_experts:  # a block no routing of this shape fills
        return
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < num_pairs
    tok = (pair // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = x_ptr + tok[:, None] * stride_xm + offs_k[None, :]
    g_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    u_ptrs = g_ptrs + N * stride_wn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            bg = tl.load(g_ptrs, mask=n_ok[None, :], other=0.0)
            bu = tl.load(u_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            bg = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            bu = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc_g = tl.dot(a, bg, acc_g, input_precision=DOT_PREC)
        acc_u = tl.dot(a, bu, acc_u, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    y = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    o_ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _gemm2_kernel(a_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, topk_w_ptr, num_pairs, num_experts, N, K,
                  stride_am, stride_we, stride_wn, stride_om,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                  DOT_PREC: tl.constexpr):
    """out_pairs[pair, n] = weight[pair] * (inter[pair] . w2[e, n]) for the block's pairs (N = H, K = I)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    e = tl.load(block_expert_ptr + pid_m)
    if e >= num_experts:
        return
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < num_pairs
    rows = pair.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=n_ok[None, :], other=0.0)
        else:
            k_ok = offs_k < K - k0
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    wt = tl.load(topk_w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * wt[:, None]
    o_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _gemv1_kernel(x_ptr, w_ptr, out_ptr, ids_ptr, top_k, num_experts, N, K, stride_xm, stride_we, stride_wn,
                  stride_om, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Few pairs (decode of a handful of tokens): one program per (pair, BLOCK_N columns of I), no grouping.
    inter[pair, n] = silu(x[tok] . w[e, n]) * (x[tok] . w[e, N + n]), as a GEMV on the CUDA cores."""
    pair = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    e = tl.load(ids_ptr + pair).to(tl.int64)
    if e >= num_experts:  # an expert on another rank: _gemv2_kernel writes the pair's zeros
        return
    tok = (pair // top_k).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    g_ptrs = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    u_ptrs = g_ptrs + N * stride_wn
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        xv = tl.load(x_ptr + tok * stride_xm + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        wg = tl.load(g_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        wu = tl.load(u_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc_g += tl.sum(wg.to(tl.float32) * xv[None, :], 1)
        acc_u += tl.sum(wu.to(tl.float32) * xv[None, :], 1)
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    y = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_ok)


@triton.jit
def _gemv2_kernel(a_ptr, w_ptr, out_ptr, ids_ptr, topk_w_ptr, num_experts, N, K, stride_am, stride_we, stride_wn,
                  stride_om, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out_pairs[pair, n] = weight[pair] * (inter[pair] . w2[e, n]), one program per (pair, BLOCK_N of H);
    zeros for a pair whose expert is on another rank (id >= num_experts)."""
    pair = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    e = tl.load(ids_ptr + pair).to(tl.int64)
    if e >= num_experts:
        tl.store(out_ptr + pair.to(tl.int64) * stride_om + offs_n, tl.zeros([BLOCK_N], dtype=tl.float32).to(
            out_ptr.dtype.element_ty), mask=n_ok)
        return
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + e * stride_we + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        av = tl.load(a_ptr + pair.to(tl.int64) * stride_am + k0 + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        wv = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.sum(wv.to(tl.float32) * av[None, :], 1)
        w_ptrs += BLOCK_K
    acc = acc * tl.load(topk_w_ptr + pair).to(tl.float32)
    tl.store(out_ptr + pair.to(tl.int64) * stride_om + offs_n, acc.to(out_ptr.dtype.element_ty), mask=n_ok)


GEMV_PAIRS = 64  # at most this many (token, slot) pairs: per-pair GEMVs, no grouping by expert


def _fused_moe_gemv(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor) -> torch.Tensor:
    """Decode of a handful of tokens: a token's k experts are distinct, so grouping saves no weight bytes and
    costs a layout kernel; each pair streams its expert's rows directly (weight-bandwidth bound)."""
    t, h = x.shape
    inter_size = w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    p = t * top_k
    ids = topk_ids.reshape(-1)
    weights = topk_weights.reshape(-1)
    ids, weights = (a if a.is_contiguous() else a.contiguous() for a in (ids, weights))
    inter = torch.empty(p, inter_size, dtype=x.dtype, device=x.device)
    # Whole rows in one load per program (no K loop): every program has all its bytes in flight at once,
    # which a looped GEMV did not (H200, Qwen3-Next shape: 16x256 tiles in a loop reached 1.8 TB/s).
    bk1 = triton.next_power_of_2(h)
    bn1 = max(1, min(16, 16384 // bk1))
    _gemv1_kernel[(p, triton.cdiv(inter_size, bn1))](
        x, w13, inter, ids, top_k, w13.shape[0], inter_size, h, x.stride(0), w13.stride(0), w13.stride(1),
        inter.stride(0),
        BLOCK_N=bn1, BLOCK_K=bk1, num_warps=8)
    out_pairs = torch.empty(p, h, dtype=x.dtype, device=x.device)
    bk2 = triton.next_power_of_2(inter_size)
    bn2 = max(1, min(32, 8192 // bk2))
    _gemv2_kernel[(p, triton.cdiv(h, bn2))](
        inter, w2, out_pairs, ids, weights, w2.shape[0], h, inter_size, inter.stride(0), w2.stride(0), w2.stride(1),
        out_pairs.stride(0), BLOCK_N=bn2, BLOCK_K=bk2, num_warps=4)
    return out_pairs.view(t, top_k, h).sum(dim=1)


@dataclasses.dataclass(frozen=True)
class MoeTiles:
    block_m: int
    n1: int  # GEMM 1: BLOCK_N over I (two accumulators: gate and up), BLOCK_K over H
    k1: int
    n2: int  # GEMM 2: BLOCK_N over H, BLOCK_K over I
    k2: int
    warps: int = 4
    stages: int = 3


def moe_tiles(num_pairs: int, num_experts: int, dtype: torch.dtype) -> MoeTiles:
    """Tiles per regime. Decode: 16-row blocks, narrow N tiles for enough programs, long K tiles and 4 stages
    for bytes in flight. ptxas -v, sm_90, Triton 3.6, Qwen3-Next shape (H 2048, I 512, E 512), GEMM1 / GEMM2:
    bf16 P<=64 90/96 regs, 80 KB smem, HMMA; P<=16E 104/64 regs, 108/60 KB; prefill 119/127 regs, 72 KB,
    HGMMA; fp32 51-96 regs, FFMA. No spills, no stack frame."""
    if dtype == torch.float32:  # exact fp32 dots run on FMA units: small tiles
        return MoeTiles(16, 32, 32, 32, 32, 4, 2) if num_pairs <= 4 * num_experts else \
            MoeTiles(32, 32, 32, 64, 32, 4, 2)
    if num_pairs <= 64:  # a few tokens: few experts, so narrow N tiles to spread each expert over more SMs
        return MoeTiles(16, 32, 256, 64, 256, 4, 3)
    if num_pairs <= 16 * num_experts:  # decode batches: up to ~16 rows per expert
        return MoeTiles(16, 64, 128, 64, 128, 4, 4)
    return MoeTiles(64, 64, 64, 128, 64, 4, 3)


def _fit(block: int, dim: int) -> int:
    return max(16, min(block, triton.next_power_of_2(dim)))


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int, method: str | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted_ids [num_blocks_max * block_m] int32, block_expert [num_blocks_max] int32), built on the device.

    method: "kernel" (single-program Triton kernel), "torch", or None (kernel for at most SMALL_PAIRS pairs)."""
    flat = topk_ids.reshape(-1)
    p = flat.numel()
    num_blocks = min(p, num_experts) + triton.cdiv(p, block_m)
    dev = topk_ids.device
    if method is None:
        method = "kernel" if p <= SMALL_PAIRS else "torch"
    if method == "kernel":
        sorted_ids = torch.empty(num_blocks * block_m, dtype=torch.int32, device=dev)
        block_expert = torch.empty(num_blocks, dtype=torch.int32, device=dev)
        block_p = triton.next_power_of_2(max(p, 16))
        block_b = max(1, 256 // block_m)
        grid = (min(ALIGN_PROGRAMS, triton.cdiv(num_blocks, block_b)),)
        _align_kernel[grid](flat, sorted_ids, block_expert, p, num_experts, num_blocks, BLOCK_P=block_p,
                            NUM_BINS=triton.next_power_of_2(num_experts + 1), BLOCK_M=block_m,
                            BLOCK_B=block_b, num_warps=8 if block_p >= 1024 else 4)
        return sorted_ids, block_expert
    flat = flat.long()
    order = torch.argsort(flat, stable=True)
    # Bin E holds the pairs of experts on other ranks (expert parallelism): counted, then dropped.
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    counts = counts[:num_experts]
    nblk = (counts + block_m - 1) // block_m
    blk_end = torch.cumsum(nblk, 0)
    delta = (blk_end - nblk) * block_m - (torch.cumsum(counts, 0) - counts)  # padded start - packed start
    delta = torch.cat([delta, delta.new_zeros(1)])
    ids_sorted = flat[order]
    trash = num_blocks * block_m  # one slot past the layout: where the remote pairs' entries land
    dest = torch.where(ids_sorted < num_experts, torch.arange(p, device=dev) + delta[ids_sorted], trash)
    sorted_ids = torch.full((trash + 1,), p, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    sorted_ids = sorted_ids[:trash]
    blocks = torch.arange(num_blocks, device=dev, dtype=torch.int64)
    block_expert = torch.searchsorted(blk_end, blocks, right=True).clamp_(max=num_experts).to(torch.int32)
    return sorted_ids, block_expert


def fused_moe_triton(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor, *, tiles: MoeTiles | None = None, align: str | None = None,
                     remote_pairs: bool = False) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_weights [T, k], topk_ids [T, k] -> [T, H] in x's dtype.
    remote_pairs: ids may be E (an expert on another rank): such pairs are in no block and add zero (their
    out_pairs rows are zeroed up front; the per-pair path writes their zeros itself).
    tiles and align exist for tests and tuning sweeps (align="gemv" forces the per-pair path)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    assert w13.stride(-1) == 1 and w2.stride(-1) == 1, "expert weights need contiguous rows"
    t, h = x.shape
    num_experts, two_i, _ = w13.shape
    inter_size = two_i // 2
    top_k = topk_ids.shape[1]
    p = t * top_k
    if p == 0:
        return torch.zeros_like(x)
    if align == "gemv" or (p <= GEMV_PAIRS and align is None and tiles is None):
        return _fused_moe_gemv(x, w13, w2, topk_weights, topk_ids)
    tl_ = tiles or moe_tiles(p, num_experts, x.dtype)
    bm = tl_.block_m
    n1, k1, n2, k2 = _fit(tl_.n1, inter_size), _fit(tl_.k1, h), _fit(tl_.n2, h), _fit(tl_.k2, inter_size)
    sorted_ids, block_expert = moe_align(topk_ids.contiguous(), num_experts, bm, align)
    num_blocks = block_expert.numel()
    weights = topk_weights.reshape(-1)
    if not weights.is_contiguous():
        weights = weights.contiguous()
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    inter = torch.empty(p, inter_size, dtype=x.dtype, device=x.device)
    _gemm1_kernel[(num_blocks * triton.cdiv(inter_size, n1),)](
        x, w13, inter, sorted_ids, block_expert, p, top_k, num_experts, inter_size, h,
        x.stride(0), w13.stride(0), w13.stride(1), inter.stride(0),
        BLOCK_M=bm, BLOCK_N=n1, BLOCK_K=k1, EVEN_K=h % k1 == 0, DOT_PREC=prec,
        num_warps=tl_.warps, num_stages=tl_.stages)
    # Remote pairs sit in no block, so no program writes their rows: zero them first.
    out_pairs = (torch.zeros if remote_pairs else torch.empty)(p, h, dtype=x.dtype, device=x.device)
    _gemm2_kernel[(num_blocks * triton.cdiv(h, n2),)](
        inter, w2, out_pairs, sorted_ids, block_expert, weights, p, num_experts, h, inter_size,
        inter.stride(0), w2.stride(0), w2.stride(1), out_pairs.stride(0),
        BLOCK_M=bm, BLOCK_N=n2, BLOCK_K=k2, EVEN_K=inter_size % k2 == 0, DOT_PREC=prec,
        num_warps=tl_.warps, num_stages=tl_.stages)
    return out_pairs.view(t, top_k, h).sum(dim=1)
