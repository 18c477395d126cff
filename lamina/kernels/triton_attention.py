"""Triton paged attention: KV store, varlen paged prefill, and the entry point that also launches decode.

Layouts follow lamina.kernels.attention: q [T, Hq, D]; caches [num_blocks, block_size, Hkv, D]; a sequence's
queries are the last query_len positions of its seq_lens[b] tokens of context. Every kernel reads the
per-sequence numbers (query_start, seq_lens, block tables) from device tensors, and grids depend only on
shapes and host-side counts, so decode launches can be captured in a CUDA graph and replayed with other
context lengths.

The prefill kernel is GQA-aware: one program owns one KV head and packs all G = Hq/Hkv query heads that share
it into the rows of its Q tile, so each K/V tile is read once for the whole group. Decode (query length 1)
runs in triton_decode_attention.py (LAMINA_DECODE_ATTN=old: the first kernel, triton_decode_attention_v1.py).
"""
from __future__ import annotations

import dataclasses
import os

import torch
import triton
import triton.language as tl

from lamina.kernels import triton_decode_attention
from lamina.kernels.attention_launch import launch_of
from lamina.kernels.triton_attention_tile import LOG2E, attend_tile, to_cache
from lamina.kernels.triton_decode_attention_v1 import decode_v1

__all__ = ["decode_num_splits", "paged_attention_triton", "store_kv_triton", "to_cache"]


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
        m_i, l_i, acc = attend_tile(qt, m_i, l_i, acc, kc_ptr, vc_ptr, bt_row, kvh, kpos, kmask, allowed,
                                     scale_log2, cap_log2, stride_kb, stride_kt, stride_kh, stride_vb,
                                     stride_vt, stride_vh, D, BLOCK_D, DV, BLOCK_DV, PAGE, DOT_PREC, SLIDING,
                                     SOFTCAP)
    for kstart in range(full_end, kv_end, BLOCK_N):
        kpos = kstart + n
        kmask = kpos < kv_end
        allowed = kmask[None, :] & (kpos[None, :] <= q_pos[:, None])
        if SLIDING:
            allowed = allowed & (kpos[None, :] > q_pos[:, None] - window)
        m_i, l_i, acc = attend_tile(qt, m_i, l_i, acc, kc_ptr, vc_ptr, bt_row, kvh, kpos, kmask, allowed,
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


def decode_num_splits(num_seqs: int, num_kv_heads: int, device: torch.device) -> int:
    """The split count the default decode kernel picks for a batch (shapes only, never context lengths)."""
    d = triton_decode_attention
    sms = d.device_sms(device)
    heads = d.decode_config(torch.bfloat16, 128, num_seqs, num_kv_heads, sms).heads
    return d.plan_splits(num_seqs, num_kv_heads, heads, sms)[2]


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
                           poison_workspace: bool = False, decode_variant: str | None = None,
                           prep: tuple | None = None) -> torch.Tensor:
    """q: [T, Hq, D] -> [T, Hq, Dv]. The keyword-only arguments exist for tests and tuning sweeps
    (`tune` overrides fields of Tiles; for the new decode kernel its `decode_*` keys override DecodeConfig
    fields: decode_heads, decode_block_n, decode_warps, decode_stages). decode_variant: "old" or "new"
    (default: the LAMINA_DECODE_ATTN environment variable, else "new").

    Which kernels run comes from `launch_of(meta)`: the host fields of an eager step, or the fixed plan a
    CUDA-graph runner's metadata carries (then the grids depend only on q's shape and meta.num_seqs, and
    rows are told apart on the device; see attention_launch.py). Sequences with seq_len 0 are padding:
    both kernels write zeros for their rows and read no K/V. softcap: tanh soft-capping of the scores
    (None or 0: off). prep: the q/k norm + RoPE + KV store folded into the decode kernel (decode_v2's prep;
    q is then the raw projection): a decode-only batch and the new kernel only."""
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
    assert prep is None or (have_decode and not have_prefill), "the folded prep is for decode-only batches"
    sliding = sliding_window is not None and sliding_window > 0
    window = int(sliding_window) if sliding else 0
    scale_log2 = float(scale) * LOG2E
    capped = bool(softcap)
    cap_log2 = float(softcap) * LOG2E if capped else 0.0
    if capped:
        scale_log2 = float(scale) / float(softcap)  # the tile applies tanh, then cap * log2(e)
    block_d, block_dv = triton.next_power_of_2(d), triton.next_power_of_2(dv)
    bt, seq_lens, qs = meta.block_tables, meta.seq_lens, meta.query_start
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                     v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))
    prec = _dot_prec(q.dtype)
    tune = tune or {}
    decode_only = ("decode_heads", "decode_ids_ahead", "decode_v_words")  # DecodeConfig fields Tiles lacks
    tiles = dataclasses.replace(_tiles(q.dtype, max(block_d, block_dv)),
                                **{k: v for k, v in tune.items() if k not in decode_only})

    if have_decode:
        scalars = (scale_log2, cap_log2, window, sliding, capped)
        variant = decode_variant or os.environ.get("LAMINA_DECODE_ATTN", "new")
        if variant not in ("old", "new"):
            raise ValueError(f"decode variant must be 'old' or 'new', got {variant!r}")
        if variant == "old":
            assert prep is None, "the first decode kernel has no folded prep"
            decode_v1(q, k_cache, v_cache, out, meta, scalars, prec, tiles.decode_block_n, tiles.decode_warps,
                      tiles.decode_stages, num_splits, poison_workspace)
        else:
            dtune = {k[len("decode_"):]: v for k, v in tune.items() if k.startswith("decode_")}
            triton_decode_attention.decode_v2(q, k_cache, v_cache, out, meta, scalars, prec, dtune, num_splits,
                                              poison_workspace, prep)
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
