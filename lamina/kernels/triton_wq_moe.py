"""Weight-quantized expert stacks (4-bit GPTQ / AWQ / compressed-tensors, 8-bit, in wq_matmul.py's layout) in
the MoE path: the grouped GEMMs of triton_moe.py with the weights dequantized in registers.

Layout and work split as triton_moe's grouped GEMMs (pairs sorted by expert on the device by `moe_align`,
one program per M-block x BLOCK_N columns, gathered token rows, grids from host shapes, no host syncs: it
serves decode, prefill and CUDA-graph capture alike). Weights per expert: uint8 [N, K/2] (4-bit, low nibble
first) or int8 [N, K], fp16 scale and offset [N, K/G], W = q * scale + offset.

Each K tile reads the packed bytes as [BLOCK_N, BLOCK_K / 2] (contiguous along K) and interleaves the nibbles
back in registers. When BLOCK_K divides the group (G a power of two
>= 16, the usual 32/64/128), the tile lies in one group and a . W factorizes per column as
scale * (a . q) + offset * sum(a): the tensor cores multiply the raw integers (exact in bf16/fp16) and the
fp32 epilogue of the tile applies the group's scale and offset, so the weights are never rounded. Other
groups dequantize per element (q * scale + offset in fp32, rounded to the activations' dtype) before the
dot. Act-order checkpoints store each expert's columns sorted by group with a permutation `perm[e, K]`
(int32; stored column c multiplies input column perm[e, c]): the A tile is gathered through it.
Accumulation in fp32; SwiGLU and the routing weight fused as in the bf16 kernels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels.triton_moe import MoeTiles, moe_align, moe_tiles


@triton.jit
def _wq_tile(a, q_base, s_base, o_base, rows, n_ok, kk, k_ok, k0, K, stride_qn, stride_sn, GROUP: tl.constexpr,
             BITS: tl.constexpr, FACTORED: tl.constexpr, DOT_PREC: tl.constexpr, BLOCK_K: tl.constexpr):
    """a [BLOCK_M, BLOCK_K] (the activations' dtype, zero outside k_ok) . W[rows, kk]^T -> fp32 [BLOCK_M, BLOCK_N]."""
    wmask = k_ok[:, None] & n_ok[None, :]
    if BITS == 4:
        # The bytes as [BLOCK_N, BLOCK_K / 2], contiguous along K (16-byte vector loads): addressed as
        # q + n * stride + k // 2 in [BLOCK_K, BLOCK_N], Triton saw no contiguity through k // 2 and issued
        # one scattered 1-byte load per element (each byte twice; the dense kernel measured 0.035x bf16 so).
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        b = tl.load(q_base + rows[:, None] * stride_qn + kb[None, :], mask=n_ok[:, None] & (kb < K // 2)[None, :],
                    other=0).to(tl.int32)
        q = tl.trans(tl.reshape(tl.join(b & 0xF, b >> 4), (b.shape[0], BLOCK_K)))  # [BLOCK_K, BLOCK_N], k order
    else:
        q = tl.load(q_base + rows[None, :] * stride_qn + kk[:, None], mask=wmask, other=0).to(tl.int32)
    if FACTORED:
        g = k0 // GROUP
        s = tl.load(s_base + rows * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)
        o = tl.load(o_base + rows * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)
        prod = tl.dot(a, q.to(a.dtype), input_precision=DOT_PREC)
        res = prod * s[None, :] + tl.sum(a.to(tl.float32), axis=1)[:, None] * o[None, :]
    else:
        g = kk[:, None] // GROUP
        s = tl.load(s_base + rows[None, :] * stride_sn + g, mask=wmask, other=0.0).to(tl.float32)
        o = tl.load(o_base + rows[None, :] * stride_sn + g, mask=wmask, other=0.0).to(tl.float32)
        res = tl.dot(a, (q.to(tl.float32) * s + o).to(a.dtype), input_precision=DOT_PREC)
    return res


@triton.jit(do_not_specialize=["num_pairs"])
def _wq_gemm1_kernel(x_ptr, q_ptr, s_ptr, o_ptr, perm_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_pairs, top_k,
                     num_experts, N, K, stride_xm, stride_qe, stride_qn, stride_se, stride_sn, stride_pe, stride_om,
                     GROUP: tl.constexpr, BITS: tl.constexpr, FACTORED: tl.constexpr, HAS_PERM: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PREC: tl.constexpr):
    """inter[pair, n] = silu(x[tok] . Wg[e, n]) * (x[tok] . Wu[e, n]), rows n and N + n (N = I, K = H)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    e = tl.load(block_expert_ptr + pid_m)
    if e >= num_experts:  # a block no routing of this shape fills
        return
    e64 = e.to(tl.int64)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < num_pairs
    tok = (pair // top_k).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows_g = offs_n.to(tl.int64)
    rows_u = rows_g + N
    offs_k = tl.arange(0, BLOCK_K)
    q_base = q_ptr + e64 * stride_qe
    s_base = s_ptr + e64 * stride_se
    o_base = o_ptr + e64 * stride_se
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        if HAS_PERM:
            cols = tl.load(perm_ptr + e64 * stride_pe + kk, mask=k_ok, other=0)
        else:
            cols = kk
        a = tl.load(x_ptr + tok[:, None] * stride_xm + cols[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc_g += _wq_tile(a, q_base, s_base, o_base, rows_g, n_ok, kk, k_ok, k0, K, stride_qn, stride_sn, GROUP,
                          BITS, FACTORED, DOT_PREC, BLOCK_K)
        acc_u += _wq_tile(a, q_base, s_base, o_base, rows_u, n_ok, kk, k_ok, k0, K, stride_qn, stride_sn, GROUP,
                          BITS, FACTORED, DOT_PREC, BLOCK_K)
    y = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    o_ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(o_ptrs, y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _wq_gemm2_kernel(a_ptr, q_ptr, s_ptr, o_ptr, perm_ptr, out_ptr, sorted_ptr, block_expert_ptr, topk_w_ptr,
                     num_pairs, num_experts, N, K, stride_am, stride_qe, stride_qn, stride_se, stride_sn, stride_pe,
                     stride_om, GROUP: tl.constexpr, BITS: tl.constexpr, FACTORED: tl.constexpr,
                     HAS_PERM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     DOT_PREC: tl.constexpr):
    """out_pairs[pair, n] = weight[pair] * (inter[pair] . W2[e, n]) (N = H, K = I)."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    e = tl.load(block_expert_ptr + pid_m)
    if e >= num_experts:
        return
    e64 = e.to(tl.int64)
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < num_pairs
    prow = pair.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    rows = offs_n.to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    q_base = q_ptr + e64 * stride_qe
    s_base = s_ptr + e64 * stride_se
    o_base = o_ptr + e64 * stride_se
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_ok = kk < K
        if HAS_PERM:
            cols = tl.load(perm_ptr + e64 * stride_pe + kk, mask=k_ok, other=0)
        else:
            cols = kk
        a = tl.load(a_ptr + prow[:, None] * stride_am + cols[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)
        acc += _wq_tile(a, q_base, s_base, o_base, rows, n_ok, kk, k_ok, k0, K, stride_qn, stride_sn, GROUP, BITS,
                        FACTORED, DOT_PREC, BLOCK_K)
    wt = tl.load(topk_w_ptr + prow, mask=row_ok, other=0.0).to(tl.float32)
    acc = acc * wt[:, None]
    o_ptrs = out_ptr + prow[:, None] * stride_om + offs_n[None, :]
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def _fit(block: int, dim: int) -> int:
    return max(16, min(block, triton.next_power_of_2(dim)))


def _k_tile(tile: int, k: int, group: int) -> tuple[int, bool]:
    """(BLOCK_K, factored): a K tile inside one group when the group is a power of two >= 16."""
    bk = _fit(tile, k)
    if group >= 16 and group & (group - 1) == 0:
        return min(bk, group), True
    return bk, False


def _check(q: torch.Tensor, s: torch.Tensor, o: torch.Tensor, perm: torch.Tensor | None, bits: int, n: int,
           k: int, what: str) -> int:
    """The group size of one stack, after checking its shapes (e, n, k: the unpacked weight's)."""
    e = q.shape[0]
    groups = s.shape[-1]
    if (bits not in (4, 8) or tuple(q.shape) != (e, n, k * bits // 8) or tuple(s.shape) != (e, n, groups)
            or o.shape != s.shape or o.stride() != s.stride() or groups == 0 or k % groups):
        raise ValueError(f"wq_moe_grouped: bad {what} stack: bits={bits}, qweight {tuple(q.shape)}, scales "
                         f"{tuple(s.shape)}, offsets {tuple(o.shape)} for [{e}, {n}, {k}]")
    if q.stride(-1) != 1 or s.stride(-1) != 1:
        raise ValueError(f"wq_moe_grouped: the {what} stack needs unit stride along K")
    if perm is not None and (tuple(perm.shape) != (e, k) or perm.stride(-1) != 1):
        raise ValueError(f"wq_moe_grouped: the {what} permutation has shape {tuple(perm.shape)}, not ({e}, {k})")
    return k // groups


def wq_moe_grouped(x: torch.Tensor, q13: torch.Tensor, s13: torch.Tensor, o13: torch.Tensor,
                   perm13: torch.Tensor | None, q2: torch.Tensor, s2: torch.Tensor, o2: torch.Tensor,
                   perm2: torch.Tensor | None, bits: int, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                   tiles: MoeTiles | None = None, align: str | None = None) -> torch.Tensor:
    """x [T, H] (fp16 / bf16 / fp32); gate|up stack q13 [E, 2I, H*bits/8] with s13 / o13 [E, 2I, H/G1] and
    optional perm13 [E, H] (int32); down stack q2 [E, H, I*bits/8], s2 / o2 [E, H, I/G2], perm2 [E, I];
    topk_weights / topk_ids [T, k] -> [T, H] in x's dtype. `tiles` and `align` are for tests and sweeps."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    t, h = x.shape
    num_experts, two_i = q13.shape[:2]
    inter_size = two_i // 2
    g1 = _check(q13, s13, o13, perm13, bits, two_i, h, "gate|up")
    g2 = _check(q2, s2, o2, perm2, bits, h, inter_size, "down")
    top_k = topk_ids.shape[1]
    p = t * top_k
    if p == 0:
        return torch.zeros_like(x)
    tl_ = tiles or moe_tiles(p, num_experts, x.dtype)
    bm = tl_.block_m
    n1, n2 = _fit(tl_.n1, inter_size), _fit(tl_.n2, h)
    k1, fact1 = _k_tile(tl_.k1, h, g1)
    k2, fact2 = _k_tile(tl_.k2, inter_size, g2)
    sorted_ids, block_expert = moe_align(topk_ids.contiguous(), num_experts, bm, align)
    num_blocks = block_expert.numel()
    weights = topk_weights.reshape(-1)
    if not weights.is_contiguous():
        weights = weights.contiguous()
    prec = "ieee" if x.dtype == torch.float32 else "tf32"
    inter = torch.empty(p, inter_size, dtype=x.dtype, device=x.device)
    _wq_gemm1_kernel[(num_blocks * triton.cdiv(inter_size, n1),)](
        x, q13, s13, o13, perm13 if perm13 is not None else s13, inter, sorted_ids, block_expert, p, top_k,
        num_experts, inter_size, h, x.stride(0), q13.stride(0), q13.stride(1), s13.stride(0), s13.stride(1),
        perm13.stride(0) if perm13 is not None else 0, inter.stride(0),
        GROUP=g1, BITS=bits, FACTORED=fact1, HAS_PERM=perm13 is not None, BLOCK_M=bm, BLOCK_N=n1, BLOCK_K=k1,
        DOT_PREC=prec, num_warps=tl_.warps, num_stages=tl_.stages)
    out_pairs = torch.empty(p, h, dtype=x.dtype, device=x.device)
    _wq_gemm2_kernel[(num_blocks * triton.cdiv(h, n2),)](
        inter, q2, s2, o2, perm2 if perm2 is not None else s2, out_pairs, sorted_ids, block_expert, weights, p,
        num_experts, h, inter_size, inter.stride(0), q2.stride(0), q2.stride(1), s2.stride(0), s2.stride(1),
        perm2.stride(0) if perm2 is not None else 0, out_pairs.stride(0),
        GROUP=g2, BITS=bits, FACTORED=fact2, HAS_PERM=perm2 is not None, BLOCK_M=bm, BLOCK_N=n2, BLOCK_K=k2,
        DOT_PREC=prec, num_warps=tl_.warps, num_stages=tl_.stages)
    return out_pairs.view(t, top_k, h).sum(dim=1)
