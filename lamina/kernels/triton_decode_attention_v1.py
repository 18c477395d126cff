"""The first paged decode attention kernel (split-K flash-decoding, one program per (sequence, KV head,
split)), kept as it was so the GPU bench can time it next to its successor (triton_decode_attention.py) and
`LAMINA_DECODE_ATTN=old` can bring it back in the engine. GPU_KERNELS.md has its measurements."""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from lamina.kernels.triton_attention_tile import attend_tile

MAX_SPLITS = 32  # 64 splits of a 32k context were slower than 32 (55.7 vs 52.5 us, H200, GPU_KERNELS.md)


# Per-batch integers are not specialized on (value 1, divisibility by 16): a new batch size or window must
# not trigger a recompile, least of all while a CUDA graph is being captured.
@triton.jit(do_not_specialize=["window", "num_splits", "stride_bt"])
def _decode_kernel(q_ptr, kc_ptr, vc_ptr, o_ptr, po_ptr, pm_ptr, pl_ptr, bt_ptr, seq_lens_ptr, qs_ptr,
                   scale_log2, cap_log2, window, num_splits, num_q_heads,
                   stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                   stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                   G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
                   BLOCK_D: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr, PAGE: tl.constexpr,
                   SLIDING: tl.constexpr, DIRECT: tl.constexpr, DOT_PREC: tl.constexpr,
                   SOFTCAP: tl.constexpr = False):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(qs_ptr + b)
    if tl.load(qs_ptr + b + 1) - q_start != 1:  # a prefill row of a mixed batch: the prefill kernel owns it
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx_start = 0
    if SLIDING:
        ctx_start = tl.maximum(seq_len - window, 0)
    # The split length is computed here from the device seq_len, so one grid serves any context length.
    per_split = (seq_len - ctx_start + num_splits - 1) // num_splits
    chunk = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = ctx_start + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    g = tl.arange(0, G_PAD)
    row_ok = g < G
    qh = kvh * G + g
    d = tl.arange(0, BLOCK_D)
    q_off = q_start.to(tl.int64) * stride_qt + qh * stride_qh
    qt = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None] & (d < D)[None, :], other=0.0)

    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, BLOCK_DV], tl.float32)
    n = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    for kstart in range(start, end, BLOCK_N):
        kpos = kstart + n
        kmask = kpos < end
        m_i, l_i, acc = attend_tile(qt, m_i, l_i, acc, kc_ptr, vc_ptr, bt_row, kvh, kpos, kmask,
                                     kmask[None, :], scale_log2, cap_log2,
                                     stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                                     D, BLOCK_D, DV, BLOCK_DV, PAGE, DOT_PREC, True, SOFTCAP)
    dv = tl.arange(0, BLOCK_DV)
    if DIRECT:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_off = q_start.to(tl.int64) * stride_ot + qh * stride_oh
        tl.store(o_ptr + o_off[:, None] + dv[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (dv < DV)[None, :])
    else:
        # Empty splits still write (m=-inf, l=0, acc=0) so the reduce never reads stale workspace.
        p_idx = (b.to(tl.int64) * num_q_heads + qh) * num_splits + split
        tl.store(pm_ptr + p_idx, m_i, mask=row_ok)
        tl.store(pl_ptr + p_idx, l_i, mask=row_ok)
        tl.store(po_ptr + p_idx[:, None] * DV + dv[None, :], acc, mask=row_ok[:, None] & (dv < DV)[None, :])


@triton.jit
def _decode_reduce_kernel(o_ptr, po_ptr, pm_ptr, pl_ptr, qs_ptr, num_q_heads, stride_ot, stride_oh,
                          DV: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_SPLITS: tl.constexpr):
    b = tl.program_id(0)
    qh = tl.program_id(1)
    q_start = tl.load(qs_ptr + b)
    if tl.load(qs_ptr + b + 1) - q_start != 1:
        return
    sp = tl.arange(0, NUM_SPLITS)
    base = (b.to(tl.int64) * num_q_heads + qh) * NUM_SPLITS
    m = tl.load(pm_ptr + base + sp)
    l = tl.load(pl_ptr + base + sp)
    m_max = tl.max(m, 0)
    w = tl.math.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))
    denom = tl.sum(w * l, 0)
    dv = tl.arange(0, BLOCK_DV)
    acc = tl.load(po_ptr + (base + sp)[:, None] * DV + dv[None, :], mask=(dv < DV)[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(o_ptr + q_start.to(tl.int64) * stride_ot + qh * stride_oh + dv, out.to(o_ptr.dtype.element_ty),
             mask=dv < DV)


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device; 132 (an H100/H200) for any other device (interpreter runs)."""
    if device.type != "cuda":
        return 132
    return num_sms(device.index if device.index is not None else torch.cuda.current_device())


def decode_num_splits_v1(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits of the context per (sequence, KV head): about eight programs per multiprocessor.

    Depends only on the batch shape, never on context lengths, so a captured decode graph stays valid
    when the same batch size is replayed with longer contexts.
    """
    want = -(-8 * device_sms(device) // max(num_seqs * num_kv_heads, 1))
    return min(MAX_SPLITS, triton.next_power_of_2(want))


def decode_v1(q, k_cache, v_cache, out, meta, scalars: tuple[float, float, int, bool, bool], prec: str,
              block_n: int, warps: int, stages: int, num_splits: int | None, poison_workspace: bool) -> None:
    """Launches the first decode kernel (and its reduce) for the query-length-1 rows of `meta`'s batch.
    scalars: (scale_log2, cap_log2, window, sliding, capped) as paged_attention_triton derives them."""
    scale_log2, cap_log2, window, sliding, capped = scalars
    t, hq, d = q.shape
    hkv, dv, page = k_cache.shape[2], v_cache.shape[-1], k_cache.shape[1]
    g, b = hq // hkv, meta.num_seqs
    block_d, block_dv = triton.next_power_of_2(d), triton.next_power_of_2(dv)
    bt, seq_lens, qs = meta.block_tables, meta.seq_lens, meta.query_start
    splits = num_splits or decode_num_splits_v1(b, hkv, q.device)
    g_pad = max(16, triton.next_power_of_2(g))  # tl.dot needs M >= 16; decode is bound by K/V bytes
    if splits > 1:
        alloc = functools.partial(torch.full, fill_value=float("nan")) if poison_workspace else torch.empty
        po = alloc((b, hq, splits, dv), dtype=torch.float32, device=q.device)
        pm = alloc((b, hq, splits), dtype=torch.float32, device=q.device)
        pl = alloc((b, hq, splits), dtype=torch.float32, device=q.device)
    else:
        po = pm = pl = out  # unused when DIRECT
    _decode_kernel[(b, hkv, splits)](
        q, k_cache, v_cache, out, po, pm, pl, bt, seq_lens, qs, scale_log2, cap_log2, window, splits, hq,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), bt.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2),
        G=g, G_PAD=g_pad, BLOCK_N=block_n, D=d, BLOCK_D=block_d, DV=dv, BLOCK_DV=block_dv,
        PAGE=page, SLIDING=sliding, DIRECT=splits == 1, DOT_PREC=prec, SOFTCAP=capped,
        num_warps=warps, num_stages=stages)
    if splits > 1:
        _decode_reduce_kernel[(b, hq)](out, po, pm, pl, qs, hq, out.stride(0), out.stride(1),
                                       DV=dv, BLOCK_DV=block_dv, NUM_SPLITS=splits, num_warps=4)
