"""Triton chunked Mamba-2 SSD scan (prefill, chunked prefill, mixed batches), varlen over a flat batch, with a
state pool.

Semantics = mamba_ssd.mamba_ssd_varlen_ref: per sequence, chunks of BT tokens that start at the sequence's own
first token (the last one partial; its padded rows get dt = 0, so they neither decay nor feed the state; a
one-token sequence is one chunk of one token, which is exactly the decode step). Within a chunk, with
cum_i = sum_{j <= i} dt_j A (fp32) and the state S carried into the chunk:
    y_i = exp(cum_i) S C_i + sum_{j <= i} (C_i . B_j) exp(cum_i - cum_j) dt_j x_j + D x_i
    S  <- exp(cum_last) S + sum_j exp(cum_last - cum_j) dt_j x_j B_j^T
Two kernels, fp32 accumulation, the step sizes recomputed from the raw dt in each (a cumsum over BT values):

1. `_ssd_state_kernel`, grid (seqs, H, P / BP x N / BN), the only sequential part: S [BP, BN] fp32 in registers
   (BN = N unless the batch has too few sequences to fill the GPU), from
   ssm_states[slot] when has_initial_state (never read otherwise) or zeros; per chunk: save S (input dtype) for
   kernel 2, then S = exp(cum_last) S + (x * w)^T B with w_j = exp(cum_last - cum_j) dt_j, one [BP, BT] x [BT, BN]
   dot. Writes the final S to ssm_states[slot] (nothing without a pool).
2. `_ssd_output_kernel`, grid (chunks, H / HPP, P / BP), parallel: CB = C B^T [BT, BT] over N in pieces, once for
   the program's HPP heads of one group (1 by default; `output_heads` picks as many as keep the grid full, which
   the GPU sweep is to weigh against the registers it costs); per head C S^T [BT, BP],
   M = causal(CB exp(cum_i - cum_j)) diag(dt) rounded to the input dtype, y = M x + exp(cum) C S^T + D x.

One-token sequences (the decode rows of a mixed prefill+decode step) take a branch in each kernel with the decode
step's vector math instead of [BT]-row dots that would be 63/64 masked: without it a mixed step with 255 decode
rows would spend ~85 GFLOP on padding at the Nemotron-H shape.

Dots take input-dtype operands (bf16/fp16) with fp32 accumulation, exact fp32 ("ieee") for fp32 inputs; rounded
to the input dtype: the state snapshots, x * w, and M (where mamba_ssm rounds too). The carried state never is.
The chunk table (chunk -> start, end; sequence -> first chunk) is built on the device from query_start by the
gated delta net's table kernel at this chunk size (triton_gdn_chunk_table.py), its size and every grid from the
shapes T and B only, so mixed prefill+decode steps can be captured in CUDA graphs (no host list, no sync).
Scratch: the snapshots [T // BT + B, H, P, N] in the input dtype (a 16k-token Nemotron-H 8B prompt at BT=64:
257 chunks x 128 heads x 64 x 128 x 2 B = 540 MB per layer call, reused by the allocator across layers).
Rough floor for that prompt, bf16 (not measured): x / B / C / y ~0.6 GB and snapshots 1.1 GB through HBM,
~0.35 ms at 4.8 TB/s; ~86 GFLOP of dots with one head per output program (the default; ~54 with a group's 16
heads sharing C B^T; BT=128: ~140 / ~70), and the state pass runs 256 dependent steps per program.

Tiles (`ssd_chunk_tiles`; ptxas -v for sm_90a, Triton 3.6, compiled on the CPU box with the runtime's
16-divisibility attrs by `scripts/mamba_ssd_bench.py --ptxas`), bf16, Nemotron-H 8B heads (P = 64, N = 128):
  state  BT=64, BP=64, 8 warps, 2 stages    128 regs, 0 spills, 48 KB smem, wgmma   (>= 264 programs)
  state  BT=64, BP=32, 4 warps, 2 stages    128 regs, 0 spills, 20 KB smem, mma     (>= 132: a few prompts)
  state  BT=64, BP=32, BN=64, 4 w, 3 stages  86 regs, 0 spills, 20 KB smem, mma     (fewer: one long prompt)
  output BT=64, BP=64, N pieces of 64, 4 w  154 regs, 0 spills, 24 KB smem, wgmma   (one head per program)
  output the same, 16 heads per program    255 regs, 0 spills, 16 KB smem, wgmma   (8 warps: 254; BP=32: 229)
BT=128 (fewer, larger snapshots, twice the CB flops per token) compiles too: state BP=64 8 warps 126 regs; output
BP=64 8 warps 254 regs (1 CTA per SM), BP=32 4 warps spills 36 B, 16 heads 8 warps spills 296 B: the GPU sweep
decides (`tune`).
fp32 inputs take smaller tiles (exact FMA dots keep operands in registers): a correctness path, not a fast one;
state BP=16 4 warps 128 regs, output BP=16 N pieces of 16 8 warps 112 regs, no spills (4 warps / pieces of 32
spilled 1.4 KB). `scripts/mamba_ssd_bench.py --ptxas` compiles every variant the wrapper launches (dtypes, pool /
no pool, dt limits, heads per program) for sm_90a and prints these numbers.
"""
from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from lamina.kernels.triton_gdn_chunk_table import BLOCK as TABLE_BLOCK
from lamina.kernels.triton_gdn_chunk_table import _chunk_table_kernel
from lamina.kernels.triton_mamba_ssd_decode import _check, _clamp_args, ssd_step_size


