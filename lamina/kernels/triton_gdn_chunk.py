"""Triton chunked gated delta rule (Gated DeltaNet prefill), varlen over a flat batch, with a state pool.

Semantics = gated_delta.gated_delta_rule_varlen_ref: per sequence, the UT-transform chunked rule over 64-token
chunks that start at the sequence's own first token (the last chunk is partial, padded with k = v = beta = g = 0;
a length-1 sequence is one chunk of one token, which is exactly the recurrent step). Three kernels, fp32
accumulation throughout:

1. `_prep_kernel`, grid (chunks, Hv), parallel: gc = cumsum(g) in the chunk; A = strictly-lower(beta_i k_i.k_j
   exp(gc_i - gc_j)) [64, 64] from one k k^T dot; T = (I + A)^-1 as (I + M)^-1 Tb: Tb inverts A's four 16x16
   diagonal blocks by forward substitution in fp32 registers (all four blocks per step, 14 steps, one reduction
   each), M = Tb L (L = A's strictly block-lower part) is block-nilpotent, so T = Tb - M(Tb - M(Tb - M Tb)): four
   [64, 64] dots, "tf32" for 16-bit inputs (M X has exact-zero diagonal blocks, so T's diagonal blocks stay fp32;
   tf32 there did not move the bf16 end-to-end error in an interpreter emulation with truncated tf32 operands,
   2.78e-3 either way, 3.7e-3 either way with near-identical keys and beta near 1), "ieee" for fp32.
   Then w = T diag(beta exp(gc)) k and u = T diag(beta) v. Writes w [T, Hv, dk], u [T, Hv, dv] (input dtype),
   gc and ek = exp(gc_last - gc) [Hv, T] (fp32).
2. `_state_kernel`, grid (seqs, Hv, dv / BV), the only sequential part: h [dk, BV] fp32 in registers, from
   ssm_states[slot] when has_initial_state (the slot is never read otherwise) or zeros; per chunk: save h (input
   dtype) for kernel 3, v_new = u - w h (saved, input dtype), h = exp(gc_last) h + k^T (ek * v_new). Writes the
   final h to ssm_states[slot] (nothing when the pool is None). Loads are cp.async-pipelined (num_stages=2).
3. `_output_kernel`, grid (chunks, Hv, dv / BV), parallel:
   o = diag(exp(gc)) q h_chunk + causal(q k^T exp(gc_i - gc_j)) v_new.

The L2 norms of q and k (x * rsqrt(sum x^2 + 1e-6)) and q's dk^-0.5 are per-token scales, so they are folded into
row/column factors of the fp32 results (A, ek, w's and P's factors): raw q/k tiles from the input views feed the
dots, and nothing is normalised into a copy. Dots take input-dtype operands (bf16/fp16) with fp32 accumulation,
exact fp32 ("ieee") for fp32 inputs; operands rounded to the input dtype: w, u, v_new, the h snapshots, and
T / P / h before their dots (fla rounds at the same places). The chunk table (chunk -> start, end; seq -> first
chunk) is built on the device from query_start (triton_gdn_chunk_table.py), its size and every grid from the
shapes T and B only, so mixed prefill+decode steps are CUDA-graph captured (no host list, no sync).
Scratch: w, u, v_new [T, Hv, d] and h snapshots [chunks, Hv, dk, dv] in the input dtype, gc/ek [Hv, T]
fp32 (a 16k-token Qwen3-Next prompt: 268 MB of snapshots, 134 MB each for w, u, v_new).

Two numbers, 16k tokens, Hk=16, Hv=32, dk=dv=128, bf16 (not measured yet): about 1.9 GB through HBM (prep 0.47,
state 0.74, output 0.67) = ~450 us at 4.2 TB/s; ~110 GFLOP of dots = ~0.16 ms at 698 TFLOP/s, so bytes set
the floor, and the state pass (256 dependent steps per program, 128 programs at BV=32) may sit above its share.

Tiles (`_tiles`; ptxas -v for sm_90, Triton 3.6, compiled on the CPU box with the runtime's 16-divisibility
attrs; q/k/v as views of a fused projection buffer), 16-bit, dk=dv=128 (fp16 the same or fewer):
  prep   4 warps, dk pieces of 32             168 regs, 0 spills, 48 KB smem, wgmma  (3 CTAs/SM by registers)
  state  BV=32, 4 warps, 2 stages             133 regs, 0 spills, 80 KB smem, wgmma, cp.async  (fewer programs)
  state  BV=64, 8 warps, 2 stages             189 regs, 0 spills, 104 KB smem, wgmma  (>= 264 programs at BV=64)
  output BV=64, 4 warps, dk pieces of 64      154 regs, 0 spills, 24 KB smem, wgmma
dk=dv=64: 159 / 94 / 128 / 138 regs; dk=dv=256: 158 / 250 / 244 / 200 regs, none spill. Sweep candidates: state
BV=16 (4 warps, 91 regs) for a single long prompt, output BV=128 with 8 warps (185 regs). fp32 (exact FMA dots
keep whole operands in registers) spills at dk=128 in prep and state in every configuration tried; the least,
chosen here: prep 8 warps / pieces of 16 (1856 B stack), state BV=8 8 warps (192 B); output BV=8 8 warps does
not spill (162 regs). fp32 is a correctness path, not a fast one.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from lamina.kernels.triton_gdn_chunk_table import chunk_table_device

BT = 64  # chunk size (the reference's CHUNK_SIZE); the kernels hard-code 64-row tiles


@dataclasses.dataclass(frozen=True)
class Tiles:
    prep_warps: int
    prep_bk: int  # dk / dv piece width in the prep kernel
    state_bv: int
    state_warps: int
    state_stages: int
    out_bv: int
    out_warps: int
    out_bk: int  # dk piece width in the output kernel
    out_stages: int = 1  # the output kernel has no loop to pipeline
    solve_prec: str = "tf32"  # the block combination of (I + A)^-1 for 16-bit inputs


def _tiles(dtype: torch.dtype, dk: int, dv: int, programs_bv64: int) -> Tiles:
    """Tiles with no spills for 16-bit inputs at dk = dv = 128 (ptxas -v, sm_90, Triton 3.6; numbers in the module
    docstring). programs_bv64: state-kernel programs at BV=64 (seqs * Hv * dv/64); the state pass is sequential per
    program, so BV shrinks when there are too few programs to fill the GPU."""
    if dtype == torch.float32:  # exact fp32 dots run on FMA units with operands in registers: small pieces
        return Tiles(prep_warps=8, prep_bk=16, state_bv=8, state_warps=8, state_stages=1, out_bv=8, out_warps=8,
                     out_bk=16)
    state = (64, 8) if programs_bv64 >= 264 else (32, 4)
    return Tiles(prep_warps=4, prep_bk=32, state_bv=min(state[0], triton.next_power_of_2(dv)), state_warps=state[1],
                 state_stages=2, out_bv=min(64, triton.next_power_of_2(dv)), out_warps=4, out_bk=64)


# ----------------------------------------------------------------------------------------------------------
# kernel 1: per-chunk UT transform


@triton.jit
def _diag_blocks_inverse(a):
    """(I + a)^-1 restricted to the four 16x16 diagonal blocks of a strictly lower [64, 64] fp32 matrix, as the
    block-diagonal [64, 64] matrix. Forward substitution, all four blocks per step (14 steps)."""
    a4 = tl.reshape(a, [4, 16, 4, 16])
    bi = tl.arange(0, 4)[:, None, None, None]
    bj = tl.arange(0, 4)[None, None, :, None]
    d = tl.sum(tl.where(bi == bj, a4, 0.0), 2)  # [4 (block), 16 (row), 16 (col)]
    x = -tl.permute(d, (1, 0, 2))  # [16 (row i), 4, 16 (col)]: -a_b[i, c]; becomes (T_bb - I)
    at = tl.permute(d, (2, 0, 1))  # [16 (col j), 4, 16 (row i)]: a_b[i, j], so a row of a_b is a column here
    r3 = tl.arange(0, 16)[:, None, None]
    c3 = tl.arange(0, 16)[None, None, :]
    r2 = tl.arange(0, 16)[:, None]
    for i in tl.static_range(2, 16):  # rows 0 and 1 are final already
        # new row i = x[i] + sum_{j < i} x[i, j] x[j] with x[i, j] = -a[i, j]: one reduction over rows
        coef = tl.where(r2 == i, 1.0, -tl.sum(tl.where(c3 == i, at, 0.0), 2))  # [16 (j), 4]
        row = tl.sum(coef[:, :, None] * x, 0)  # [4, 16 (col)]
        x = tl.where(r3 == i, row[None, :, :], x)
    xb = tl.permute(x, (1, 0, 2))  # [4, 16, 16]
    tb = tl.where(bi == bj, xb[:, :, None, :], 0.0)  # [4, 16, 4, 16]
    o = tl.arange(0, 64)
    return tl.reshape(tb, [64, 64]) + tl.where(o[:, None] == o[None, :], 1.0, 0.0)


@triton.jit(do_not_specialize=["n_chunks", "n_tokens"])
def _prep_kernel(k_ptr, v_ptr, g_ptr, b_ptr, w_ptr, u_ptr, gc_ptr, ek_ptr, tab_ptr, n_chunks, n_tokens,
                 stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_bt, stride_bh,
                 stride_wt, stride_wh, stride_ut, stride_uh,
                 G: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr,
                 BKC: tl.constexpr, BVC: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr,
                 SOLVE_PREC: tl.constexpr):
    c = tl.program_id(0)
    h = tl.program_id(1)
    s0 = tl.load(tab_ptr + c)
    e0 = tl.load(tab_ptr + n_chunks + c)
    if e0 <= s0:  # an index no chunk owns (the table is sized from shapes, see triton_gdn_chunk_table.py)
        return
    DT = w_ptr.dtype.element_ty
    o = tl.arange(0, 64)
    rows = s0 + o
    rm = rows < e0
    rows64 = rows.to(tl.int64)
    h64 = h.to(tl.int64)
    k_rows = k_ptr + (h // G).to(tl.int64) * stride_kh + rows64[:, None] * stride_kt
    gg = tl.load(g_ptr + h64 * stride_gh + rows64 * stride_gt, mask=rm, other=0.0).to(tl.float32)
    bb = tl.load(b_ptr + h64 * stride_bh + rows64 * stride_bt, mask=rm, other=0.0).to(tl.float32)
    # k k^T over dk in BKC-wide pieces (one piece for 16-bit inputs), with the squared row norms
    a = tl.zeros([64, 64], dtype=tl.float32)
    ss = tl.zeros([64], dtype=tl.float32)
    for d0 in tl.static_range(0, BK, BKC):
        d = d0 + tl.arange(0, BKC)
        kk = tl.load(k_rows + d[None, :], mask=rm[:, None] & (d < DK)[None, :], other=0.0)
        a = tl.dot(kk, tl.trans(kk), a, input_precision=PREC)
        if L2NORM:
            kf = kk.to(tl.float32)
            ss += tl.sum(kf * kf, 1)
    if L2NORM:
        rk = tl.rsqrt(ss + 1e-6)
    else:
        rk = tl.full([64], 1.0, tl.float32)
    gc = tl.cumsum(gg, 0)  # rows past the end have g = 0, so gc stays at gc_last there
    gl = tl.sum(gg, 0)
    tl.store(gc_ptr + h64 * n_tokens + rows, gc, mask=rm)
    tl.store(ek_ptr + h64 * n_tokens + rows, rk * tl.exp(gl - gc), mask=rm)

    br = bb * rk
    lower = o[:, None] > o[None, :]
    a = tl.where(lower, a * tl.exp(tl.where(lower, gc[:, None] - gc[None, :], 0.0)), 0.0) * br[:, None] * rk[None, :]
    # T = (I + a)^-1 = (I + M)^-1 Tb with Tb the inverse of a's block diagonal and M = Tb L, L the strictly
    # block-lower part of a; M is block-nilpotent (M^4 = 0): T = Tb - M (Tb - M (Tb - M Tb)). The diagonal
    # blocks of M X are exact zeros, so T's diagonal blocks keep the fp32 substitution whatever SOLVE_PREC is.
    tb = _diag_blocks_inverse(a)
    m = tl.dot(tb, tl.where(o[:, None] // 16 > o[None, :] // 16, a, 0.0), input_precision=SOLVE_PREC)
    t = tb - tl.dot(m, tb, input_precision=SOLVE_PREC)
    t = tb - tl.dot(m, t, input_precision=SOLVE_PREC)
    t = tb - tl.dot(m, t, input_precision=SOLVE_PREC)

    # w = T diag(beta r exp(gc)) k_raw, u = T diag(beta) v
    tw = (t * (br * tl.exp(gc))[None, :]).to(DT)
    for d0 in tl.static_range(0, BK, BKC):
        d = d0 + tl.arange(0, BKC)
        km = rm[:, None] & (d < DK)[None, :]
        kk = tl.load(k_rows + d[None, :], mask=km, other=0.0)
        w = tl.dot(tw, kk, input_precision=PREC)
        tl.store(w_ptr + h64 * stride_wh + rows64[:, None] * stride_wt + d[None, :], w.to(DT), mask=km)
    tu = (t * bb[None, :]).to(DT)
    for d0 in tl.static_range(0, BDV, BVC):
        dv = d0 + tl.arange(0, BVC)
        vm = rm[:, None] & (dv < DV)[None, :]
        vv = tl.load(v_ptr + h64 * stride_vh + rows64[:, None] * stride_vt + dv[None, :], mask=vm, other=0.0)
        u = tl.dot(tu, vv, input_precision=PREC)
        tl.store(u_ptr + h64 * stride_uh + rows64[:, None] * stride_ut + dv[None, :], u.to(DT), mask=vm)


# ----------------------------------------------------------------------------------------------------------
# kernel 2: the sequential pass over each sequence's chunks


@triton.jit(do_not_specialize=["n_chunks", "n_tokens"])
def _state_kernel(k_ptr, w_ptr, u_ptr, gc_ptr, ek_ptr, hs_ptr, vn_ptr, ssm_ptr, qs_ptr, tab_ptr, slot_ptr,
                  init_ptr, n_chunks, n_tokens,
                  stride_kt, stride_kh, stride_wt, stride_wh, stride_ut, stride_uh, stride_hc, stride_hh,
                  stride_st, stride_sh, stride_sk,
                  G: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                  HAS_POOL: tl.constexpr, HAS_INIT: tl.constexpr, PREC: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    iv = tl.program_id(2)
    s0 = tl.load(qs_ptr + b)
    e0 = tl.load(qs_ptr + b + 1)
    if e0 <= s0:
        return
    c0 = tl.load(tab_ptr + 2 * n_chunks + b)
    nc = tl.cdiv(e0 - s0, 64)
    DT = hs_ptr.dtype.element_ty
    dkr = tl.arange(0, BK)
    dvc = iv * BV + tl.arange(0, BV)
    kmask, vmask = dkr < DK, dvc < DV
    hmask = kmask[:, None] & vmask[None, :]
    state = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_POOL:
        slot = tl.load(slot_ptr + b)
        s_ptrs = ssm_ptr + slot * stride_st + h.to(tl.int64) * stride_sh + dkr[:, None] * stride_sk + dvc[None, :]
        if HAS_INIT:  # noqa: SIM102 -- a compile-time branch around a run-time one
            if tl.load(init_ptr + b) != 0:
                state = tl.load(s_ptrs, mask=hmask, other=0.0)
    k_ptr += (h // G).to(tl.int64) * stride_kh
    w_ptr += h.to(tl.int64) * stride_wh
    u_ptr += h.to(tl.int64) * stride_uh
    vn_ptr += h.to(tl.int64) * stride_uh
    gc_h = gc_ptr + h.to(tl.int64) * n_tokens
    ek_h = ek_ptr + h.to(tl.int64) * n_tokens
    hs_ptrs = hs_ptr + c0.to(tl.int64) * stride_hc + h.to(tl.int64) * stride_hh + dkr[:, None] * DV + dvc[None, :]
    o = tl.arange(0, 64)
    for c in range(nc):
        t0 = s0 + c * 64
        rows = t0 + o
        rm = rows < e0
        rows64 = rows.to(tl.int64)
        tl.store(hs_ptrs, state.to(DT), mask=hmask)
        hs_ptrs += stride_hc  # pointer arithmetic is 64-bit: no int32 overflow at long prompts
        w = tl.load(w_ptr + rows64[:, None] * stride_wt + dkr[None, :], mask=rm[:, None] & kmask[None, :],
                    other=0.0)
        u = tl.load(u_ptr + rows64[:, None] * stride_ut + dvc[None, :], mask=rm[:, None] & vmask[None, :],
                    other=0.0)
        kk = tl.load(k_ptr + rows64[:, None] * stride_kt + dkr[None, :], mask=rm[:, None] & kmask[None, :],
                     other=0.0)
        ek = tl.load(ek_h + rows, mask=rm, other=0.0)
        gl = tl.load(gc_h + tl.minimum(t0 + 63, e0 - 1))
        vn = u.to(tl.float32) - tl.dot(w, state.to(DT), input_precision=PREC)
        tl.store(vn_ptr + rows64[:, None] * stride_ut + dvc[None, :], vn.to(DT), mask=rm[:, None] & vmask[None, :])
        state = state * tl.exp(gl) + tl.dot(tl.trans(kk), (vn * ek[:, None]).to(DT), input_precision=PREC)
    if HAS_POOL:
        tl.store(s_ptrs, state, mask=hmask)


# ----------------------------------------------------------------------------------------------------------
# kernel 3: outputs


@triton.jit(do_not_specialize=["n_chunks", "n_tokens"])
def _output_kernel(q_ptr, k_ptr, gc_ptr, hs_ptr, vn_ptr, o_ptr, tab_ptr, n_chunks, n_tokens, scale,
                   stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
                   stride_hc, stride_hh,
                   G: tl.constexpr, DK: tl.constexpr, BK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                   BKC: tl.constexpr, L2NORM: tl.constexpr, PREC: tl.constexpr):
    c = tl.program_id(0)
    h = tl.program_id(1)
    iv = tl.program_id(2)
    s0 = tl.load(tab_ptr + c)
    e0 = tl.load(tab_ptr + n_chunks + c)
    if e0 <= s0:  # an index no chunk owns
        return
    DT = hs_ptr.dtype.element_ty
    o = tl.arange(0, 64)
    rows = s0 + o
    rm = rows < e0
    rows64 = rows.to(tl.int64)
    h64 = h.to(tl.int64)
    hk = (h // G).to(tl.int64)
    dvc = iv * BV + tl.arange(0, BV)
    vmask = dvc < DV
    q_rows = q_ptr + hk * stride_qh + rows64[:, None] * stride_qt
    k_rows = k_ptr + hk * stride_kh + rows64[:, None] * stride_kt
    hs_base = hs_ptr + c.to(tl.int64) * stride_hc + h64 * stride_hh + dvc[None, :]
    # raw q k^T and q h over dk in BKC-wide pieces (one piece for 16-bit inputs); norms applied afterwards
    p = tl.zeros([64, 64], dtype=tl.float32)
    acc = tl.zeros([64, BV], dtype=tl.float32)
    ssq = tl.zeros([64], dtype=tl.float32)
    ssk = tl.zeros([64], dtype=tl.float32)
    for d0 in tl.static_range(0, BK, BKC):
        d = d0 + tl.arange(0, BKC)
        km = rm[:, None] & (d < DK)[None, :]
        q = tl.load(q_rows + d[None, :], mask=km, other=0.0)
        kk = tl.load(k_rows + d[None, :], mask=km, other=0.0)
        hs = tl.load(hs_base + d[:, None] * DV, mask=(d < DK)[:, None] & vmask[None, :], other=0.0)
        p = tl.dot(q, tl.trans(kk), p, input_precision=PREC)
        acc = tl.dot(q, hs, acc, input_precision=PREC)
        if L2NORM:
            qf = q.to(tl.float32)
            kf = kk.to(tl.float32)
            ssq += tl.sum(qf * qf, 1)
            ssk += tl.sum(kf * kf, 1)
    gc = tl.load(gc_ptr + h64 * n_tokens + rows, mask=rm, other=0.0)
    if L2NORM:
        rq = tl.rsqrt(ssq + 1e-6) * scale
        rk = tl.rsqrt(ssk + 1e-6)
    else:
        rq = tl.full([64], 1.0, tl.float32) * scale
        rk = tl.full([64], 1.0, tl.float32)
    causal = (o[:, None] >= o[None, :]) & rm[:, None]  # padded rows read gc = 0: keep exp() finite there
    p = tl.where(causal, p * tl.exp(tl.where(causal, gc[:, None] - gc[None, :], 0.0)), 0.0) * rk[None, :]
    vn = tl.load(vn_ptr + h64 * stride_vh + rows64[:, None] * stride_vt + dvc[None, :],
                 mask=rm[:, None] & vmask[None, :], other=0.0)
    acc = acc * tl.exp(gc)[:, None]
    acc = tl.dot(p.to(DT), vn, acc, input_precision=PREC) * rq[:, None]
    tl.store(o_ptr + h64 * stride_oh + rows64[:, None] * stride_ot + dvc[None, :],
             acc.to(o_ptr.dtype.element_ty), mask=rm[:, None] & vmask[None, :])


# ----------------------------------------------------------------------------------------------------------


def chunk_gated_delta_varlen_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                    beta: torch.Tensor, ssm_states: torch.Tensor | None, query_start: torch.Tensor,
                                    state_slots: torch.Tensor | None, has_initial_state: torch.Tensor | None,
                                    use_qk_l2norm: bool = True, *,
                                    tune: dict[str, int | str] | None = None) -> torch.Tensor:
    """q, k [T, Hk, dk]; v [T, Hv, dv]; g [T, Hv] fp32 (per-token log decay); beta [T, Hv] -> out [T, Hv, dv].

    query_start [B + 1] int32 on the device, query_start[B] == T (the only per-step input: everything the host
    decides comes from shapes, so the call can be captured in a CUDA graph and replayed with other lengths;
    sequences of length 0 are allowed). ssm_states [S, Hv, dk, dv] fp32 (None: zero initial states, nothing
    written); state_slots [B] int64; has_initial_state [B] bool (None: every sequence starts from zeros).
    `tune` overrides fields of Tiles.
    """
    assert isinstance(query_start, torch.Tensor) and (state_slots is None or isinstance(state_slots, torch.Tensor))
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    t, hk, dk = k.shape
    hv, dv = v.shape[1], v.shape[2]
    assert hv % hk == 0 and q.shape == k.shape and g.shape == (t, hv) and beta.shape == (t, hv)
    dt = q.dtype
    out = torch.empty(t, hv, dv, dtype=dt, device=q.device)
    b = query_start.shape[0] - 1
    if t == 0 or b == 0:
        return out
    if v.dtype != dt:
        v = v.to(dt)
    if k.dtype != dt:
        k = k.to(dt)
    tab, nc = chunk_table_device(query_start, t)
    # 16-bit: no tile dimension below 32 (masked past dk / dv). With 16-wide head dims (the tiny test models)
    # the kernels hit illegal addresses on the H200 (Triton 3.6); 32 and up ran clean.
    lo = 1 if dt == torch.float32 else 32
    bk, bdv = max(lo, triton.next_power_of_2(dk)), max(lo, triton.next_power_of_2(dv))
    tiles = dataclasses.replace(_tiles(dt, dk, dv, b * hv * triton.cdiv(dv, 64)), **(tune or {}))
    tiles = dataclasses.replace(tiles, state_bv=max(lo, tiles.state_bv), out_bv=max(lo, tiles.out_bv))
    prec = "ieee" if dt == torch.float32 else "tf32"
    dev = q.device
    w = torch.empty(t, hv, dk, dtype=dt, device=dev)
    u = torch.empty(t, hv, dv, dtype=dt, device=dev)
    vn = torch.empty(t, hv, dv, dtype=dt, device=dev)
    gc = torch.empty(hv, t, dtype=torch.float32, device=dev)
    ek = torch.empty(hv, t, dtype=torch.float32, device=dev)
    hs = torch.empty(nc, hv, dk, dv, dtype=dt, device=dev)
    g = g.to(torch.float32)

    _prep_kernel[(nc, hv)](
        k, v, g, beta, w, u, gc, ek, tab, nc, t,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        w.stride(0), w.stride(1), u.stride(0), u.stride(1),
        G=hv // hk, DK=dk, BK=bk, DV=dv, BDV=bdv, BKC=min(bk, tiles.prep_bk), BVC=min(bdv, tiles.prep_bk),
        L2NORM=use_qk_l2norm, PREC=prec, SOLVE_PREC="ieee" if dt == torch.float32 else tiles.solve_prec,
        num_warps=tiles.prep_warps)

    has_pool = ssm_states is not None and state_slots is not None
    has_init = has_pool and has_initial_state is not None
    if has_pool:
        assert ssm_states.dtype == torch.float32 and ssm_states.stride(-1) == 1
        assert ssm_states.shape[1:] == (hv, dk, dv)
    ssm = ssm_states if has_pool else hs  # placeholder pointer when unused
    slots = state_slots if has_pool else tab
    init = (has_initial_state.view(torch.uint8) if has_initial_state.dtype == torch.bool else has_initial_state) \
        if has_init else tab
    bv = tiles.state_bv
    _state_kernel[(b, hv, triton.cdiv(dv, bv))](
        k, w, u, gc, ek, hs, vn, ssm, query_start, tab, slots, init, nc, t,
        k.stride(0), k.stride(1), w.stride(0), w.stride(1), u.stride(0), u.stride(1), hs.stride(0), hs.stride(1),
        ssm.stride(0), ssm.stride(1), ssm.stride(2),
        G=hv // hk, DK=dk, BK=bk, DV=dv, BV=bv, HAS_POOL=has_pool, HAS_INIT=has_init, PREC=prec,
        num_warps=tiles.state_warps, num_stages=tiles.state_stages)

    bv = tiles.out_bv
    _output_kernel[(nc, hv, triton.cdiv(dv, bv))](
        q, k, gc, hs, vn, out, tab, nc, t, dk ** -0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), vn.stride(0), vn.stride(1), out.stride(0), out.stride(1),
        hs.stride(0), hs.stride(1),
        G=hv // hk, DK=dk, BK=bk, DV=dv, BV=bv, BKC=min(bk, tiles.out_bk), L2NORM=use_qk_l2norm, PREC=prec,
        num_warps=tiles.out_warps, num_stages=tiles.out_stages)
    return out
