"""Triton rotary embedding (NeoX "rotate_half" layout), in place on q and k, partial rotary included.

One program per token: the token's cos/sin row is loaded once and applied to every q and k head. Only the
first rot_dim dims of each head are read and written; the rest stay as they are.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, t, stride_t, stride_h, num_heads, cos, sin, j, jmask,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    h = tl.arange(0, BLOCK_H)
    mask = (h < num_heads)[:, None] & jmask[None, :]
    base = x_ptr + t * stride_t + h[:, None] * stride_h + j[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(base, (x1 * cos[None, :] - x2 * sin[None, :]).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(q_ptr, k_ptr, pos_ptr, cs_ptr, num_q_heads, num_k_heads,
                 stride_qt, stride_qh, stride_kt, stride_kh, stride_cs,
                 HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    jmask = j < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + j, mask=jmask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + j, mask=jmask, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, t, stride_qt, stride_qh, num_q_heads, cos, sin, j, jmask, HALF, BLOCK_HQ)
    _rotate_heads(k_ptr, t, stride_kt, stride_kh, num_k_heads, cos, sin, j, jmask, HALF, BLOCK_HK)


def apply_rope_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                      cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hk, D] (views into a fused qkv buffer are fine); rotated in place and returned."""
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "rope works in place and needs unit-stride head dims"
    assert cos_sin_cache.stride(-1) == 1
    t = q.shape[0]
    if t == 0:
        return q, k
    half = cos_sin_cache.shape[-1] // 2
    hq, hk = q.shape[1], k.shape[1]
    block_hq, block_hk = triton.next_power_of_2(hq), triton.next_power_of_2(hk)
    block_half = triton.next_power_of_2(half)
    _rope_kernel[(t,)](
        q, k, positions, cos_sin_cache, hq, hk, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        cos_sin_cache.stride(0), HALF=half, BLOCK_HALF=block_half, BLOCK_HQ=block_hq, BLOCK_HK=block_hk,
        num_warps=4 if block_hq * block_half >= 1024 else 2)
    return q, k
