"""Paged decode attention (query length 1 per sequence), second kernel: KV-head-packed tiles, a grid whose
fastest axis walks the KV heads of one sequence, split-K only when the batch does not fill the GPU, and a
combine pass that handles any power-of-two split count. GPU_KERNELS.md ("Decode attention, second kernel")
says why each choice was made and what is still to be measured.

Layouts as in lamina.kernels.attention: q [T, Hq, D]; caches [num_blocks, block_size, Hkv, D]. A program owns
HEADS consecutive KV heads of one sequence (one split of its context) and packs their HEADS * G query heads
into the rows of its Q tile; the key columns of a tile are (token, KV head) pairs, token-major, so one
token's HEADS heads are one contiguous HEADS * D run of the cache. A score is kept only where the row's KV
head is the column's (a block-diagonal mask); with HEADS = 1 that mask is gone and the kernel is the first
one's (triton_decode_attention_v1.py) with another grid order.

Everything per sequence (query_start, seq_lens, block tables) is read on the device and the grid and the split
count depend only on shapes, so a captured CUDA graph replays correctly with any context lengths.
"""
from __future__ import annotations

import dataclasses
import functools
import os

import torch
import triton
import triton.language as tl

from lamina.kernels.triton_attention_prep import _norm_rope_rows
from lamina.kernels.triton_attention_tile import to_cache
from lamina.kernels.triton_decode_attention_v1 import device_sms

MAX_SPLITS = 32  # the combine pass takes up to 256; 64 splits of a 32k context were slower than 32 (run 2)
FILL = 8  # split until about FILL programs per multiprocessor (8: the first kernel's measured choice)


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """One launch configuration: KV heads per program, tokens per KV head per loop step, warps, stages, and
    whether each step's block ids are loaded a step ahead (K/V then get stages - 1 buffers, not one)."""

    heads: int = 1
    block_n: int = 128
    warps: int = 8
    stages: int = 2
    ids_ahead: bool = False
    v_words: bool = False  # FP8 cache: V read as 32-bit words and widened in registers (fp8_v_words)


# (dtype class, head-dim class, regime) -> config; regime from the batch alone (decode_regime). Measured
# (scripts/attention_sweep.py, H200, benchmarks/results/2026-12-01b, first kernel = ids_ahead False): 256 x
# U[356,1280] best 218.4 us with (1, 128, 8, 2); 64 x 4k 262.7 us with (1, 64, 4, 3); 1 x 32k 41.3 us with
# (1, 128, 4, 3). "direct" keeps the measured best (with ids ahead it takes 164 instead of 80 registers:
# one CTA per SM, ptxas). "split" and "wide" take ids ahead at (64, 4 warps, 3 stages): two K/V buffers at
# the occupancy of the measured split best (156 registers, 70 KB: three CTAs per SM), where the 41.3 us
# config would need 136 KB (one CTA per SM). Unmeasured: `scripts/gpu_attention_bench.py --sweep` prints
# the rows to paste here.
DECODE_TABLE: dict[tuple[str, int, str], DecodeConfig] = {
    ("16", 128, "direct"): DecodeConfig(1, 128, 8, 2, False),
    ("16", 128, "split"): DecodeConfig(1, 64, 4, 3, True),
    ("16", 128, "wide"): DecodeConfig(1, 64, 4, 3, True),
    ("16", 256, "direct"): DecodeConfig(1, 32, 4, 2, False),  # no spills (ptxas); never run on a GPU
    ("16", 256, "split"): DecodeConfig(1, 32, 4, 2, False),
    ("16", 256, "wide"): DecodeConfig(1, 32, 4, 2, False),
    # FP8 cache (16-bit q): tokens per step doubled where that keeps bf16's shared memory and occupancy (V is
    # staged as f16 for the PV dot, so a 128-token FP8 step takes the 72 KB a 128-token bf16 step does). ptxas
    # (--fp8): split/wide 114 registers / 104 KB. H100 (2026-12-07, gpu_kv_attention.py, Hq 32 Hkv 8 D 128):
    # split (64 x 4k) 231 us, wide (1 x 32k) 38.8, as good as any swept tile; direct (256 x 800) 193.5 us with
    # this tile against 231.5 with 128 x 8 warps x 2 stages (bf16 cache: 292.6).
    ("8", 128, "direct"): DecodeConfig(1, 64, 4, 3, True),
    ("8", 128, "split"): DecodeConfig(1, 128, 8, 3, True),
    ("8", 128, "wide"): DecodeConfig(1, 128, 8, 3, True),
    ("8", 256, "direct"): DecodeConfig(1, 32, 4, 2, False),
    ("8", 256, "split"): DecodeConfig(1, 32, 4, 2, False),
    ("8", 256, "wide"): DecodeConfig(1, 32, 4, 2, False),
}


