"""FP8 (e4m3) expert stacks in the MoE prefill path: the grouped GEMMs of triton_moe.py over FP8 weights.

Same layout and work split as triton_moe's grouped GEMMs (pairs sorted by expert on the device by
`moe_align`, one program per M-block x BLOCK_N columns, gathered token rows, no host syncs, so the grids
come from host shapes and the path can be captured in a CUDA graph). The weights are read at one byte per
element and widened in registers to the activations' dtype (e4m3 -> bf16/fp16 is exact), so the tensor
cores multiply the stored integers-with-exponent exactly and the scales are applied in fp32:
- row scales (per output channel; per-tensor checkpoints are expanded to rows at load): the K loop
  accumulates the unscaled product and the column's scale multiplies the accumulator once at the end;
- block scales (bn x bk, bk a power of two >= 16): BLOCK_K divides bk, so each K tile lies in one scale
  column and its product is scaled by that block's scale (a vector over the tile's N columns) before it is
  added.
Weight-only (activations are not rounded to FP8), fp32 accumulation, SwiGLU and the routing weight fused
as in the bf16 kernels. Scales are addressed generically, s[e, n // group_n, k // group_k], with
stride_sk = 0 and group_n = 1 for row scales.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels.triton_moe import MoeTiles, moe_align, moe_tiles


@triton.jit(do_not_specialize=["num_pairs"])
def _fp8_gemm1_kernel(x_ptr, w_ptr, s_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_pairs, top_k, num_experts,
                      N, K, stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_sk, group_n, stride_om,
                      GROUP_K: tl.constexpr, BLOCK_SCALES: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """inter[pair, n] = silu(x[tok] . Wg[e, n]) * (x[tok] . Wu[e, n]), W = q * scale, rows n and N + n."""
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
    rows_g = offs_n.to(tl.int64)
    rows_u = rows_g + N
    e64 = e.to(tl.int64)
    a_ptrs = x_ptr + tok[:, None] * stride_xm + offs_k[None, :]
    g_ptrs = w_ptr + e64 * stride_we + rows_g[None, :] * stride_wn + offs_k[:, None]
    u_ptrs = w_ptr + e64 * stride_we + rows_u[None, :] * stride_wn + offs_k[:, None]
    sg_ptrs = s_ptr + e64 * stride_se + (rows_g // group_n) * stride_sn
    su_ptrs = s_ptr + e64 * stride_se + (rows_u // group_n) * stride_sn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        bg = tl.load(g_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(a.dtype)
        bu = tl.load(u_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(a.dtype)
        if BLOCK_SCALES:
            kb = k0 // GROUP_K
            sg = tl.load(sg_ptrs + kb * stride_sk, mask=n_ok, other=0.0)
            su = tl.load(su_ptrs + kb * stride_sk, mask=n_ok, other=0.0)
            acc_g += tl.dot(a, bg, input_precision=DOT_PREC) * sg[None, :]
            acc_u += tl.dot(a, bu, input_precision=DOT_PREC) * su[None, :]
        else:
            acc_g = tl.dot(a, bg, acc_g, input_precision=DOT_PREC)
            acc_u = tl.dot(a, bu, acc_u, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        g_ptrs += BLOCK_K
        u_ptrs += BLOCK_K
    if not BLOCK_SCALES:
        acc_g = acc_g * tl.load(sg_ptrs, mask=n_ok, other=0.0)[None, :]
        acc_u = acc_u * tl.load(su_ptrs, mask=n_ok, other=0.0)[None, :]
    y = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    o_ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _fp8_gemm2_kernel(a_ptr, w_ptr, s_ptr, out_ptr, sorted_ptr, block_expert_ptr, topk_w_ptr, num_pairs,
                      num_experts, N, K, stride_am, stride_we, stride_wn, stride_se, stride_sn, stride_sk, group_n,
                      stride_om, GROUP_K: tl.constexpr, BLOCK_SCALES: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """out_pairs[pair, n] = weight[pair] * (inter[pair] . W2[e, n]), W2 = q * scale."""
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
    e64 = e.to(tl.int64)
    a_ptrs = a_ptr + rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = w_ptr + e64 * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    s_ptrs = s_ptr + e64 * stride_se + (offs_n // group_n).to(tl.int64) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0).to(a.dtype)
        if BLOCK_SCALES:
            sb = tl.load(s_ptrs + (k0 // GROUP_K) * stride_sk, mask=n_ok, other=0.0)
            acc += tl.dot(a, b, input_precision=DOT_PREC) * sb[None, :]
        else:
            acc = tl.dot(a, b, acc, input_precision=DOT_PREC)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if not BLOCK_SCALES:
        acc = acc * tl.load(s_ptrs, mask=n_ok, other=0.0)[None, :]
    wt = tl.load(topk_w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * wt[:, None]
    o_ptrs = out_ptr + rows[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def grouped_block_ok(block: tuple[int, int] | None) -> bool:
    """Whether the grouped kernels take these scales: row scales, or block scales whose K width is a power
    of two >= 16 (a K tile must lie inside one scale column; tl.dot needs K tiles >= 16)."""
    if block is None:
        return True
    bk = block[1]
    return bk >= 16 and bk & (bk - 1) == 0


def _fit(block: int, dim: int) -> int:
    return max(16, min(block, triton.next_power_of_2(dim)))


def _scale_args(scale: torch.Tensor, block: tuple[int, int] | None) -> tuple[int, int, int, int]:
    """(stride_se, stride_sn, stride_sk, group_n) of row scales [E, N] or block scales [E, nb, kb]."""
    if block is None:
        return scale.stride(0), scale.stride(1), 0, 1
    return scale.stride(0), scale.stride(1), scale.stride(2), block[0]


def fp8_moe_grouped(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                    block: tuple[int, int] | None, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                    tiles: MoeTiles | None = None, align: str | None = None) -> torch.Tensor:
    """x [T, H] (fp16 / bf16 / fp32), w13 fp8 [E, 2I, H], w2 fp8 [E, H, I] (contiguous rows) with row scales
    [E, 2I] / [E, H] or block scales [E, ceil(2I/bn), ceil(H/bk)] / [E, ceil(H/bn), ceil(I/bk)] (fp32),
    topk_weights / topk_ids [T, k] -> [T, H] in x's dtype. `tiles` and `align` are for tests and sweeps."""
    if not grouped_block_ok(block):
        raise ValueError(f"fp8_moe_grouped: scale blocks {block} need a power-of-two K width >= 16")
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
    tl_ = tiles or moe_tiles(p, num_experts, x.dtype)
    bm = tl_.block_m
    n1, k1, n2, k2 = _fit(tl_.n1, inter_size), _fit(tl_.k1, h), _fit(tl_.n2, h), _fit(tl_.k2, inter_size)
    group_k = 1 << 30  # row scales: no K groups
    if block is not None:
        group_k = block[1]
        k1, k2 = min(k1, group_k), min(k2, group_k)
    sorted_ids, block_expert = moe_align(topk_ids.contiguous(), num_experts, bm, align)
    num_blocks = block_expert.numel()
    weights = topk_weights.reshape(-1)
    if not weights.is_contiguous():
        weights = weights.contiguous()
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    s13, s2 = s13.float(), s2.float()
    inter = torch.empty(p, inter_size, dtype=x.dtype, device=x.device)
    _fp8_gemm1_kernel[(num_blocks * triton.cdiv(inter_size, n1),)](
        x, w13, s13, inter, sorted_ids, block_expert, p, top_k, num_experts, inter_size, h,
        x.stride(0), w13.stride(0), w13.stride(1), *_scale_args(s13, block), inter.stride(0),
        GROUP_K=group_k, BLOCK_SCALES=block is not None, BLOCK_M=bm, BLOCK_N=n1, BLOCK_K=k1, DOT_PREC=prec,
        num_warps=tl_.warps, num_stages=tl_.stages)
    out_pairs = torch.empty(p, h, dtype=x.dtype, device=x.device)
    _fp8_gemm2_kernel[(num_blocks * triton.cdiv(h, n2),)](
        inter, w2, s2, out_pairs, sorted_ids, block_expert, weights, p, num_experts, h, inter_size,
        inter.stride(0), w2.stride(0), w2.stride(1), *_scale_args(s2, block), out_pairs.stride(0),
        GROUP_K=group_k, BLOCK_SCALES=block is not None, BLOCK_M=bm, BLOCK_N=n2, BLOCK_K=k2, DOT_PREC=prec,
        num_warps=tl_.warps, num_stages=tl_.stages)
    return out_pairs.view(t, top_k, h).sum(dim=1)
