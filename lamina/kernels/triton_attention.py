"""Triton paged attention: KV store, split-K decode (flash-decoding) and varlen paged prefill.

Layouts follow lamina.kernels.attention: q [T, Hq, D]; caches [num_blocks, block_size, Hkv, D]; a sequence's
queries are the last query_len positions of its seq_lens[b] tokens of context. Every kernel reads the
per-sequence numbers (query_start, seq_lens, block tables) from device tensors, and grids depend only on
shapes and host-side counts, so decode launches can be captured in a CUDA graph and replayed with other
context lengths.

Both attention kernels are GQA-aware: one program owns one KV head and packs all G = Hq/Hkv query heads
that share it into the rows of its Q tile, so each K/V tile is read once for the whole group.
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl

from lamina.kernels.attention_launch import launch_of

_LOG2E = 1.4426950408889634
MAX_SPLITS = 32  # 64 splits of a 32k context were slower than 32 (55.7 vs 52.5 us, H200, GPU_KERNELS.md)


@triton.jit
def to_cache(x, cache_ptr):
    """x in the cache's element type; an FP8 cache (e4m3, scale 1.0) saturates at +-448 instead of NaN."""
    if cache_ptr.dtype.element_ty == tl.float8e4nv:
        x = tl.clamp(x.to(tl.float32), -448.0, 448.0)
    return x.to(cache_ptr.dtype.element_ty)


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, num_heads,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kct, stride_kch, stride_vcb, stride_vct, stride_vch,
                     D: tl.constexpr, DV: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_DV: tl.constexpr, PAGE: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padding token
        return
    blk = slot // PAGE
    off = slot % PAGE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    m = (h < num_heads)[:, None] & (d < D)[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=m)
    tl.store(kc_ptr + blk * stride_kcb + off * stride_kct + h[:, None] * stride_kch + d[None, :],
             to_cache(k, kc_ptr), mask=m)
    dv = tl.arange(0, BLOCK_DV)
    mv = (h < num_heads)[:, None] & (dv < DV)[None, :]
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + dv[None, :], mask=mv)
    tl.store(vc_ptr + blk * stride_vcb + off * stride_vct + h[:, None] * stride_vch + dv[None, :],
             to_cache(v, vc_ptr), mask=mv)


