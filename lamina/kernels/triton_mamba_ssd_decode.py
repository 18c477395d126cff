"""Triton Mamba-2 state update for one token per sequence (decode) and for verify chunks (speculative decoding).

Contract: lamina.kernels.mamba_ssd.ssd_recurrent_ref (decode, L = 1) and ssd_verify_ref (verify), with the step
size built from the raw projection in the kernel: dt = clamp(softplus(dt_raw + dt_bias), dt_min, dt_max),
A = -exp(A_log). Per head h (B/C group h // (H // G)) and state S [P, N] fp32:
    S <- exp(dt A) S + dt x B^T;   y = S C + D x

Design
- Grid (B, H, cdiv(P, BLOCK_P)); a program owns S[p-block, :] of one (sequence, head) in registers: one read and
  one write of the state per token is the traffic that matters (Nemotron-H 8B: 128 heads x 64 x 128 x 4 B = 4 MB
  per sequence per layer each way), so the kernel is bandwidth bound. The state load is issued first; x, dt, B,
  C (a few hundred bytes, B/C shared by the heads of a group through L2) hide under it. The reduction over N
  (S C) orders every load of the old state before the store; a barrier makes that explicit.
- Tiles (`decode_tiles`): BLOCK_N = next_pow2(N) (the whole state row), BLOCK_P so a program holds about 2048
  state elements (P=64, N=128: 16 x 128, 4 p-blocks per head, so batch 1 still launches H * 4 programs), 4 warps.
- has_initial_state False: nothing read (zero state), the slot written. No pool (ssm_states or slots None): zero
  state, nothing written. Only device tensors are read (slots, has_initial_state, query_start, candidates) and
  the grid comes from shapes, so a decode step can be captured in a CUDA graph; padded graph rows may all point
  at one spare slot (racing writes of identical garbage there are harmless).
- Verify (`_ssd_verify_kernel`): the same tiling with a loop over the sequence's rows (MAX_LEN, a constexpr,
  bounds it; rows past the sequence's length are masked): after its token t < L - 1 the state goes to
  candidates[b, t], after the last to its own slot. One-token sequences are plain decode steps, so a decode batch
  where only some sequences verify runs in this one kernel.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def ssd_step_size(dt_raw, dt_bias, dt_min, dt_max, CLAMP: tl.constexpr):
    """clamp(softplus(dt_raw + dt_bias), dt_min, dt_max) in fp32, softplus as torch computes it (threshold 20).
    log1p(u) via u log(1 + u) / ((1 + u) - 1): plain log(1 + u) loses the digits of the small steps Mamba-2's
    dt_bias init gives (softplus ~ 1e-3)."""
    z = dt_raw.to(tl.float32) + dt_bias
    u = tl.exp(tl.minimum(z, 20.0))
    v = 1.0 + u
    sp = tl.where(v == 1.0, u, tl.log(v) * (u / (v - 1.0)))
    d = tl.where(z > 20.0, z, sp)
    if CLAMP:
        d = tl.minimum(tl.maximum(d, dt_min), dt_max)
    return d


@triton.jit
def _ssd_decode_kernel(x_ptr, dt_ptr, alog_ptr, dtb_ptr, d_ptr, b_ptr, c_ptr, state_ptr, slot_ptr, init_ptr, y_ptr,
                       dt_min, dt_max, stride_xb, stride_xh, stride_db, stride_dh, stride_bb, stride_bg, stride_cb,
                       stride_cg, stride_ss, stride_sh, stride_sp, stride_yb, stride_yh,
                       HG: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr,
                       BLOCK_N: tl.constexpr, HAS_STATE: tl.constexpr, HAS_INIT: tl.constexpr, CLAMP: tl.constexpr):
    bid = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    g = h // HG
    pp = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    nn = tl.arange(0, BLOCK_N)
    pm, nm = pp < P, nn < N
    smask = pm[:, None] & nm[None, :]
    if HAS_STATE:  # the state load first: it is the traffic, the rest hides under it
        slot = tl.load(slot_ptr + bid).to(tl.int64)
        s_ptrs = state_ptr + slot * stride_ss + h * stride_sh + pp[:, None] * stride_sp + nn[None, :]
        if HAS_INIT:
            live = tl.load(init_ptr + bid) != 0
            s = tl.load(s_ptrs, mask=smask & live, other=0.0)
        else:
            s = tl.zeros([BLOCK_P, BLOCK_N], tl.float32)
    else:
        s = tl.zeros([BLOCK_P, BLOCK_N], tl.float32)
    x = tl.load(x_ptr + bid * stride_xb + h * stride_xh + pp, mask=pm, other=0.0).to(tl.float32)
    bb = tl.load(b_ptr + bid * stride_bb + g * stride_bg + nn, mask=nm, other=0.0).to(tl.float32)
    cc = tl.load(c_ptr + bid * stride_cb + g * stride_cg + nn, mask=nm, other=0.0).to(tl.float32)
    dt = ssd_step_size(tl.load(dt_ptr + bid * stride_db + h * stride_dh), tl.load(dtb_ptr + h).to(tl.float32),
                       dt_min, dt_max, CLAMP)
    a = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    s = s * tl.exp(dt * a) + (dt * x)[:, None] * bb[None, :]
    y = tl.sum(s * cc[None, :], 1) + tl.load(d_ptr + h).to(tl.float32) * x
    if HAS_STATE:
        tl.debug_barrier()  # every read of the old state before the first write (replicated layouts)
        tl.store(s_ptrs, s, mask=smask)
    tl.store(y_ptr + bid * stride_yb + h * stride_yh + pp, y.to(y_ptr.dtype.element_ty), mask=pm)


@triton.jit
def _ssd_verify_kernel(x_ptr, dt_ptr, alog_ptr, dtb_ptr, d_ptr, b_ptr, c_ptr, state_ptr, slot_ptr, cand_ptr,
                       init_ptr, qs_ptr, y_ptr, dt_min, dt_max, stride_xt, stride_xh, stride_dt, stride_dh,
                       stride_bt, stride_bg, stride_ct, stride_cg, stride_ss, stride_sh, stride_sp, stride_cand,
                       stride_yt, stride_yh,
                       HG: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr,
                       BLOCK_N: tl.constexpr, MAX_LEN: tl.constexpr, CLAMP: tl.constexpr):
    bid = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    g = h // HG
    pp = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    nn = tl.arange(0, BLOCK_N)
    pm, nm = pp < P, nn < N
    smask = pm[:, None] & nm[None, :]
    start = tl.load(qs_ptr + bid).to(tl.int64)
    length = tl.load(qs_ptr + bid + 1).to(tl.int64) - start
    slot = tl.load(slot_ptr + bid).to(tl.int64)
    s_off = h * stride_sh + pp[:, None] * stride_sp + nn[None, :]
    live = tl.load(init_ptr + bid) != 0
    s = tl.load(state_ptr + slot * stride_ss + s_off, mask=smask & live, other=0.0)
    dtb = tl.load(dtb_ptr + h).to(tl.float32)
    a = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dd = tl.load(d_ptr + h).to(tl.float32)
    for t in range(MAX_LEN):
        on = t < length
        row = start + t
        x = tl.load(x_ptr + row * stride_xt + h * stride_xh + pp, mask=pm & on, other=0.0).to(tl.float32)
        bb = tl.load(b_ptr + row * stride_bt + g * stride_bg + nn, mask=nm & on, other=0.0).to(tl.float32)
        cc = tl.load(c_ptr + row * stride_ct + g * stride_cg + nn, mask=nm & on, other=0.0).to(tl.float32)
        dt = ssd_step_size(tl.load(dt_ptr + row * stride_dt + h * stride_dh, mask=on, other=0.0), dtb, dt_min,
                           dt_max, CLAMP)
        s_new = s * tl.exp(dt * a) + (dt * x)[:, None] * bb[None, :]
        y = tl.sum(s_new * cc[None, :], 1) + dd * x
        s = tl.where(on, s_new, s)  # rows past the sequence's end leave the state as it was
        tl.store(y_ptr + row * stride_yt + h * stride_yh + pp, y.to(y_ptr.dtype.element_ty), mask=pm & on)
        # the state after token t: to candidate t, or (the last token) to the sequence's own slot
        cand = tl.load(cand_ptr + bid * stride_cand + t, mask=on & (t < length - 1), other=0).to(tl.int64)
        dst = tl.where(t == length - 1, slot, cand)
        tl.debug_barrier()  # the own slot's old state is read before the first write
        tl.store(state_ptr + dst * stride_ss + s_off, s, mask=smask & on)


def decode_tiles(p: int, n: int) -> tuple[int, int, int]:
    """(BLOCK_P, BLOCK_N, num_warps): the whole state row, about 2048 state elements per program."""
    block_n = triton.next_power_of_2(n)
    block_p = min(triton.next_power_of_2(p), max(1, 2048 // block_n))
    warps = 4 if block_p * block_n >= 2048 else (2 if block_p * block_n >= 512 else 1)
    return block_p, block_n, warps


def _clamp_args(dt_min: float, dt_max: float) -> tuple[float, float, bool]:
    clamp = dt_min > 0.0 or dt_max != float("inf")
    return float(dt_min), (float(dt_max) if dt_max != float("inf") else 3.0e38), clamp


def _check(x, dt, A_log, B, C, D, dt_bias, ssm_states):
    t, h, p = x.shape
    g, n = B.shape[1], B.shape[2]
    assert dt.shape == (t, h) and B.shape == (t, g, n) and C.shape == B.shape and h % g == 0
    assert A_log.shape == (h,) and D.shape == (h,) and dt_bias.shape == (h,)
    assert x.stride(-1) == 1 and B.stride(-1) == 1 and C.stride(-1) == 1
    if ssm_states is not None:
        assert ssm_states.dtype == torch.float32 and ssm_states.shape[1:] == (h, p, n) and ssm_states.stride(-1) == 1
    return t, h, p, g, n


def ssd_decode_triton(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                      D: torch.Tensor, dt_bias: torch.Tensor, ssm_states: torch.Tensor | None,
                      state_slots: torch.Tensor | None, has_initial_state: torch.Tensor | None,
                      dt_min: float = 0.0, dt_max: float = float("inf"), *, out: torch.Tensor | None = None,
                      block_p: int | None = None, num_warps: int | None = None) -> torch.Tensor:
    """One token per sequence: x [Bt, H, P]; dt [Bt, H] raw; B, C [Bt, G, N]; A_log, D, dt_bias [H].

    Returns y [Bt, H, P] in x's dtype; ssm_states[state_slots[b]] ([H, P, N] fp32) updated in place.
    has_initial_state [Bt] bool (None: every sequence starts from zeros). block_p / num_warps override the tiles."""
    bsz, h, p, g, n = _check(x, dt, A_log, B, C, D, dt_bias, ssm_states)
    if out is None:
        out = torch.empty(bsz, h, p, dtype=x.dtype, device=x.device)
    assert out.shape == (bsz, h, p) and out.stride(-1) == 1
    if bsz == 0:
        return out
    has_state = ssm_states is not None and state_slots is not None
    has_init = has_state and has_initial_state is not None
    state, slots = (ssm_states, state_slots) if has_state else (out, dt)
    ss = ssm_states.stride() if has_state else (0, 0, 0, 0)
    assert not has_state or (state_slots.shape == (bsz,) and state_slots.stride(0) == 1)
    init = has_initial_state.view(torch.uint8) if has_init and has_initial_state.dtype == torch.bool else (
        has_initial_state if has_init else dt)
    bp, bn, warps = decode_tiles(p, n)
    bp, warps = block_p or bp, num_warps or warps
    lo, hi, clamp = _clamp_args(dt_min, dt_max)
    _ssd_decode_kernel[(bsz, h, triton.cdiv(p, bp))](
        x, dt, A_log, dt_bias, D, B, C, state, slots, init, out, lo, hi,
        x.stride(0), x.stride(1), dt.stride(0), dt.stride(1), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        ss[0], ss[1], ss[2], out.stride(0), out.stride(1),
        HG=h // g, P=p, N=n, BLOCK_P=bp, BLOCK_N=bn, HAS_STATE=has_state, HAS_INIT=has_init, CLAMP=clamp,
        num_warps=warps)
    return out


def ssd_verify_triton(x: torch.Tensor, dt: torch.Tensor, A_log: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                      D: torch.Tensor, dt_bias: torch.Tensor, ssm_states: torch.Tensor, query_start: torch.Tensor,
                      state_slots: torch.Tensor, candidates: torch.Tensor, has_initial_state: torch.Tensor,
                      max_len: int, dt_min: float = 0.0, dt_max: float = float("inf"), *,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Verify chunks and single tokens: x [T, H, P] etc. as the chunked path; query_start [Bt + 1] int32;
    state_slots [Bt] int64; candidates [Bt, >= max_len - 1] int64 (row b: its L_b - 1 candidate slots first);
    has_initial_state [Bt] bool; max_len >= every L_b. Returns y [T, H, P]; the states land in ssm_states."""
    total, h, p, g, n = _check(x, dt, A_log, B, C, D, dt_bias, ssm_states)
    bsz = state_slots.shape[0]
    assert candidates.dim() == 2 and candidates.shape[0] == bsz and candidates.stride(-1) == 1
    if out is None:
        out = torch.empty(total, h, p, dtype=x.dtype, device=x.device)
    if bsz == 0 or total == 0:
        return out
    init = has_initial_state.view(torch.uint8) if has_initial_state.dtype == torch.bool else has_initial_state
    bp, bn, warps = decode_tiles(p, n)
    lo, hi, clamp = _clamp_args(dt_min, dt_max)
    ss = ssm_states.stride()
    _ssd_verify_kernel[(bsz, h, triton.cdiv(p, bp))](
        x, dt, A_log, dt_bias, D, B, C, ssm_states, state_slots, candidates, init, query_start, out, lo, hi,
        x.stride(0), x.stride(1), dt.stride(0), dt.stride(1), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        ss[0], ss[1], ss[2], candidates.stride(0), out.stride(0), out.stride(1),
        HG=h // g, P=p, N=n, BLOCK_P=bp, BLOCK_N=bn, MAX_LEN=max(1, max_len), CLAMP=clamp, num_warps=warps)
    return out