@dataclasses.dataclass(frozen=True)
class ChunkTiles:
    bt: int  # chunk length (tokens)
    state_bp: int
    state_warps: int
    state_stages: int
    state_bn: int  # N split of the state tile (>= N: whole rows); more programs for a lone long prompt
    out_bp: int
    out_bn: int  # N piece width in the output kernel
    out_warps: int
    # heads per output program (a divisor of H / G), which share one C B^T; 0: `output_heads` picks from the grid.
    # 1 by default until the H200 sweep says otherwise: the head loop costs registers (255 at 4 warps vs 154).
    out_heads: int = 1


def ssd_chunk_tiles(dtype: torch.dtype, p: int, n: int, programs_bp64: int) -> ChunkTiles:
    """programs_bp64: state-kernel programs at BP = 64 (seqs * H * P / 64). The state pass is sequential per
    program, so its tile shrinks when there are too few programs to fill an H200's 132 SMs twice. out_heads stays
    1 (ChunkTiles says why)."""
    if dtype == torch.float32:
        return ChunkTiles(bt=64, state_bp=16, state_warps=4, state_stages=1, state_bn=n, out_bp=16, out_bn=16,
                          out_warps=8)
    bp = 64 if programs_bp64 >= 264 else 32
    # under 264 programs even at BP = 32 (one or two prompts): split the state rows too, at least 32 wide
    bn = n if programs_bp64 * 2 >= 264 else max(32, triton.next_power_of_2(n) // 2)
    # the split tile pipelines 3 chunks deep (2 stages spilled 16 B at 4 warps)
    stages = 3 if bn < n else 2
    return ChunkTiles(bt=64, state_bp=bp, state_warps=4 if bp == 32 else 8, state_stages=stages, state_bn=bn,
                      out_bp=64, out_bn=64, out_warps=4)


def output_heads(heads: int, groups: int, programs_per_head: int, min_programs: int = 1056) -> int:
    """Heads per output program: as many of a group's heads as keep at least min_programs programs (8 per SM of
    an H200; from shapes only: programs_per_head = chunk indices x p-blocks), so long prompts compute each C B^T
    once per group rather than once per head, and short steps keep their parallelism."""
    per_group = heads // groups
    for hpp in range(per_group, 1, -1):
        if per_group % hpp == 0 and programs_per_head * (heads // hpp) >= min_programs:
            return hpp
    return 1


def ssd_chunk_table(query_start: torch.Tensor, num_tokens: int, bt: int) -> tuple[torch.Tensor, int]:
    """The device chunk table at chunk size bt (layout in triton_gdn_chunk_table.py): (table, num_chunks)."""
    b = query_start.shape[0] - 1
    nc = num_tokens // bt + b
    tab = torch.empty(2 * nc + b, dtype=torch.int32, device=query_start.device)
    if b >= 1:
        assert query_start.dtype == torch.int32 and query_start.stride(0) == 1
        _chunk_table_kernel[(triton.cdiv(nc, TABLE_BLOCK),)](query_start, tab, b, nc, b.bit_length(), BT=bt,
                                                             BLOCK=TABLE_BLOCK)
    return tab, nc


@triton.jit
def _chunk_decay(dt_ptr, rows64, rm, h, stride_dt, stride_dh, dtb, a, dt_min, dt_max, CLAMP: tl.constexpr):
    """(dt [BT], cum [BT], cum_last) of one chunk and head; rows past the chunk's end get dt = 0."""
    raw = tl.load(dt_ptr + rows64 * stride_dt + h * stride_dh, mask=rm, other=0.0)
    dt = tl.where(rm, ssd_step_size(raw, dtb, dt_min, dt_max, CLAMP), 0.0)
    da = dt * a
    return dt, tl.cumsum(da, 0), tl.sum(da, 0)


@triton.jit(do_not_specialize=["n_chunks"])
def _ssd_state_kernel(x_ptr, dt_ptr, alog_ptr, dtb_ptr, b_ptr, hs_ptr, ssm_ptr, qs_ptr, tab_ptr, slot_ptr, init_ptr,
                      n_chunks, dt_min, dt_max, stride_xt, stride_xh, stride_dt, stride_dh, stride_bt, stride_bg,
                      stride_hc, stride_hh, stride_hp, stride_ss, stride_sh, stride_sp,
                      HG: tl.constexpr, P: tl.constexpr, BP: tl.constexpr, N: tl.constexpr, BN: tl.constexpr,
                      N_BLOCKS: tl.constexpr, BT: tl.constexpr, HAS_POOL: tl.constexpr, HAS_INIT: tl.constexpr,
                      CLAMP: tl.constexpr, PREC: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    ip = tl.program_id(2) // N_BLOCKS  # the state tile [BP, BN]: p-block ip, n-block in_
    in_ = tl.program_id(2) % N_BLOCKS
    s0 = tl.load(qs_ptr + b)
    e0 = tl.load(qs_ptr + b + 1)
    if e0 <= s0:
        return
    c0 = tl.load(tab_ptr + 2 * n_chunks + b)
    nc = tl.cdiv(e0 - s0, BT)
    DT = hs_ptr.dtype.element_ty
    h64 = h.to(tl.int64)
    pp = ip * BP + tl.arange(0, BP)
    nn = in_ * BN + tl.arange(0, BN)
    pm, nm = pp < P, nn < N
    smask = pm[:, None] & nm[None, :]
    state = tl.zeros([BP, BN], dtype=tl.float32)
    if HAS_POOL:
        slot = tl.load(slot_ptr + b).to(tl.int64)
        s_ptrs = ssm_ptr + slot * stride_ss + h64 * stride_sh + pp[:, None] * stride_sp + nn[None, :]
        if HAS_INIT:  # noqa: SIM102 -- a compile-time branch around a run-time one
            if tl.load(init_ptr + b) != 0:
                state = tl.load(s_ptrs, mask=smask, other=0.0)
    dtb = tl.load(dtb_ptr + h).to(tl.float32)
    a = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    x_base = x_ptr + h64 * stride_xh + pp[None, :]
    b_base = b_ptr + (h // HG).to(tl.int64) * stride_bg + nn[None, :]
    hs_ptrs = hs_ptr + c0.to(tl.int64) * stride_hc + h64 * stride_hh + pp[:, None] * stride_hp + nn[None, :]
    if e0 - s0 == 1:  # a one-token sequence (a decode row of a mixed step): the update without a [BT] dot
        tl.store(hs_ptrs, state.to(DT), mask=smask)
        s64 = s0.to(tl.int64)
        dt1 = ssd_step_size(tl.load(dt_ptr + s64 * stride_dt + h64 * stride_dh), dtb, dt_min, dt_max, CLAMP)
        x1 = tl.load(x_base + s64 * stride_xt, mask=pm[None, :], other=0.0).to(tl.float32)  # [1, BP]
        b1 = tl.load(b_base + s64 * stride_bt, mask=nm[None, :], other=0.0).to(tl.float32)  # [1, BN]
        state = state * tl.exp(dt1 * a) + tl.trans(x1 * dt1) * b1
    else:
        o = tl.arange(0, BT)
        for c in range(nc):
            rows = s0 + c * BT + o
            rm = rows < e0
            rows64 = rows.to(tl.int64)
            tl.store(hs_ptrs, state.to(DT), mask=smask)
            hs_ptrs += stride_hc  # 64-bit pointer arithmetic: no int32 overflow at long prompts
            dt, cum, cl = _chunk_decay(dt_ptr, rows64, rm, h64, stride_dt, stride_dh, dtb, a, dt_min, dt_max, CLAMP)
            w = tl.exp(cl - cum) * dt
            xx = tl.load(x_base + rows64[:, None] * stride_xt, mask=rm[:, None] & pm[None, :], other=0.0)
            bb = tl.load(b_base + rows64[:, None] * stride_bt, mask=rm[:, None] & nm[None, :], other=0.0)
            xw = (xx.to(tl.float32) * w[:, None]).to(DT)
            state = state * tl.exp(cl) + tl.dot(tl.trans(xw), bb, input_precision=PREC)
    if HAS_POOL:
        tl.store(s_ptrs, state, mask=smask)


@triton.jit(do_not_specialize=["n_chunks"])
def _ssd_output_kernel(x_ptr, dt_ptr, alog_ptr, dtb_ptr, d_ptr, b_ptr, c_ptr, hs_ptr, y_ptr, tab_ptr, n_chunks,
                       dt_min, dt_max, stride_xt, stride_xh, stride_dt, stride_dh, stride_bt, stride_bg, stride_ct,
                       stride_cg, stride_hc, stride_hh, stride_hp, stride_yt, stride_yh,
                       HG: tl.constexpr, HPP: tl.constexpr, P: tl.constexpr, BP: tl.constexpr, N: tl.constexpr,
                       BN: tl.constexpr, BNC: tl.constexpr, BT: tl.constexpr, CLAMP: tl.constexpr,
                       PREC: tl.constexpr):
    c = tl.program_id(0)
    h0 = tl.program_id(1) * HPP  # HPP heads of one group (HPP divides HG): they share C B^T
    s0 = tl.load(tab_ptr + c)
    e0 = tl.load(tab_ptr + n_chunks + c)
    if e0 <= s0:  # an index no chunk owns (the table is sized from shapes)
        return
    DT = hs_ptr.dtype.element_ty
    g64 = (h0 // HG).to(tl.int64)
    pp = tl.program_id(2) * BP + tl.arange(0, BP)
    pm = pp < P
    if e0 - s0 == 1:  # a one-token chunk (a decode row of a mixed step): vector math, no [BT, BT] dots
        # (names here differ from the other branch's: Triton requires a name defined in both to keep its type)
        r1 = s0.to(tl.int64)
        n1 = tl.arange(0, BN)
        n1m = n1 < N
        c1 = tl.load(c_ptr + g64 * stride_cg + r1 * stride_ct + n1, mask=n1m, other=0.0).to(tl.float32)
        b1 = tl.load(b_ptr + g64 * stride_bg + r1 * stride_bt + n1, mask=n1m, other=0.0).to(tl.float32)
        cb1 = tl.sum(c1 * b1, 0)
        for j1 in range(HPP):
            h1 = (h0 + j1).to(tl.int64)
            dt1 = ssd_step_size(tl.load(dt_ptr + r1 * stride_dt + h1 * stride_dh), tl.load(dtb_ptr + h1).to(tl.float32),
                                dt_min, dt_max, CLAMP)
            a1 = -tl.exp(tl.load(alog_ptr + h1).to(tl.float32))
            s1 = tl.load(hs_ptr + c.to(tl.int64) * stride_hc + h1 * stride_hh + pp[:, None] * stride_hp + n1[None, :],
                         mask=pm[:, None] & n1m[None, :], other=0.0).to(tl.float32)  # S [BP, BN]
            x1 = tl.load(x_ptr + h1 * stride_xh + r1 * stride_xt + pp, mask=pm, other=0.0).to(tl.float32)
            y1 = tl.exp(dt1 * a1) * tl.sum(s1 * c1[None, :], 1) + (cb1 * dt1 + tl.load(d_ptr + h1).to(tl.float32)) * x1
            tl.store(y_ptr + h1 * stride_yh + r1 * stride_yt + pp, y1.to(y_ptr.dtype.element_ty), mask=pm)
    else:
        o = tl.arange(0, BT)
        rows = s0 + o
        rm = rows < e0
        rows64 = rows.to(tl.int64)
        xm = rm[:, None] & pm[None, :]
        c_rows = c_ptr + g64 * stride_cg + rows64[:, None] * stride_ct
        b_rows = b_ptr + g64 * stride_bg + rows64[:, None] * stride_bt
        cb = tl.zeros([BT, BT], dtype=tl.float32)
        for n0 in tl.static_range(0, BN, BNC):
            nn = n0 + tl.arange(0, BNC)
            cm = rm[:, None] & (nn < N)[None, :]
            cc = tl.load(c_rows + nn[None, :], mask=cm, other=0.0)
            bb = tl.load(b_rows + nn[None, :], mask=cm, other=0.0)
            cb = tl.dot(cc, tl.trans(bb), cb, input_precision=PREC)
        causal = (o[:, None] >= o[None, :]) & rm[:, None]
        for hi in range(HPP):
            h64 = (h0 + hi).to(tl.int64)
            dtb = tl.load(dtb_ptr + h64).to(tl.float32)
            a = -tl.exp(tl.load(alog_ptr + h64).to(tl.float32))
            dt, cum, cl = _chunk_decay(dt_ptr, rows64, rm, h64, stride_dt, stride_dh, dtb, a, dt_min, dt_max, CLAMP)
            hs_base = hs_ptr + c.to(tl.int64) * stride_hc + h64 * stride_hh + pp[None, :] * stride_hp
            acc = tl.zeros([BT, BP], dtype=tl.float32)
            for n0 in tl.static_range(0, BN, BNC):  # the state carried in: C S^T (C again, from L1 / L2)
                nn = n0 + tl.arange(0, BNC)
                nm = nn < N
                cc = tl.load(c_rows + nn[None, :], mask=rm[:, None] & nm[None, :], other=0.0)
                st = tl.load(hs_base + nn[:, None], mask=nm[:, None] & pm[None, :], other=0.0)  # S^T [BNC, BP]
                acc = tl.dot(cc, st, acc, input_precision=PREC)
            acc = acc * tl.exp(cum)[:, None]
            m = tl.where(causal, cb * tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0)), 0.0) * dt[None, :]
            xx = tl.load(x_ptr + h64 * stride_xh + rows64[:, None] * stride_xt + pp[None, :], mask=xm, other=0.0)
            acc = tl.dot(m.to(DT), xx, acc, input_precision=PREC)
            acc += tl.load(d_ptr + h64).to(tl.float32) * xx.to(tl.float32)
            tl.store(y_ptr + h64 * stride_yh + rows64[:, None] * stride_yt + pp[None, :],
                     acc.to(y_ptr.dtype.element_ty), mask=xm)


def ssd_chunked_triton(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                       D: torch.Tensor, dt_bias: torch.Tensor, ssm_states: torch.Tensor | None,
                       query_start: torch.Tensor, state_slots: torch.Tensor | None,
                       has_initial_state: torch.Tensor | None, dt_min: float = 0.0, dt_max: float = float("inf"), *,
                       tune: dict[str, int] | None = None) -> torch.Tensor:
    """x [T, H, P]; dt [T, H] raw; B, C [T, G, N] (x's dtype); A_log, D, dt_bias [H] -> y [T, H, P] in x's dtype.

    query_start [Bt + 1] int32 on the device, query_start[Bt] == T (the only per-step input: everything the host
    decides comes from shapes, so the call can be captured in a CUDA graph; sequences of length 0 are allowed).
    ssm_states [S, H, P, N] fp32 (None: zero initial states, nothing written); state_slots [Bt] int64;
    has_initial_state [Bt] bool (None: every sequence starts from zeros). `tune` overrides fields of ChunkTiles
    (bt, a power of two >= 16, is a tile choice: the result does not depend on it beyond rounding)."""
    t, h, p, g, n = _check(x, dt, A_log, B, C, D, dt_bias, ssm_states)
    dtype = x.dtype
    y = torch.empty(t, h, p, dtype=dtype, device=x.device)
    bsz = query_start.shape[0] - 1
    if t == 0 or bsz == 0:
        return y
    B, C = (u if u.dtype == dtype else u.to(dtype) for u in (B, C))
    tiles = ssd_chunk_tiles(dtype, p, n, bsz * h * triton.cdiv(p, 64))
    tiles = dataclasses.replace(tiles, **(tune or {}))
    # 16-bit: no tile dimension below 32 (the gated delta kernels hit illegal addresses with 16-wide tiles on the
    # H200, Triton 3.6); dims past P / N are masked.
    lo = 16 if dtype == torch.float32 else 32
    bn = max(lo, triton.next_power_of_2(n))
    bt = max(lo, tiles.bt)
    sbp, obp = (max(lo, min(bp, triton.next_power_of_2(p))) for bp in (tiles.state_bp, tiles.out_bp))
    prec = "ieee" if dtype == torch.float32 else "tf32"
    tab, nc = ssd_chunk_table(query_start, t, bt)
    hpp = tiles.out_heads or output_heads(h, g, nc * triton.cdiv(p, obp))
    assert (h // g) % hpp == 0, f"out_heads {hpp} must divide the {h // g} heads of a group"
    hs = torch.empty(nc, h, p, n, dtype=dtype, device=x.device)
    lo_dt, hi_dt, clamp = _clamp_args(dt_min, dt_max)
    has_pool = ssm_states is not None and state_slots is not None
    has_init = has_pool and has_initial_state is not None
    ssm = ssm_states if has_pool else hs  # placeholder pointers when unused
    slots = state_slots if has_pool else tab
    init = (has_initial_state.view(torch.uint8) if has_initial_state.dtype == torch.bool else has_initial_state) \
        if has_init else tab
    sbn = min(bn, max(lo, triton.next_power_of_2(tiles.state_bn)))
    _ssd_state_kernel[(bsz, h, triton.cdiv(p, sbp) * triton.cdiv(n, sbn))](
        x, dt, A_log, dt_bias, B, hs, ssm, query_start, tab, slots, init, nc, lo_dt, hi_dt,
        x.stride(0), x.stride(1), dt.stride(0), dt.stride(1), B.stride(0), B.stride(1),
        hs.stride(0), hs.stride(1), hs.stride(2), ssm.stride(0), ssm.stride(1), ssm.stride(2),
        HG=h // g, P=p, BP=sbp, N=n, BN=sbn, N_BLOCKS=triton.cdiv(n, sbn), BT=bt, HAS_POOL=has_pool,
        HAS_INIT=has_init, CLAMP=clamp, PREC=prec, num_warps=tiles.state_warps, num_stages=tiles.state_stages)
    _ssd_output_kernel[(nc, h // hpp, triton.cdiv(p, obp))](
        x, dt, A_log, dt_bias, D, B, C, hs, y, tab, nc, lo_dt, hi_dt,
        x.stride(0), x.stride(1), dt.stride(0), dt.stride(1), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        hs.stride(0), hs.stride(1), hs.stride(2), y.stride(0), y.stride(1),
        HG=h // g, HPP=hpp, P=p, BP=obp, N=n, BN=bn, BNC=min(bn, max(lo, tiles.out_bn)), BT=bt, CLAMP=clamp, PREC=prec,
        num_warps=tiles.out_warps)
    return y
