"""Triton q/k RMSNorm + RoPE + KV store in one launch (the reference is attention_prep.qk_norm_rope_store_ref).

Grid (T, NQB + NKB): program (t, j) with j < NQB normalizes and rotates q heads [j*BLOCK_HQ, (j+1)*BLOCK_HQ)
of token t and writes them to the output; j >= NQB does the same for a block of k heads and writes them, with
the matching v heads, straight into the KV cache at the token's slot (nothing for slot < 0). k never goes back
to memory outside the cache: attention reads it from there. Each program loads its rows twice, at d and at
the rotation partner d +- ROT/2 (the second load hits L1), so the normalized partner comes out elementwise with
no register shuffle: y[d] = n[d] cos - n[d + ROT/2] sin (first half), n[d] cos + n[d - ROT/2] sin (second
half), n[d] past ROT (partial rotary). The rounding follows the reference: the norm's output is rounded to
the input dtype before the rotation, the rotated k to k's dtype before the cache's.

Decode (few tokens) splits q's heads over several programs so that one token still spreads over a few SMs;
prefill puts a token's q heads in one program. The grid depends on host shapes only (T, head counts), there
are no host syncs, so the launch can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels.triton_attention_tile import to_cache


@triton.jit
def _norm_rope_rows(x_ptr, row_off, hmask, w_ptr, cs_row_ptr, eps, offset,
                    D: tl.constexpr, ROT: tl.constexpr, BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr):
    """[BLOCK_H, BLOCK_D] fp32: rows at x_ptr + row_off (one per head), normalized (HAS_NORM) and rotated."""
    HALF: tl.constexpr = ROT // 2
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    first = d < HALF
    rot = d < ROT
    partner = tl.where(rot, tl.where(first, d + HALF, d - HALF), d)
    m = hmask[:, None] & dmask[None, :]
    x = tl.load(x_ptr + row_off[:, None] + d[None, :], mask=m, other=0.0)
    xp = tl.load(x_ptr + row_off[:, None] + partner[None, :], mask=m, other=0.0)
    xf = x.to(tl.float32)
    xpf = xp.to(tl.float32)
    if HAS_NORM:
        rstd = tl.math.rsqrt(tl.sum(xf * xf, 1) / D + eps)
        w = tl.load(w_ptr + d, mask=dmask, other=0.0).to(tl.float32) + offset
        wp = tl.load(w_ptr + partner, mask=dmask, other=0.0).to(tl.float32) + offset
        xf = ((xf * rstd[:, None]) * w[None, :]).to(x.dtype).to(tl.float32)
        xpf = ((xpf * rstd[:, None]) * wp[None, :]).to(x.dtype).to(tl.float32)
    j = tl.where(first, d, d - HALF)
    cos = tl.load(cs_row_ptr + j, mask=rot, other=1.0).to(tl.float32)
    sin = tl.load(cs_row_ptr + HALF + j, mask=rot, other=0.0).to(tl.float32)
    sin = tl.where(first, -sin, sin)
    return xf * cos[None, :] + xpf * sin[None, :]


@triton.jit
def _prep_kernel(q_ptr, k_ptr, v_ptr, qo_ptr, kc_ptr, vc_ptr, pos_ptr, slot_ptr, cs_ptr, qw_ptr, kw_ptr,
                 num_q_heads, num_kv_heads, stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                 stride_ot, stride_oh, stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
                 stride_cs, eps, offset,
                 D: tl.constexpr, DV: tl.constexpr, ROT: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_DV: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, NQB: tl.constexpr,
                 PAGE: tl.constexpr, HAS_NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    cs_row = cs_ptr + pos * stride_cs
    d = tl.arange(0, BLOCK_D)
    if blk < NQB:
        h = blk * BLOCK_HQ + tl.arange(0, BLOCK_HQ)
        hmask = h < num_q_heads
        y = _norm_rope_rows(q_ptr, t * stride_qt + h.to(tl.int64) * stride_qh, hmask, qw_ptr, cs_row, eps,
                            offset, D, ROT, BLOCK_D, HAS_NORM)
        m = hmask[:, None] & (d < D)[None, :]
        tl.store(qo_ptr + t * stride_ot + h.to(tl.int64)[:, None] * stride_oh + d[None, :],
                 y.to(qo_ptr.dtype.element_ty), mask=m)
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:  # slot < 0: a padding row, nothing is stored
            page = slot // PAGE
            off = slot % PAGE
            h = (blk - NQB) * BLOCK_HK + tl.arange(0, BLOCK_HK)
            hmask = h < num_kv_heads
            h64 = h.to(tl.int64)
            y = _norm_rope_rows(k_ptr, t * stride_kt + h64 * stride_kh, hmask, kw_ptr, cs_row, eps, offset,
                                D, ROT, BLOCK_D, HAS_NORM)
            m = hmask[:, None] & (d < D)[None, :]
            y = to_cache(y.to(k_ptr.dtype.element_ty), kc_ptr)
            tl.store(kc_ptr + page * stride_kcb + off * stride_kct + h64[:, None] * stride_kch + d[None, :], y,
                     mask=m)
            dv = tl.arange(0, BLOCK_DV)
            mv = hmask[:, None] & (dv < DV)[None, :]
            v = tl.load(v_ptr + t * stride_vt + h64[:, None] * stride_vh + dv[None, :], mask=mv)
            tl.store(vc_ptr + page * stride_vcb + off * stride_vct + h64[:, None] * stride_vch + dv[None, :],
                     to_cache(v, vc_ptr), mask=mv)


DECODE_TOKENS = 16  # up to this many tokens, q's heads are split over programs of ~1k elements


def prep_tiles(num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int) -> tuple[int, int, int]:
    """(BLOCK_HQ, BLOCK_HK, num_warps): heads per program for q and for k/v, from host shapes only."""
    block_d = triton.next_power_of_2(head_dim)
    cap = 1024 if num_tokens <= DECODE_TOKENS else 4096
    heads = max(1, cap // block_d)
    block_hq = min(triton.next_power_of_2(num_q_heads), heads)
    block_hk = min(triton.next_power_of_2(num_kv_heads), max(1, 2048 // block_d))
    warps = 4 if max(block_hq, block_hk) * block_d >= 2048 else 2
    return block_hq, block_hk, warps


def qk_norm_rope_store_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                              cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slot_mapping: torch.Tensor, q_weight: torch.Tensor | None = None,
                              k_weight: torch.Tensor | None = None, eps: float = 1e-6, offset: float = 0.0,
                              *, q_out: torch.Tensor | None = None,
                              tiles: tuple[int, int, int] | None = None) -> torch.Tensor:
    """Same contract as qk_norm_rope_store_ref. q/k/v may be strided views (unit stride on the last dim);
    q_out (default: a new contiguous tensor) may be q itself for an in-place update. `tiles` overrides
    prep_tiles (tests and sweeps)."""
    assert (q_weight is None) == (k_weight is None)
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and cos_sin_cache.stride(-1) == 1
    t, hq, d = q.shape
    hkv, dv = k.shape[1], v.shape[-1]
    rot = cos_sin_cache.shape[-1]
    assert rot <= d and rot % 2 == 0
    if q_out is None:
        q_out = torch.empty((t, hq, d), dtype=q.dtype, device=q.device)
    assert q_out.shape == q.shape and q_out.stride(-1) == 1
    if t == 0:
        return q_out
    block_hq, block_hk, warps = tiles or prep_tiles(t, hq, hkv, d)
    nqb, nkb = triton.cdiv(hq, block_hq), triton.cdiv(hkv, block_hk)
    has_norm = q_weight is not None
    qw, kw = (q_weight, k_weight) if has_norm else (q, k)
    _prep_kernel[(t, nqb + nkb)](
        q, k, v, q_out, k_cache, v_cache, positions, slot_mapping, cos_sin_cache, qw, kw, hq, hkv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), q_out.stride(0),
        q_out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
        v_cache.stride(1), v_cache.stride(2), cos_sin_cache.stride(0), float(eps), float(offset),
        D=d, DV=dv, ROT=rot, BLOCK_D=triton.next_power_of_2(d), BLOCK_DV=triton.next_power_of_2(dv),
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, NQB=nqb, PAGE=k_cache.shape[1], HAS_NORM=has_norm,
        num_warps=warps)
    return q_out
