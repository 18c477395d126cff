"""Triton kernels for MLA over the paged latent cache: the latent store and the absorbed-form decode.

Decode (kernels/mla_decode.py has the contract and the torch reference): all heads share one cache row per
token, [latent C | rope key R], so a program takes BLOCK_H heads of one sequence at once (the cache tile is
read once for all of them: the MQA shape) and a contiguous range of its keys (split-K over the sequence):
  scores [BLOCK_H, BLOCK_N] = q_lat . latent^T + q_pe . k_pe^T  (two tensor-core dots)
  acc    [BLOCK_H, C]       += p . latent                        (online softmax in exp2)
Each split writes its normalised partial output and log-sum-exp; a second kernel merges the splits (and
writes zeros for padding sequences, seq_len 0). The split count comes from host numbers only (batch size,
head blocks and a host bound on the context), and each split's key range from the sequence's real length on
the device, so the launch can be captured in a CUDA graph and short sequences in a long-bound graph only pay
for empty splits exiting early.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lamina.kernels.triton_attention import to_cache

_LOG2E = 1.4426950408889634


@triton.jit
def _store_latent_kernel(lat_ptr, pe_ptr, cache_ptr, slot_ptr, stride_lat, stride_pe, stride_row,
                         C: tl.constexpr, R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token
        return
    c = tl.arange(0, BLOCK_C)
    r = tl.arange(0, BLOCK_R)
    lat = tl.load(lat_ptr + t * stride_lat + c, mask=c < C)
    pe = tl.load(pe_ptr + t * stride_pe + r, mask=r < R)
    dst = cache_ptr + slot * stride_row
    tl.store(dst + c, to_cache(lat, cache_ptr), mask=c < C)
    tl.store(dst + C + r, to_cache(pe, cache_ptr), mask=r < R)


def store_latent_triton(latent: torch.Tensor, k_pe: torch.Tensor, cache: torch.Tensor,
                        slot_mapping: torch.Tensor) -> None:
    t, c = latent.shape
    r = k_pe.shape[1]
    if t == 0:
        return
    assert latent.stride(1) == 1 and k_pe.stride(1) == 1 and cache.is_contiguous()
    _store_latent_kernel[(t,)](latent, k_pe, cache, slot_mapping, latent.stride(0), k_pe.stride(0),
                               cache.stride(1), C=c, R=r, BLOCK_C=triton.next_power_of_2(c),
                               BLOCK_R=triton.next_power_of_2(r), num_warps=4)


@triton.jit
def _mla_decode_split_kernel(q_lat_ptr, q_pe_ptr, cache_ptr, bt_ptr, lens_ptr, po_ptr, plse_ptr,
                             num_heads, scale_log2, stride_qb, stride_qh, stride_pb, stride_ph, stride_row,
                             stride_bt, stride_pob, stride_poh, stride_pos,
                             C: tl.constexpr, R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
                             PAGE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                             NUM_SPLITS: tl.constexpr, DOT_PREC: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    sp = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    if seq_len == 0:  # padding: the reduce kernel writes its zeros
        return
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = sp * per_split
    end = tl.minimum(start + per_split, seq_len)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < num_heads
    c = tl.arange(0, BLOCK_C)
    r = tl.arange(0, BLOCK_R)
    cmask, rmask = c < C, r < R
    q_lat = tl.load(q_lat_ptr + b * stride_qb + h[:, None] * stride_qh + c[None, :],
                    mask=hmask[:, None] & cmask[None, :], other=0.0)
    q_pe = tl.load(q_pe_ptr + b * stride_pb + h[:, None] * stride_ph + r[None, :],
                   mask=hmask[:, None] & rmask[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        kmask = pos < end
        block = tl.load(bt_ptr + b * stride_bt + pos // PAGE, mask=kmask, other=0).to(tl.int64)
        row = cache_ptr + (block * PAGE + pos % PAGE) * stride_row
        # An FP8 cache widens to the query's dtype here (in registers).
        lat = tl.load(row[:, None] + c[None, :], mask=kmask[:, None] & cmask[None, :], other=0.0).to(q_lat.dtype)
        pe = tl.load(row[:, None] + C + r[None, :], mask=kmask[:, None] & rmask[None, :], other=0.0).to(q_pe.dtype)
        s = tl.dot(q_lat, tl.trans(lat), input_precision=DOT_PREC)
        s += tl.dot(q_pe, tl.trans(pe), input_precision=DOT_PREC)
        s = tl.where(kmask[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat, input_precision=DOT_PREC)
        m_i = m_new
    empty = l_i == 0.0  # an empty split (its range starts past the sequence)
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    po = po_ptr + b * stride_pob + h[:, None] * stride_poh + sp * stride_pos + c[None, :]
    tl.store(po, out, mask=hmask[:, None] & cmask[None, :])
    tl.store(plse_ptr + (b * num_heads + h) * NUM_SPLITS + sp, lse, mask=hmask)


@triton.jit
def _mla_decode_reduce_kernel(po_ptr, plse_ptr, lens_ptr, out_ptr, num_heads, stride_pob, stride_poh,
                              stride_pos, stride_ob, stride_oh, C: tl.constexpr, BLOCK_C: tl.constexpr,
                              NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    c = tl.arange(0, BLOCK_C)
    cmask = c < C
    dst = out_ptr + b * stride_ob + h * stride_oh + c
    if tl.load(lens_ptr + b) == 0:
        tl.store(dst, tl.zeros([BLOCK_C], tl.float32).to(out_ptr.dtype.element_ty), mask=cmask)
        return
    s = tl.arange(0, BLOCK_S)
    smask = s < NUM_SPLITS
    lse = tl.load(plse_ptr + (b * num_heads + h) * NUM_SPLITS + s, mask=smask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, axis=0))  # empty splits: exp2(-inf) = 0
    part = tl.load(po_ptr + b * stride_pob + h * stride_poh + s[:, None] * stride_pos + c[None, :],
                   mask=smask[:, None] & cmask[None, :], other=0.0)
    out = tl.sum(part * w[:, None], axis=0) / tl.sum(w, axis=0)
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=cmask)


def num_splits(batch: int, head_blocks: int, max_seq_len: int, keys_per_split: int = 256,
               max_splits: int = 32, target_programs: int = 512) -> int:
    """Splits over the sequence: enough programs to fill the GPU at small batches, never a split of fewer
    than ~keys_per_split keys of the host bound, one split once batch x head blocks fills the target."""
    by_len = triton.cdiv(max(max_seq_len, 1), keys_per_split)
    by_grid = max(1, target_programs // max(batch * head_blocks, 1))
    return max(1, min(by_len, by_grid, max_splits))


def mla_decode_triton(q_lat: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, scale: float, max_seq_len: int | None = None,
                      splits: int | None = None) -> torch.Tensor:
    """q_lat [B, H, C], q_pe [B, H, R] -> [B, H, C] in q_lat's dtype. max_seq_len: a host bound on seq_lens
    (sizes the split count; None: cache capacity of a block-table row). splits: force a split count (tests)."""
    b, h, c = q_lat.shape
    r = q_pe.shape[2]
    out = torch.empty(b, h, c, dtype=q_lat.dtype, device=q_lat.device)
    if b == 0:
        return out
    assert q_lat.stride(2) == 1 and q_pe.stride(2) == 1 and cache.is_contiguous()
    page = cache.shape[1]
    block_h = max(16, min(triton.next_power_of_2(h), 16))  # tl.dot needs M >= 16; padded heads are masked
    head_blocks = triton.cdiv(h, block_h)
    bound = max_seq_len if max_seq_len is not None else block_tables.shape[1] * page
    n_split = splits or num_splits(b, head_blocks, bound)
    po = torch.empty(b, h, n_split, c, dtype=torch.float32, device=q_lat.device)
    plse = torch.empty(b, h, n_split, dtype=torch.float32, device=q_lat.device)
    block_c, block_r = triton.next_power_of_2(c), triton.next_power_of_2(r)
    block_n = 32 if block_c >= 256 else 64
    prec = "ieee" if q_lat.dtype == torch.float32 else "tf32"
    _mla_decode_split_kernel[(b, head_blocks, n_split)](
        q_lat, q_pe, cache, block_tables, seq_lens, po, plse, h, scale * _LOG2E,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), cache.stride(1),
        block_tables.stride(0), po.stride(0), po.stride(1), po.stride(2),
        C=c, R=r, BLOCK_C=block_c, BLOCK_R=block_r, PAGE=page, BLOCK_H=block_h, BLOCK_N=block_n,
        NUM_SPLITS=n_split, DOT_PREC=prec, num_warps=8 if block_c >= 256 else 4, num_stages=2)
    _mla_decode_reduce_kernel[(b, h)](
        po, plse, seq_lens, out, h, po.stride(0), po.stride(1), po.stride(2), out.stride(0), out.stride(1),
        C=c, BLOCK_C=block_c, NUM_SPLITS=n_split, BLOCK_S=triton.next_power_of_2(n_split),
        num_warps=8 if triton.next_power_of_2(n_split) * block_c >= 8192 else 4)
    return out