@triton.jit
def _attend_tile(qt, m_i, l_i, acc, kc_ptr, vc_ptr, bt_row_ptr, kvh, kpos, kmask, allowed, scale_log2,
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
        m_i, l_i, acc = _attend_tile(qt, m_i, l_i, acc, kc_ptr, vc_ptr, bt_row, kvh, kpos, kmask,
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


@triton.jit(do_not_specialize=["num_seqs", "window", "stride_bt"])
def _prefill_kernel(q_ptr, kc_ptr, vc_ptr, o_ptr, bt_ptr, seq_lens_ptr, qs_ptr, nseq_ptr, num_seqs, scale_log2,
                    cap_log2, window, stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                    stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                    G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr,
                    BLOCK_DV: tl.constexpr, PAGE: tl.constexpr, SLIDING: tl.constexpr,
                    SKIP_DECODE: tl.constexpr, HAS_NSEQ: tl.constexpr, DOT_PREC: tl.constexpr,
                    SOFTCAP: tl.constexpr = False):
    # Last tiles first: they see the most keys, and starting them early shortens the tail.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    kvh = tl.program_id(1)
    # Sequence b's query tiles are numbered from query_start[b] // BLOCK_Q + b: monotone in b and at most
    # T // BLOCK_Q + B tiles in all, so the grid needs only host shapes; a binary search finds b.
    hi = num_seqs
    if HAS_NSEQ:
        # A graph's batch is padded with empty sequences: only the first nseq are in use, and the tiles
        # numbered past theirs (the first programs launched) exit after two loads instead of a search.
        hi = tl.load(nseq_ptr)
        if tile >= tl.load(qs_ptr + hi) // BLOCK_Q + hi:
            return
    lo: tl.int32 = 0
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qs_ptr + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    b = lo - 1
    q_start = tl.load(qs_ptr + b)
    qlen = tl.load(qs_ptr + b + 1) - q_start
    qb = tile - (q_start // BLOCK_Q + b)
    if qb * BLOCK_Q >= qlen:
        return
    if SKIP_DECODE:
        if qlen == 1:
            return
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - qlen
    pad = seq_len == 0  # a padding sequence (graph replay): zeros out, no key read

    r = tl.arange(0, BLOCK_M)
    tok = qb * BLOCK_Q + r // G_PAD
    qh = kvh * G + r % G_PAD
    row_ok = (tok < qlen) & (r % G_PAD < G)
    q_pos = prefix + tok
    d = tl.arange(0, BLOCK_D)
    q_off = (q_start + tok).to(tl.int64) * stride_qt + qh * stride_qh
    qt = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None] & (d < D)[None, :], other=0.0)

    kv_end = tl.where(pad, 0, prefix + tl.minimum(qlen, (qb + 1) * BLOCK_Q))
    kv_start = 0
    if SLIDING:
        kv_start = tl.where(pad, 0, tl.maximum(prefix + qb * BLOCK_Q - window + 1, 0))
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    n = tl.arange(0, BLOCK_N)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    # Whole key tiles before the tile's first query are visible to every row: no causal mask there
    # (nor any mask without a sliding window), which spares the elementwise work on most tiles.
    full_end = tl.where(pad, 0, kv_start + (prefix + qb * BLOCK_Q - kv_start) // BLOCK_N * BLOCK_N)
    for kstart in range(kv_start, full_end, BLOCK_N):
        kpos = kstart + n
        kmask = kpos < kv_end
        allowed = kmask[None, :]
        if SLIDING:
            allowed = kpos[None, :] > q_pos[:, None] - window
        m_i, l_i, acc = _attend_tile(qt, m_i, l_i, acc, kc_ptr, vc_ptr, bt_row, kvh, kpos, kmask, allowed,
                                     scale_log2, cap_log2, stride_kb, stride_kt, stride_kh, stride_vb,
                                     stride_vt, stride_vh, D, BLOCK_D, DV, BLOCK_DV, PAGE, DOT_PREC, SLIDING,
                                     SOFTCAP)
    for kstart in range(full_end, kv_end, BLOCK_N):
        kpos = kstart + n
        kmask = kpos < kv_end
        allowed = kmask[None, :] & (kpos[None, :] <= q_pos[:, None])
        if SLIDING:
            allowed = allowed & (kpos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = _attend_tile(qt, m_i, l_i, acc, kc_ptr, vc_ptr, bt_row, kvh, kpos, kmask, allowed,
                                     scale_log2, cap_log2, stride_kb, stride_kt, stride_kh, stride_vb,
                                     stride_vt, stride_vh, D, BLOCK_D, DV, BLOCK_DV, PAGE, DOT_PREC, True,
                                     SOFTCAP)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    dv = tl.arange(0, BLOCK_DV)
    o_off = (q_start + tok).to(tl.int64) * stride_ot + qh * stride_oh
    tl.store(o_ptr + o_off[:, None] + dv[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (dv < DV)[None, :])


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]. Slots < 0 are skipped (padding)."""
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    t, h, d = k.shape
    dv = v.shape[-1]
    if t == 0:
        return
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slot_mapping, h, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), D=d, DV=dv, BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d),
        BLOCK_DV=triton.next_power_of_2(dv), PAGE=k_cache.shape[1], num_warps=4 if h * d >= 2048 else 2)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_num_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """Splits of the context per (sequence, KV head): about eight programs per multiprocessor.

    Depends only on the batch shape, never on context lengths, so a captured decode graph stays valid
    when the same batch size is replayed with longer contexts.
    """
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device()) \
        if device.type == "cuda" else 132
    want = -(-8 * sms // max(num_seqs * num_kv_heads, 1))
    return min(MAX_SPLITS, triton.next_power_of_2(want))


@dataclasses.dataclass(frozen=True)
class Tiles:
    prefill_block_m: int
    prefill_block_n: int
    prefill_warps: int
    decode_block_n: int
    decode_warps: int
    prefill_stages: int = 2
    decode_stages: int = 2


def _tiles(dtype: torch.dtype, d_max: int) -> Tiles:
    """Tile sizes that do not spill (ptxas -v for sm_90, Triton 3.6, with the runtime's 16-alignment
    specialization); GPU_KERNELS.md has the sweeps behind the 16-bit defaults."""
    if dtype == torch.float32:  # exact fp32 dots run on FMA units and keep both operands in registers
        return Tiles(64, 32, 8, 32, 4) if d_max <= 64 else Tiles(32, 16, 4, 32, 8) if d_max <= 128 \
            else Tiles(16, 16, 4, 16, 8)
    # Decode 8 warps: 218 vs 248 us on 256 sequences of U[356, 1280] keys (Qwen3-0.6B heads, H200, 3.95 TB/s
    # of K/V read), 268 vs 269 us on 64 x 4k, 43 vs 45 us on 1 x 32k (scripts/attention_sweep.py).
    return Tiles(64, 64, 4, 128, 8) if d_max <= 128 else Tiles(64, 32, 8, 32, 4)


def _dot_prec(dtype: torch.dtype) -> str:
    # fp32 tensors get exact fp32 dots; Triton's default for them would be tf32 (~3e-4 relative error).
    return "ieee" if dtype == torch.float32 else "tf32"


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
                           scale: float, sliding_window: int | None = None, *, softcap: float | None = None,
                           out: torch.Tensor | None = None,
                           num_splits: int | None = None, tune: dict[str, int] | None = None,
                           poison_workspace: bool = False) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, Dv]. The keyword-only arguments exist for tests and tuning sweeps
    (`tune` overrides fields of Tiles).

    Which kernels run comes from `launch_of(meta)`: the host fields of an eager step, or the fixed plan a
    CUDA-graph runner's metadata carries (then the grids depend only on q's shape and meta.num_seqs, and
    rows are told apart on the device; see attention_launch.py). Sequences with seq_len 0 are padding:
    both kernels write zeros for their rows and read no K/V. softcap: tanh soft-capping of the scores
    (None or 0: off)."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    t, hq, d = q.shape
    hkv, dv, page = k_cache.shape[2], v_cache.shape[-1], k_cache.shape[1]
    g = hq // hkv
    if out is None:
        out = torch.empty(t, hq, dv, dtype=q.dtype, device=q.device)
    b = meta.num_seqs
    if t == 0 or b == 0:
        return out
    launch = launch_of(meta)
    have_decode, have_prefill = launch.decode, launch.prefill
    sliding = sliding_window is not None and sliding_window > 0
    window = int(sliding_window) if sliding else 0
    scale_log2 = float(scale) * _LOG2E
    capped = bool(softcap)
    cap_log2 = float(softcap) * _LOG2E if capped else 0.0
    if capped:
        scale_log2 = float(scale) / float(softcap)  # the tile applies tanh, then cap * log2(e)
    block_d, block_dv = triton.next_power_of_2(d), triton.next_power_of_2(dv)
    bt, seq_lens, qs = meta.block_tables, meta.seq_lens, meta.query_start
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                     v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
    prec = _dot_prec(q.dtype)
    tiles = dataclasses.replace(_tiles(q.dtype, max(block_d, block_dv)), **(tune or {}))

    if have_decode:
        splits = num_splits or decode_num_splits(b, hkv, q.device)
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
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), bt.stride(0), *cache_strides,
            G=g, G_PAD=g_pad, BLOCK_N=tiles.decode_block_n, D=d, BLOCK_D=block_d, DV=dv, BLOCK_DV=block_dv,
            PAGE=page, SLIDING=sliding, DIRECT=splits == 1, DOT_PREC=prec, SOFTCAP=capped,
            num_warps=tiles.decode_warps,
            num_stages=tiles.decode_stages)
        if splits > 1:
            _decode_reduce_kernel[(b, hq)](out, po, pm, pl, qs, hq, out.stride(0), out.stride(1),
                                           DV=dv, BLOCK_DV=block_dv, NUM_SPLITS=splits, num_warps=4)
    if have_prefill:
        g_pad = triton.next_power_of_2(g)
        block_m = max(tiles.prefill_block_m, g_pad)
        block_q = block_m // g_pad
        grid = (t // block_q + b, hkv)
        nseq = launch.num_seqs
        _prefill_kernel[grid](
            q, k_cache, v_cache, out, bt, seq_lens, qs, qs if nseq is None else nseq, b, scale_log2, cap_log2,
            window,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), bt.stride(0), *cache_strides,
            G=g, G_PAD=g_pad, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=tiles.prefill_block_n, D=d, BLOCK_D=block_d,
            DV=dv, BLOCK_DV=block_dv, PAGE=page, SLIDING=sliding, SKIP_DECODE=have_decode, HAS_NSEQ=nseq is not None,
            DOT_PREC=prec, SOFTCAP=capped,
            num_warps=tiles.prefill_warps, num_stages=tiles.prefill_stages)
    return out
