"""Triton building blocks shared by the paged-attention kernels: the cache store conversion and one
online-softmax step over a key tile gathered through a block table (prefill and the first decode kernel)."""
from __future__ import annotations

import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def to_cache(x, cache_ptr):
    """x in the cache's element type; an FP8 cache (e4m3, scale 1.0) saturates at +-448 instead of NaN."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        x = tl.clamp(x.to(tl.float32), -448.0, 448.0)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def attend_tile(qt, m_i, l_i, acc, kc_ptr, vc_ptr, bt_row_ptr, kvh, kpos, kmask, allowed, scale_log2,
                 cap_log2, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                 D: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                 PAGE: tl.constexpr, DOT_PREC: tl.constexpr, MASK: tl.constexpr, SOFTCAP: tl.constexpr):
    """One online-softmax step over BLOCK_N keys gathered through the block table (exp2 domain).
    SOFTCAP: scale_log2 is scale / cap and cap_log2 is cap * log2(e), so s = cap * tanh(qk * scale / cap)
    in the exp2 domain."""
    # Keys past the context are masked on every load: unused cache slots may hold anything, NaN included.
    blk = tl.load(bt_row_ptr + kpos // PAGE, mask=kmask, other=0).to(tl.int64)
    slot = (kpos % PAGE).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    k_off = blk * stride_kb + slot * stride_kt + kvh * stride_kh
    k = tl.load(kc_ptr + k_off[None, :] + d[:, None], mask=kmask[None, :] & (d < D)[:, None], other=0.0)
    s = tl.dot(qt, k.to(qt.dtype), input_precision=DOT_PREC) * scale_log2
    if SOFTCAP:
        # tanh(x) = 2 / (1 + exp(-2x)) - 1: saturates to +-1 without inf/inf for large |x|.
        s = (2.0 / (1.0 + tl.exp(-2.0 * s)) - 1.0) * cap_log2
    if MASK:
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row can see no key yet (sliding window, padded rows): keep exp2 away from (-inf) - (-inf).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_safe[:, None])
    alpha = tl.math.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    dv = tl.arange(0, BLOCK_DV)
    v_off = blk * stride_vb + slot * stride_vt + kvh * stride_vh
    v = tl.load(vc_ptr + v_off[:, None] + dv[None, :], mask=kmask[:, None] & (dv < DV)[None, :], other=0.0)
    v = v.to(qt.dtype)  # an FP8 cache is widened in registers (a no-op for a cache in q's dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
    return m_new, l_i, acc
