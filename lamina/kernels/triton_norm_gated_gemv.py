"""Gated RMSNorm fused into the GEMV that reads it (the GDN layer's out_proj at decode): y = W @ gnorm(x, z)
for M <= 16 tokens, where gnorm(x, z)[h] = rms_norm(x[h]) * w * silu(z[h]) per head of D columns.

Each program owns BLOCK_N rows of W [N, Hv*D] and walks K in tiles of whole heads (BLOCK_K = heads * D), so
it can normalize the activation tile it is about to multiply by itself: load x and z [BLOCK_M, BLOCK_K],
view them as [BLOCK_M, heads, D], reduce over D, round where the reference rounds (the normalized x to x's
dtype, times the weight in that dtype, times silu(z) in fp32, to x's dtype), then the inner product. x and z
are small ([M, 4096] for Qwen3-Next) and L2-resident, so the norm work every program repeats costs no HBM
bytes; what goes is the normalized [M, Hv*D] round trip and a launch. `fma` (M <= 4, CUDA cores) or `dot`
(M padded to 16, tensor cores) inner products, as in triton_gemv. No split-K: BLOCK_N stays small instead.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_M = 16


@triton.jit(do_not_specialize=["M"])
def _gated_norm_gemv_kernel(x_ptr, z_ptr, nw_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_zm, stride_wn,
                            stride_ym, eps, D: tl.constexpr, HEADS: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, USE_DOT: tl.constexpr, DOT_PREC: tl.constexpr):
    BLOCK_K: tl.constexpr = HEADS * D
    pid_n = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    # The weight in x's dtype, held as fp32: a product of two 16-bit floats is exact in fp32, so rounding it
    # once equals the reference's 16-bit multiply (and the interpreter's 16-bit broadcast multiply is wrong).
    nw = tl.load(nw_ptr + tl.arange(0, D)).to(x_ptr.dtype.element_ty).to(tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + offs_k) < K
        wt = tl.load(w_ptr + offs_n[:, None].to(tl.int64) * stride_wn + (k0 + offs_k)[None, :],
                     mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        amask = m_ok[:, None] & k_ok[None, :]
        xt = tl.load(x_ptr + offs_m[:, None] * stride_xm + (k0 + offs_k)[None, :], mask=amask, other=0.0)
        zt = tl.load(z_ptr + offs_m[:, None] * stride_zm + (k0 + offs_k)[None, :], mask=amask, other=0.0)
        x3 = tl.reshape(xt.to(tl.float32), [BLOCK_M, HEADS, D])
        rstd = tl.math.rsqrt(tl.sum(x3 * x3, axis=2) / D + eps)
        xn = ((x3 * rstd[:, :, None]).to(x_ptr.dtype.element_ty).to(tl.float32) * nw[None, None, :])
        xn = xn.to(x_ptr.dtype.element_ty).to(tl.float32)
        z3 = tl.reshape(zt.to(tl.float32), [BLOCK_M, HEADS, D])
        a3 = (xn * (z3 * tl.sigmoid(z3))).to(x_ptr.dtype.element_ty)
        at = tl.reshape(a3, [BLOCK_M, BLOCK_K])
        if USE_DOT:
            acc += tl.dot(at, tl.trans(wt), input_precision=DOT_PREC)
        else:
            acc += tl.sum(at.to(tl.float32)[:, None, :] * wt.to(tl.float32)[None, :, :], axis=2)
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def default_tiles(m: int, n: int, d: int) -> tuple[int, int, bool, int]:
    """(BLOCK_N, heads per K tile, dot, warps): fma with 8 rows for M <= 4 (256 programs for N = 2048), dot
    with 16 rows above; ~512-1024-wide K tiles."""
    if m <= 4:
        return 8, max(1, 512 // d), False, 4
    return 16, max(1, 256 // d), True, 4


def gated_norm_gemv(x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, *, block_n: int | None = None, heads: int | None = None,
                    dot: bool | None = None, warps: int | None = None) -> torch.Tensor:
    """x, gate [M, Hv, D] (head stride D, unit column stride; any token stride), norm_weight [D], weight
    [N, Hv*D] contiguous rows, one dtype -> y [M, N] = F.linear(rms_norm_gated(x, gate), weight). D must be a
    power of two."""
    m, hv, d = x.shape
    n = weight.shape[0]
    assert 1 <= m <= MAX_M and gate.shape == x.shape and weight.shape[1] == hv * d and d == triton.next_power_of_2(d)
    assert x.stride(1) == d and gate.stride(1) == d and x.stride(2) == 1 and gate.stride(2) == 1
    assert weight.stride(-1) == 1 and x.dtype == gate.dtype == weight.dtype
    bn, hp, use_dot, nw = default_tiles(m, n, d)
    bn, hp = block_n or bn, min(heads or hp, triton.next_power_of_2(hv))
    use_dot = use_dot if dot is None else dot
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _gated_norm_gemv_kernel[(triton.cdiv(n, bn),)](
        x, gate, norm_weight, weight, y, m, n, hv * d, x.stride(0), gate.stride(0), weight.stride(0), y.stride(0),
        float(eps), D=d, HEADS=hp, BLOCK_M=16 if use_dot else triton.next_power_of_2(m), BLOCK_N=bn,
        USE_DOT=use_dot, DOT_PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps or nw)
    return y