def _fp32_config(d_max: int) -> DecodeConfig:
    # exact fp32 dots run on FMA units and keep both operands in registers: small tiles (no spills)
    return DecodeConfig(1, 32, 4, 2) if d_max <= 64 else DecodeConfig(1, 32, 8, 2) if d_max <= 128 \
        else DecodeConfig(1, 16, 8, 2)


def decode_splits(num_seqs: int, programs_per_seq: int, sms: int, max_splits: int = MAX_SPLITS) -> int:
    """Splits of each context: none when the batch alone gives FILL programs per multiprocessor (no
    partials, no combine pass), else a power of two that gets there, at most max_splits. Shapes only: a
    graph captured for a batch size stays valid for every context length."""
    programs = max(num_seqs * programs_per_seq, 1)
    if programs >= FILL * sms:
        return 1
    return min(max_splits, triton.next_power_of_2(-(-FILL * sms // programs)))


def plan_splits(num_seqs: int, num_kv_heads: int, heads: int, sms: int) -> tuple[int, int, int]:
    """(heads per program, programs per sequence, splits) for a config's `heads`. A program of h KV heads
    reads h times the bytes per token, so up to h * MAX_SPLITS splits keep each split's bytes what one head's
    MAX_SPLITS-th was (at most 256, the combine pass's limit)."""
    heads = min(heads, triton.next_power_of_2(num_kv_heads))
    groups = triton.cdiv(num_kv_heads, heads)
    return heads, groups, decode_splits(num_seqs, groups, sms, min(256, MAX_SPLITS * heads))


def decode_regime(num_seqs: int, num_kv_heads: int, sms: int) -> str:
    """'direct' (no split at one KV head per program), 'split' (2-8 splits) or 'wide' (16 or more)."""
    s = decode_splits(num_seqs, num_kv_heads, sms)
    return "direct" if s == 1 else "split" if s < 16 else "wide"


def decode_config(dtype: torch.dtype, d_max: int, num_seqs: int, num_kv_heads: int, sms: int,
                  kv8: bool = False) -> DecodeConfig:
    """The table's configuration for a batch (d_max: the larger padded head dim of K and V; kv8: FP8 cache)."""
    if dtype == torch.float32:
        return _fp32_config(d_max)
    return DECODE_TABLE[("8" if kv8 else "16", 128 if d_max <= 128 else 256,
                         decode_regime(num_seqs, num_kv_heads, sms))]


def fp8_v_words(q: torch.Tensor, v_cache: torch.Tensor, cfg: DecodeConfig) -> int:
    """How an FP8 V cache is read: 0 plain (`.to(f16)`), 1 as words split by shifts (the interpreter's
    stand-in for 2: the same word layout, checked on the CPU), 2 as words widened by inline PTX
    (_load_v_words; compiled kernels). Words need whole 4-byte rows; cfg.v_words asks for them."""
    dv = v_cache.shape[-1]
    words = dv % 4 == 0 and all(st % 4 == 0 for st in v_cache.stride()[:3]) and v_cache.data_ptr() % 4 == 0
    if not (v_cache.dtype == torch.float8_e4m3fn and cfg.v_words and words and dv == triton.next_power_of_2(dv)):
        return 0
    # The packed e4m3x2 -> f16x2 convert is sm_89+; older GPUs and the interpreter split words by shifts.
    if not q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return 1
    return 2 if torch.cuda.get_device_capability(q.device) >= (8, 9) else 1


def fp8_words_wanted() -> bool:
    """LAMINA_FP8_V_WORDS=1: an FP8 cache's V read as words (no faster than the plain read on the H100, so
    opt-in; `tune={"decode_v_words": ...}` overrides per call)."""
    return os.environ.get("LAMINA_FP8_V_WORDS", "0") == "1"


@triton.jit
def _byte_e4m3(words, shift: tl.constexpr):
    return ((words >> shift) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)


@triton.jit
def _load_v_words(vc_ptr, v_off, kmask, BLOCK_N: tl.constexpr, BLOCK_DV: tl.constexpr, ASM: tl.constexpr):
    """An FP8 V tile [BLOCK_N, BLOCK_DV] read as 32-bit words (4 e4m3 each) and widened to f16 in registers by
    two packed converts per word. A plain `v.to(f16)` leaves Triton converting after the dot-operand shared
    load, and an 8-bit B operand that is not K-major comes out of shared memory one byte at a time (ptxas:
    64 ld.shared.b8 per thread per 64-token tile); words, joins and a reshape keep that step in f16."""
    w = tl.arange(0, BLOCK_DV // 4)
    words = tl.load(vc_ptr.to(tl.pointer_type(tl.int32)) + (v_off // 4)[:, None] + w[None, :],
                    mask=kmask[:, None], other=0)
    if ASM:  # byte i of a word (little-endian: element 4j + i) -> b_i; cvt puts a b16's high byte high
        b0, b1, b2, b3 = tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; .reg .b32 x, y; mov.b32 {lo, hi}, $4; cvt.rn.f16x2.e4m3x2 x, lo; "
            "cvt.rn.f16x2.e4m3x2 y, hi; mov.b32 {$0, $1}, x; mov.b32 {$2, $3}, y; }",
            "=h,=h,=h,=h,r", [words], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True,
            pack=1)
    else:  # the same split by shifts (the interpreter has no PTX)
        b0 = _byte_e4m3(words, 0)
        b1 = _byte_e4m3(words, 8)
        b2 = _byte_e4m3(words, 16)
        b3 = _byte_e4m3(words, 24)
    # join appends its axis last: [.., j, i, o] = join(join(b0, b2), join(b1, b3)) is element 4j + 2i + o
    return tl.reshape(tl.join(tl.join(b0, b2), tl.join(b1, b3)), (BLOCK_N, BLOCK_DV))


# Per-batch integers are not specialized on (value 1, divisibility by 16): a new batch size or window must
# not trigger a recompile, least of all while a CUDA graph is being captured.
@triton.jit(do_not_specialize=["window", "num_splits", "stride_bt"])
def _decode_packed_kernel(q_ptr, kc_ptr, vc_ptr, o_ptr, po_ptr, pm_ptr, pl_ptr, bt_ptr, seq_lens_ptr, qs_ptr,
                          scale_log2, cap_log2, window, num_splits, num_q_heads, num_kv_heads,
                          stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
                          stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
                          G: tl.constexpr, HEADS: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                          D: tl.constexpr, BLOCK_D: tl.constexpr, DV: tl.constexpr, BLOCK_DV: tl.constexpr,
                          PAGE: tl.constexpr, SLIDING: tl.constexpr, DIRECT: tl.constexpr,
                          DOT_PREC: tl.constexpr, SOFTCAP: tl.constexpr, IDS_AHEAD: tl.constexpr,
                          k_ptr=None, v_ptr=None, pos_ptr=None, slot_ptr=None, cs_ptr=None, qw_ptr=None,
                          kw_ptr=None, stride_nkt=0, stride_nkh=0, stride_nvt=0, stride_nvh=0, stride_cs=0,
                          eps=0.0, norm_off=0.0, PREP: tl.constexpr = False, ROT: tl.constexpr = 0,
                          HAS_NORM: tl.constexpr = False, V_WORDS: tl.constexpr = 0):
    # PREP (decode_prep: the attention prep folded in): q is the projection's raw q; each program normalizes
    # and rotates its own query rows (a few KB, redone by each split: cheaper than a launch), and the one split
    # whose range holds the new token (position seq_len - 1) normalizes and rotates that token's k of its KV
    # heads and stores it with v into the cache at the token's slot, then a CTA barrier makes the stores
    # visible to its own loads of that page. No other program reads the new token, so no grid-wide wait.
    # KV-head group fastest: the programs launched together read the same pages (one token's heads are
    # adjacent in the cache), and share the sequence's block-table row and query in L2.
    hg = tl.program_id(0)
    split = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(qs_ptr + b)
    if tl.load(qs_ptr + b + 1) - q_start != 1:  # a prefill row of a mixed batch: the prefill kernel owns it
        return
    seq_len = tl.load(seq_lens_ptr + b)
    ctx_start = 0
    if SLIDING:
        ctx_start = tl.maximum(seq_len - window, 0)
    # The split length comes from the device seq_len, so one grid serves any context length.
    per_split = (seq_len - ctx_start + num_splits - 1) // num_splits
    chunk = (per_split + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = ctx_start + split * chunk
    end = tl.minimum(start + chunk, seq_len)

    kvh0 = hg * HEADS
    r = tl.arange(0, M_PAD)  # Q row r: query head kvh0 * G + r, of the group's KV head r // G
    qh = kvh0 * G + r
    row_ok = (r < HEADS * G) & (qh < num_q_heads)
    d = tl.arange(0, BLOCK_D)
    q_off = q_start.to(tl.int64) * stride_qt + qh * stride_qh
    if PREP:
        cs_row = cs_ptr + tl.load(pos_ptr + q_start).to(tl.int64) * stride_cs
        qt = _norm_rope_rows(q_ptr, q_off, row_ok, qw_ptr, cs_row, eps, norm_off, D, ROT, BLOCK_D,
                             HAS_NORM).to(q_ptr.dtype.element_ty)  # rounded as the prep kernel writes q
        # (not `slot`: the key loop below names its [BLOCK_N * HEADS] offsets so, and Triton's compiler sees one
        # variable changing type inside a loop; the interpreter does not, only sm_90 compiles failed)
        new_slot = tl.load(slot_ptr + q_start).to(tl.int64)
        if (new_slot >= 0) & (start <= seq_len - 1) & (seq_len - 1 < end):
            hk = kvh0 + tl.arange(0, HEADS)
            hk_ok = hk < num_kv_heads
            hk64 = hk.to(tl.int64)
            kn = _norm_rope_rows(k_ptr, q_start.to(tl.int64) * stride_nkt + hk64 * stride_nkh, hk_ok, kw_ptr,
                                 cs_row, eps, norm_off, D, ROT, BLOCK_D, HAS_NORM)
            kn = to_cache(kn.to(k_ptr.dtype.element_ty), kc_ptr)
            page, poff = new_slot // PAGE, new_slot % PAGE
            tl.store(kc_ptr + page * stride_kb + poff * stride_kt + hk64[:, None] * stride_kh + d[None, :], kn,
                     mask=hk_ok[:, None] & (d < D)[None, :])
            dvn = tl.arange(0, BLOCK_DV)
            mv = hk_ok[:, None] & (dvn < DV)[None, :]
            vn = tl.load(v_ptr + q_start.to(tl.int64) * stride_nvt + hk64[:, None] * stride_nvh + dvn[None, :],
                         mask=mv)
            tl.store(vc_ptr + page * stride_vb + poff * stride_vt + hk64[:, None] * stride_vh + dvn[None, :],
                     to_cache(vn, vc_ptr), mask=mv)
        tl.debug_barrier()  # the new token's K/V stores are visible to this CTA's loads of that page
    else:
        qt = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=row_ok[:, None] & (d < D)[None, :], other=0.0)

    KV8: tl.constexpr = kc_ptr.dtype.element_ty == tl.float8e4nv
    if KV8:
        # FP8 cache: both dots run in f16 (e4m3 -> f16 is one packed cvt per two elements and exact; -> bf16
        # costs two more converts per element), and the softmax scale (with k_scale) is folded into q once.
        qt = (qt.to(tl.float32) * scale_log2).to(tl.float16)
    c = tl.arange(0, BLOCK_N * HEADS)  # key column c: token c // HEADS of the step, KV head kvh0 + c % HEADS
    ctok = c // HEADS
    chead = kvh0 + c % HEADS
    k_head = chead.to(tl.int64) * stride_kh
    v_head = chead.to(tl.int64) * stride_vh
    dv = tl.arange(0, BLOCK_DV)
    m_i = tl.full([M_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([M_PAD], tl.float32)
    acc = tl.zeros([M_PAD, BLOCK_DV], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * stride_bt
    # IDS_AHEAD: the block ids of a step are loaded one step ahead (a loop-carried value). K/V addresses that
    # depend on a load in their own iteration cost Triton's pipeliner a stage: K and V stay single-buffered
    # up to num_stages 4 (ttgir, Triton 3.6); with the ids in hand they get num_stages - 1 buffers.
    if IDS_AHEAD:
        nxt = start + ctok
        blk_next = tl.load(bt_row + nxt // PAGE, mask=nxt < end, other=0)
    else:
        blk_next = tl.zeros([BLOCK_N * HEADS], tl.int32)  # unused
    for kstart in range(start, end, BLOCK_N):
        kpos = kstart + ctok
        if IDS_AHEAD:
            blk = blk_next.to(tl.int64)
            nxt = kpos + BLOCK_N
            blk_next = tl.load(bt_row + nxt // PAGE, mask=nxt < end, other=0)
        else:
            blk = tl.load(bt_row + kpos // PAGE, mask=kpos < end, other=0).to(tl.int64)
        # Keys past the context are masked on every load: unused cache slots may hold anything, NaN included.
        kmask = kpos < end
        if HEADS > 1:  # a packed group can run past the last KV head (Hkv not a multiple of HEADS)
            kmask = kmask & (chead < num_kv_heads)
        slot = (kpos % PAGE).to(tl.int64)
        k_off = blk * stride_kb + slot * stride_kt + k_head
        k = tl.load(kc_ptr + k_off[None, :] + d[:, None], mask=kmask[None, :] & (d < D)[:, None], other=0.0)
        s = tl.dot(qt, k.to(qt.dtype), input_precision=DOT_PREC)
        if not KV8:
            s = s * scale_log2
        if SOFTCAP:
            # tanh(x) = 2 / (1 + exp(-2x)) - 1: saturates to +-1 without inf/inf for large |x|.
            s = (2.0 / (1.0 + tl.exp(-2.0 * s)) - 1.0) * cap_log2
        allowed = kmask[None, :]
        if HEADS > 1:  # a row sees only its own KV head's columns
            allowed = allowed & ((r // G)[:, None] == (c % HEADS)[None, :])
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row can see no key yet (padding rows, sliding window): keep exp2 away from (-inf) - (-inf).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_safe[:, None])
        alpha = tl.math.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v_off = blk * stride_vb + slot * stride_vt + v_head
        if KV8 and V_WORDS:  # (DV == BLOCK_DV, DV % 4 == 0: checked by the launcher)
            v = _load_v_words(vc_ptr, v_off, kmask, BLOCK_N * HEADS, BLOCK_DV, V_WORDS == 2)
        else:
            v = tl.load(vc_ptr + v_off[:, None] + dv[None, :], mask=kmask[:, None] & (dv < DV)[None, :], other=0.0)
            v = v.to(qt.dtype)  # an FP8 cache is widened in registers (a no-op for a cache in q's dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PREC)
        m_i = m_new
    if DIRECT:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_off = q_start.to(tl.int64) * stride_ot + qh * stride_oh
        tl.store(o_ptr + o_off[:, None] + dv[None, :], out.to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (dv < DV)[None, :])
    else:
        # Empty splits still write (m=-inf, l=0, acc=0) so the combine never reads stale workspace.
        p_idx = (b.to(tl.int64) * num_q_heads + qh) * num_splits + split
        tl.store(pm_ptr + p_idx, m_i, mask=row_ok)
        tl.store(pl_ptr + p_idx, l_i, mask=row_ok)
        tl.store(po_ptr + p_idx[:, None] * DV + dv[None, :], acc, mask=row_ok[:, None] & (dv < DV)[None, :])


@triton.jit
def _decode_combine_kernel(o_ptr, po_ptr, pm_ptr, pl_ptr, qs_ptr, num_q_heads, stride_ot, stride_oh,
                           DV: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_SPLITS: tl.constexpr,
                           BLOCK_S: tl.constexpr):
    """out[b, qh] from the splits' (max, sum, unnormalised acc); the [split, DV] partials are read BLOCK_S
    splits at a time so many splits do not spill."""
    b = tl.program_id(0)
    qh = tl.program_id(1)
    q_start = tl.load(qs_ptr + b)
    if tl.load(qs_ptr + b + 1) - q_start != 1:
        return
    base = (b.to(tl.int64) * num_q_heads + qh) * NUM_SPLITS
    sp = tl.arange(0, NUM_SPLITS)
    m = tl.load(pm_ptr + base + sp)
    m_max = tl.max(m, 0)
    m_ref = tl.where(m_max == float("-inf"), 0.0, m_max)
    denom = tl.sum(tl.math.exp2(m - m_ref) * tl.load(pl_ptr + base + sp), 0)
    dv = tl.arange(0, BLOCK_DV)
    cs = tl.arange(0, BLOCK_S)
    acc = tl.zeros([BLOCK_DV], tl.float32)
    for s0 in tl.static_range(0, NUM_SPLITS, BLOCK_S):
        w = tl.math.exp2(tl.load(pm_ptr + base + s0 + cs) - m_ref)
        part = tl.load(po_ptr + (base + s0 + cs)[:, None] * DV + dv[None, :], mask=(dv < DV)[None, :], other=0.0)
        acc += tl.sum(part * w[:, None], 0)
    out = acc / tl.where(denom == 0.0, 1.0, denom)
    tl.store(o_ptr + q_start.to(tl.int64) * stride_ot + qh * stride_oh + dv, out.to(o_ptr.dtype.element_ty),
             mask=dv < DV)


def decode_v2(q, k_cache, v_cache, out, meta, scalars: tuple[float, float, int, bool, bool], prec: str,
              tune: dict | None = None, num_splits: int | None = None, poison_workspace: bool = False,
              prep: tuple | None = None) -> None:
    """Launches the packed decode kernel (and, when split, the combine pass) for the query-length-1 rows of
    meta's batch. scalars: (scale_log2, cap_log2, window, sliding, capped) as paged_attention_triton derives
    them; tune: DecodeConfig fields overriding the table's (sweeps and tests); num_splits: forced split count
    (a power of two up to 256). prep: (k, v, positions, cos_sin_cache, slot_mapping, q_weight, k_weight, eps,
    offset): q is the raw projection and the kernel does the q/k norm + RoPE + KV store itself (a decode-only
    batch; see the kernel's PREP)."""
    scale_log2, cap_log2, window, sliding, capped = scalars
    t, hq, d = q.shape
    hkv, dv, page = k_cache.shape[2], v_cache.shape[-1], k_cache.shape[1]
    g, b = hq // hkv, meta.num_seqs
    block_d, block_dv = triton.next_power_of_2(d), triton.next_power_of_2(dv)
    sms = device_sms(q.device)
    # An FP8 cache takes the table's FP8 rows; V as words only under LAMINA_FP8_V_WORDS=1 (no gain: fp8_words_wanted)
    kv8 = k_cache.dtype == torch.float8_e4m3fn
    cfg = dataclasses.replace(decode_config(q.dtype, max(block_d, block_dv), b, hkv, sms, kv8),
                              **{"v_words": kv8 and fp8_words_wanted(), **(tune or {})})
    if tune and "heads" in tune and "block_n" not in tune:
        # The table's tiles are for one KV head per program, and a program stages heads x block_n rows: keep
        # its rows (FP8's 128-token rows x 8 heads x 3 stages asked for 428 KB of shared memory on an H100).
        cfg = dataclasses.replace(cfg, block_n=max(16, cfg.block_n // max(cfg.heads, 1)))
    heads, groups, splits = plan_splits(b, hkv, cfg.heads, sms)
    splits = num_splits or splits
    assert splits & (splits - 1) == 0 and splits <= 256, splits
    # tl.dot needs M >= 16 and a reduction of >= 16 key columns; decode is bound by K/V bytes, not MMA work.
    m_pad = max(16, triton.next_power_of_2(heads * g))
    block_n = max(cfg.block_n, triton.cdiv(16, heads))
    bt, qs = meta.block_tables, meta.query_start
    if splits > 1:
        alloc = functools.partial(torch.full, fill_value=float("nan")) if poison_workspace else torch.empty
        po = alloc((b, hq, splits, dv), dtype=torch.float32, device=q.device)
        pm = alloc((b, hq, splits), dtype=torch.float32, device=q.device)
        pl = alloc((b, hq, splits), dtype=torch.float32, device=q.device)
    else:
        po = pm = pl = out  # unused when DIRECT
    _decode_packed_kernel[(groups, splits, b)](
        q, k_cache, v_cache, out, po, pm, pl, bt, meta.seq_lens, qs, scale_log2, cap_log2, window, splits, hq, hkv,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), bt.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2),
        G=g, HEADS=heads, M_PAD=m_pad, BLOCK_N=block_n, D=d, BLOCK_D=block_d, DV=dv, BLOCK_DV=block_dv, PAGE=page,
        SLIDING=sliding, DIRECT=splits == 1, DOT_PREC=prec, SOFTCAP=capped, IDS_AHEAD=cfg.ids_ahead,
        V_WORDS=fp8_v_words(q, v_cache, cfg), num_warps=cfg.warps,
        num_stages=cfg.stages, **(_prep_args(prep) if prep is not None else {}))
    if splits > 1:
        _decode_combine_kernel[(b, hq)](out, po, pm, pl, qs, hq, out.stride(0), out.stride(1), DV=dv,
                                        BLOCK_DV=block_dv, NUM_SPLITS=splits, BLOCK_S=min(splits, 32), num_warps=4)


def _prep_args(prep: tuple) -> dict:
    """The PREP launch's extra arguments (see decode_v2's prep)."""
    k, v, positions, cos_sin, slots, qw, kw, eps, offset = prep
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and cos_sin.stride(-1) == 1
    rot = cos_sin.shape[-1]
    has_norm = qw is not None
    return dict(k_ptr=k, v_ptr=v, pos_ptr=positions, slot_ptr=slots, cs_ptr=cos_sin,
                qw_ptr=qw if has_norm else k, kw_ptr=kw if has_norm else k, stride_nkt=k.stride(0),
                stride_nkh=k.stride(1), stride_nvt=v.stride(0), stride_nvh=v.stride(1), stride_cs=cos_sin.stride(0),
                eps=float(eps), norm_off=float(offset), PREP=True, ROT=rot, HAS_NORM=has_norm)
